"""The end-to-end TTFT harness's CPU-checkable parts (bench/e2e/pfe2e), no GPU and no torch:
vLLM's chained block hashes, the paged-layout registration and the page <-> contiguous K/V
conversion (over numpy, the same code the GPU runs over torch; also over torch where it is
installed), the Mooncake trace's scaling and the LRU model, and the report (tables, goals, the
SVG chart) made from records.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "e2e"))

from pfe2e import hashing, layout, models, report, trace  # noqa: E402


def sha(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# --------------------------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------------------------


def test_hashes_chain_over_the_prefix_as_vllm_defines_them():
    toks = list(range(100, 140))  # 2 full blocks and 8 tokens
    hs = hashing.chained_block_hashes(toks, 16, seed="0")
    root = sha("0")
    h0 = sha((root, tuple(range(100, 116)), None))
    h1 = sha((h0, tuple(range(116, 132)), None))
    assert hs == [h0, h1]
    assert hashing.none_hash("0") == root
    assert hashing.chained_block_hashes(toks, 16, seed="1")[0] != h0


def test_a_changed_token_changes_its_block_and_every_later_one_only():
    rng = random.Random(1)
    a = [rng.randrange(50000) for _ in range(16 * 6)]
    b = list(a)
    b[16 * 3 + 5] += 1
    ha, hb = hashing.chained_block_hashes(a), hashing.chained_block_hashes(b)
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:]))


def test_integer_types_hash_like_python_ints_and_chains_continue():
    toks = list(range(48))
    assert hashing.chained_block_hashes(np.array(toks, dtype=np.int64)) == hashing.chained_block_hashes(toks)
    whole = hashing.chained_block_hashes(toks)
    first = hashing.chained_block_hashes(toks[:16])
    assert hashing.chained_block_hashes(toks[16:], parent=first[-1]) == whole[1:]
    assert hashing.chained_block_hashes(toks[:15]) == []


def test_connector_keys_and_cached_prefix():
    hs = [bytes([i]) * 32 for i in range(7)]
    assert hashing.per_connector_block(hs, 1) == hs
    assert hashing.per_connector_block(hs, 2) == [hs[1], hs[3], hs[5]]
    assert hashing.cached_prefix_blocks(32768, 16) == 2047
    assert hashing.cached_prefix_blocks(32768, 1) == 2047
    assert hashing.cached_prefix_blocks(32769, 1) == 2048
    assert hashing.cached_prefix_blocks(1000, 16) == 61
    for bad in ((0, 1), (10, 0), (10, 11)):
        with pytest.raises(ValueError):
            hashing.cached_prefix_blocks(*bad)
    with pytest.raises(ValueError):
        hashing.chained_block_hashes([1, 2], 0)


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


def test_registration_follows_the_connectors_rule_for_both_layouts():
    kv = layout.PagedLayout("kv-first", 4096, 16, 8, 128)
    r = kv.registration()
    # pf_bench.py's numbers for the same tensor: bytes_per_block = stride(1) * 2, kv_stride = stride(0) * 2.
    assert r == layout.Registration(4096, 16 * 8 * 128 * 2, 4096 * 16 * 8 * 128 * 2, 2)
    a = np.zeros((2, 5, 16, 2, 4), dtype=np.float16)
    assert layout.registration_from_strides(a.shape, [s // a.itemsize for s in a.strides], a.itemsize) == \
        layout.PagedLayout("kv-first", 5, 16, 2, 4).registration()
    bf = layout.PagedLayout("blocks-first", 4096, 16, 8, 128).registration()
    assert bf == layout.Registration(4096, 2 * 16 * 8 * 128 * 2, 0, 1)
    lists = layout.registration_lists(r, 3)
    assert lists["segments_list"] == [2, 2, 2] and lists["kv_stride_bytes_list"] == [r.kv_stride_bytes] * 3
    with pytest.raises(ValueError):
        layout.PagedLayout("page-first", 1, 16, 1, 1)
    with pytest.raises(ValueError):
        layout.registration_from_strides([4], [1], 2)


def pages_of(kind: str, nb: int = 12, bt: int = 4, h: int = 3, d: int = 5) -> np.ndarray:
    shape = layout.PagedLayout(kind, nb, bt, h, d).layer_shape
    return np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)


def slow_gather(pages: np.ndarray, kind: str, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The definition, token by token through vLLM's slot mapping."""
    bt, h, d = pages.shape[2:]
    k = np.zeros((1, h, n, d), dtype=pages.dtype)
    v = np.zeros_like(k)
    for t, slot in enumerate(layout.slot_mapping(ids, n, bt)):
        b, off = divmod(slot, bt)
        if kind == "kv-first":
            k[0, :, t], v[0, :, t] = pages[0, b, off], pages[1, b, off]
        else:
            k[0, :, t], v[0, :, t] = pages[b, 0, off], pages[b, 1, off]
    return k, v


@pytest.mark.parametrize("kind", layout.LAYOUTS)
@pytest.mark.parametrize("n", [1, 4, 7, 16, 19])
def test_gather_reads_a_shuffled_block_table_token_by_token(kind, n):
    pages = pages_of(kind)
    ids = layout.block_table(2, 8, shuffle_seed=3)
    assert ids != sorted(ids) and sorted(ids) == list(range(2, 10))
    k, v = layout.gather_kv(pages, ids, n, kind)
    ek, ev = slow_gather(pages, kind, ids, n)
    assert k.shape == (1, 3, n, 5)
    assert np.array_equal(k, ek) and np.array_equal(v, ev)


@pytest.mark.parametrize("kind", layout.LAYOUTS)
def test_scatter_then_gather_round_trips_and_touches_only_its_blocks(kind):
    rng = np.random.default_rng(7)
    pages = np.full(layout.PagedLayout(kind, 12, 4, 3, 5).layer_shape, -1, dtype=np.int32)
    k = rng.integers(0, 1000, (1, 3, 22, 5)).astype(np.int32)
    v = rng.integers(0, 1000, (1, 3, 22, 5)).astype(np.int32)
    ids = [9, 2, 5, 0, 11]  # 20 tokens; the 2 left over are a partial block, never written
    layout.scatter_kv(pages, ids, k, v, kind)
    gk, gv = layout.gather_kv(pages, ids, 20, kind)
    assert np.array_equal(gk, k[:, :, :20]) and np.array_equal(gv, v[:, :, :20])
    others = [b for b in range(12) if b not in ids]
    untouched = pages[:, others] if kind == "kv-first" else pages[others]
    assert (untouched == -1).all()
    # A dense copy is the same values laid out [1, heads, tokens, dim].
    dense = layout.contiguous(gk)
    assert dense.flags["C_CONTIGUOUS"] and np.array_equal(dense, gk)


@pytest.mark.parametrize("kind", layout.LAYOUTS)
def test_scatter_from_a_token_offset_writes_the_later_blocks(kind):
    pages = np.zeros(layout.PagedLayout(kind, 6, 4, 2, 3).layer_shape, dtype=np.int64)
    k = np.arange(1 * 2 * 13 * 3).reshape(1, 2, 13, 3)
    v = -k
    layout.scatter_kv(pages, [4, 1], k, v, kind, token_start=4)  # tokens 4..11
    gk, gv = layout.gather_kv(pages, [4, 1], 8, kind)
    assert np.array_equal(gk, k[:, :, 4:12]) and np.array_equal(gv, v[:, :, 4:12])


def test_conversion_errors():
    pages = pages_of("kv-first")
    with pytest.raises(ValueError):
        layout.gather_kv(pages, [0, 1], 9)  # 2 blocks of 4 tokens
    with pytest.raises(ValueError):
        layout.scatter_kv(pages, [0, 1], np.zeros((1, 3, 7, 5)), np.zeros((1, 3, 7, 5)))  # 8 tokens needed
    with pytest.raises(ValueError):
        layout.scatter_kv(pages, [0], np.zeros((1, 2, 4, 5)), np.zeros((1, 2, 4, 5)))  # 2 heads, pages have 3
    with pytest.raises(ValueError):
        layout.slot_mapping([0], 5, 4)


def test_the_same_conversion_over_torch():
    torch = pytest.importorskip("torch", reason="torch is not installed here (the GPU machine has it)")
    for kind in layout.LAYOUTS:
        lay = layout.PagedLayout(kind, 10, 16, 2, 8)
        pages = torch.zeros(lay.layer_shape, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 48, 8, dtype=torch.bfloat16)
        v = torch.randn(1, 2, 48, 8, dtype=torch.bfloat16)
        ids = torch.tensor([7, 0, 3])
        layout.scatter_kv(pages, ids, k, v, kind)
        gk, gv = layout.gather_kv(pages, ids, 40, kind)
        assert torch.equal(gk, k[:, :, :40]) and torch.equal(gv, v[:, :, :40])
        t = pages
        r = layout.registration_from_strides(tuple(t.shape), tuple(t.stride()), t.element_size())
        assert r == lay.registration()


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def test_model_shapes():
    m = models.get("llama-3.1-8b")
    assert m.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    assert m.kv_bytes_per_block(16) == 2 << 20
    assert 7.9e9 < m.approx_params < 8.1e9
    assert models.get("qwen3-8b").num_layers == 36
    with pytest.raises(KeyError, match="known"):
        models.get("gpt-5")


# --------------------------------------------------------------------------------------------
# trace
# --------------------------------------------------------------------------------------------


def test_parse_sorts_and_names_a_bad_line():
    reqs = trace.parse(['{"timestamp": 5, "input_length": 1000, "hash_ids": [0, 1]}', "",
                        '{"timestamp": 1, "input_length": 512, "output_length": 3, "hash_ids": [0]}'])
    assert [r.timestamp for r in reqs] == [1, 5]
    with pytest.raises(ValueError, match="line 2"):
        trace.parse(['{"timestamp": 1, "input_length": 1, "hash_ids": []}', '{"timestamp": 1}'])


def test_scaling_keeps_the_last_blocks_share_and_truncates_whole_blocks():
    r = trace.TraceRequest(0, 512 * 2 + 100, (7, 8, 9))
    s = trace.scale(r, 0, 64)
    # 100 of 512 tokens -> 12.5 of 64, rounded up.
    assert (s.num_tokens, s.last_block_tokens, s.truncated) == (64 * 2 + 13, 13, False)
    assert trace.scale(trace.TraceRequest(0, 1, (1,)), 0, 64).num_tokens == 1
    t = trace.scale(trace.TraceRequest(0, 512 * 10, tuple(range(10))), 0, 64, max_tokens=200)
    assert (t.hash_ids, t.num_tokens, t.truncated) == ((0, 1, 2), 192, True)
    with pytest.raises(ValueError):
        trace.scale(r, 0, 64, max_tokens=10)


def test_shared_hash_ids_share_tokens_and_so_vllm_block_hashes():
    a = trace.scale(trace.TraceRequest(0, 512 * 3, (1, 2, 3)), 0, 32)
    b = trace.scale(trace.TraceRequest(0, 512 * 3, (1, 2, 4)), 1, 32)
    ta, tb = trace.request_token_ids(a, 32, 1000), trace.request_token_ids(b, 32, 1000)
    assert ta[:64] == tb[:64] and ta[64:] != tb[64:]
    assert trace.request_token_ids(a, 32, 1000) == ta  # deterministic
    ha, hb = hashing.chained_block_hashes(ta), hashing.chained_block_hashes(tb)
    assert ha[:4] == hb[:4] and ha[4] != hb[4]


def test_lru_model_follows_the_servers_rules():
    sim = trace.LruSim(3 * 1024 + 100, 1000)  # footprint 1024, capacity 3.1 KiB -> 3 blocks
    assert (sim.capacity, sim.footprint) == (3 * 1024, 1024)
    assert sim.save(["a", "b", "c"]).inserted == 3
    assert sim.query(["a", "x", "b"]) == 1  # stops at the first miss, touching only "a"
    assert sim.lru_order() == ["b", "c", "a"]
    out = sim.save(["c", "d", "d"])  # "c" resident: skipped untouched; "d" once; evicts "b"
    assert (out.inserted, out.evicted) == (1, 1)
    assert sim.lru_order() == ["c", "a", "d"]
    big = sim.save(["p", "q", "r", "s"])
    assert big.rejected and len(sim) == 3


def reference_lru(workload, cap_blocks):
    """A list-based LRU, written differently, for the model to agree with."""
    order, hits = [], []
    for keys in workload:
        n = 0
        for k in keys:
            if k not in order:
                break
            order.remove(k)
            order.append(k)
            n += 1
        hits.append(n)
        plan = []
        for k in keys[n:]:
            if k not in order and k not in plan:
                plan.append(k)
        if len(plan) > cap_blocks:
            continue
        while cap_blocks - len(order) < len(plan):
            order.pop(0)
        order += plan
    return hits


def test_lru_model_matches_a_plain_reference_on_random_prefix_workloads():
    rng = random.Random(5)
    for _ in range(20):
        roots = [[rng.randrange(10_000) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
        workload = []
        for _ in range(60):
            r = rng.choice(roots)
            keys = r[:rng.randrange(1, len(r) + 1)] + [rng.randrange(10_000, 20_000) for _ in range(rng.randrange(0, 4))]
            workload.append(keys)
        cap = rng.randrange(2, 20)
        sim = trace.LruSim(cap * 512, 512)
        got = []
        for keys in workload:
            h = sim.query(keys)
            got.append(h)
            sim.save(keys[h:])
        assert got == reference_lru(workload, cap)


def test_the_shipped_trace_is_found_and_whole(monkeypatch):
    p = trace.find()
    reqs = trace.load(p)
    assert len(reqs) == 12_031
    assert sum(len(r.hash_ids) for r in reqs) == 288_500
    assert len({h for r in reqs for h in r.hash_ids}) == 182_790
    assert len(trace.load(p, 10)) == 10
    monkeypatch.setenv("E2E_TRACE", "/nonexistent/trace.jsonl")
    assert trace.find() == p  # a missing override falls through to the shipped copy
    inf = trace.InfiniteSim()
    assert inf.save(["a", "b", "a"]).inserted == 2 and inf.query(["a", "b", "c"]) == 2


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def hit(server, tier, tokens, ttft, backend="direct", exact=True, status="ok", kv=2 << 30, **phases):
    reps = [dict({"ttft_s": ttft, "query_s": 0.0003, "load_s": kv / 50e9, "rebuild_s": 0.004, "suffix_s": 0.02}, **phases)] * 3
    return {"kind": "hit", "server": server, "tier": tier, "backend": backend, "tokens": tokens, "kv_bytes": kv, "status": status,
            "median_ttft_s": ttft, "byte_exact": exact, "logit_exact": exact, "reps": reps, "argmax_vs_cold": 1.0}


def sample_records():
    return [
        {"kind": "env", "date": "2026-12-07 10:00 UTC", "gpu": "NVIDIA H100 80GB HBM3", "driver": "580", "torch": "2.11.0", "transformers": "5.17.0",
         "model": "llama-3.1-8b", "layout": "kv-first", "new_tokens": 16, "h2d_bytes_per_s": 50e9, "d2h_bytes_per_s": 51e9, "bus_probe_mib": 1024},
        {"kind": "cold", "server": "ours", "tokens": 1024, "median_s": 0.05},
        {"kind": "cold", "server": "ours", "tokens": 32768, "median_s": 1.6},
        {"kind": "cold", "server": "pegaflow", "tokens": 32768, "median_s": 1.7},
        {"kind": "suffix_alone", "server": "ours", "tokens": 1024, "median_s": 0.02},
        {"kind": "suffix_alone", "server": "ours", "tokens": 32768, "median_s": 0.03},
        hit("ours", "dram", 1024, 0.03, kv=63 << 21),
        hit("ours", "dram", 32768, 0.12, kv=2047 << 21),
        dict(hit("ours", "ssd", 32768, 3.9, kv=2047 << 21, query_s=3.75), ssd_read_gbps=(2047 << 21) / 3.75 / 1e9),
        hit("pegaflow", "dram", 32768, 0.5, kv=2047 << 21),
        hit("pegaflow", "dram", 32768, 0.2, backend="kernel", kv=2047 << 21),
        hit("pegaflow", "ssd", 32768, None, status="partial", kv=2047 << 21),
        {"kind": "stage", "stage": "ours", "status": "done", "elapsed_s": 80},
        {"kind": "note", "text": "something said"},
    ]


def test_ttft_table_has_a_row_per_length_and_marks_what_failed():
    md = report.ttft_table(sample_records())
    lines = md.splitlines()
    assert lines[0].startswith("| context | KV (GiB) | cold prefill | ours DRAM hit | ours SSD hit |")
    assert "ours peer hit" not in lines[0]  # never measured: no column
    row32 = next(l for l in lines if l.startswith("| 32K"))
    cells = [c.strip() for c in row32.strip("|").split("|")]
    assert cells[1] == "4.00" and cells[2] == "1600" and cells[3] == "120"
    assert "✗ (partial)" in row32 and cells[-2] == "13.3×" and cells[-1] == "yes"
    recs = sample_records() + [hit("ours", "dram", 1024, 0.03, exact=False)]
    assert report.ttft_table(recs).splitlines()[2].endswith("| NO |")


def test_floor_is_the_bus_time_of_the_kv_plus_the_suffix_alone():
    rows = {r["tokens"]: r for r in report.floor_rows(sample_records())}
    r = rows[32768]
    kv = 2047 << 21
    assert r["bus_s"] == pytest.approx(kv / 50e9)
    assert r["floor_s"] == pytest.approx(kv / 50e9 + 0.03)
    assert r["ratio"] == pytest.approx(0.12 / (kv / 50e9 + 0.03))
    assert r["load_over_bus_s"] == pytest.approx(0.0)
    assert r["suffix_over_alone_s"] == pytest.approx(0.02 - 0.03)
    assert "| 32K |" in report.floor_table(sample_records())


def test_goals_say_met_or_not():
    g = "\n".join(report.goal_lines(sample_records()))
    assert "DRAM hit at 32K: 120 ms = 1/13.3 of cold 1600 ms (goal ≤ 1/10): met" in g
    assert "32K: ours DRAM 120 ms vs PegaFlow's best DRAM (kernel) 200 ms: ahead" in g
    # 4.29 GB read in 3.75 s; the other 0.15 s of the hit leave 1.45 s of cold's 1.6 s for the read.
    assert "32K: ours SSD hit 3900 ms vs cold 1600 ms: slower than cold by 2300 ms (promotion read 1.14 GB/s; beating cold needs ≥ 2.96 GB/s)" in g
    assert "byte- and logit-exact: 5 of 5" in g
    assert "hit/floor at 1K: 1.32× (goal ≤ 1.2×): NOT met" in g


def test_svg_chart_is_well_formed_with_a_line_per_measured_series():
    svg = report.svg_chart(sample_records())
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    paths = root.findall(f"{ns}path")
    # cold, ours DRAM, ours SSD, PegaFlow direct, PegaFlow kernel (PegaFlow's SSD failed)
    assert len(paths) == 5
    assert len(root.findall(f"{ns}circle")) == 2 + 2 + 1 + 1 + 1
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "32K" in texts and "ours: SSD hit" in texts and "PegaFlow 0.25.1: SSD hit" not in texts
    empty = ET.fromstring(report.svg_chart([]))
    assert any(t.text == "no measurements" for t in empty.iter(f"{ns}text"))


def test_stats_helpers():
    assert report.percentile([5, 1, 3, 2, 4], 50) == 3
    assert report.percentile(list(range(1, 101)), 99) == 99
    assert report.percentile([7], 99) == 7 and report.percentile([], 50) is None
    assert report.median([3, 1, 2]) == 2 and report.median([]) is None
    assert report.fmt_ms(0.0123) == "12.3" and report.fmt_ms(1.5) == "1500" and report.fmt_ms(None) == "–"
    assert report.fmt_tokens(32768) == "32K" and report.fmt_tokens(1000) == "1000"


def test_write_all_reads_a_torn_results_file(tmp_path):
    lines = [json.dumps(r) for r in sample_records()]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + '\n{"kind": "hit", "serv')
    md = report.write_all(tmp_path)
    assert "| 32K |" in md and "### Goals" in md and "something said" in md
    assert json.loads((tmp_path / "results.json").read_text())[1]["kind"] == "cold"
    ET.fromstring((tmp_path / "ttft.svg").read_text())
    assert report.main([str(tmp_path)]) == 0
    assert report.main([]) == 2


def test_trace_summary():
    t = {"kind": "trace", "requests": 10, "tokens": 5000, "hit_rate": 0.2, "sim_lru_hit_rate": 0.1, "sim_infinite_hit_rate": 0.25,
         "with_mean_s": 0.05, "with_p50_s": 0.04, "with_p99_s": 0.2, "without_mean_s": 0.06, "without_p50_s": 0.05, "without_p99_s": 0.25,
         "pool": "8gb", "loading_answers": 3, "argmax_agree": 9, "byte_exact": True}
    s = report.trace_summary([t])
    assert "| with the server (DRAM + SSD) | 10 | 5000 | 20.0% | 50.0 | 40.0 | 200 |" in s
    assert "LRU simulation of the DRAM tier alone (8gb): block hit rate 10.0%" in s
    assert report.trace_summary([]) == ""
