"""The SSD tier (`tiers/ssd`, kind `ssd`) driven by the PUBLISHED client: blocks evicted
from a small DRAM pool are written to an SSD directory, come back through QueryLoading ->
QueryReady byte-exact (also after `kill -9` and a restart on the same directory), a second
server cannot take the same directory (not even once the owner file is removed), blocks of
another slot layout are a miss, `/health` shows the tier, membership queries never answer
Loading, and a record whose payload was swapped with another's on disk (a misdirected write)
is never served, live or after a restart.

Layout (pftest.HostKv defaults): 4 layers x 16 blocks, 256-byte segments: 2 KiB per block.
DRAM: 128 KiB = 64 blocks; the tests save 16 batches of 16 blocks (4x the pool), each batch
queried first (a miss: the "first sighting" the default admission wants) and then saved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest

import pftest
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryLoading, QueryReady

POOL = "128kb"  # 64 blocks of 2 KiB
BATCHES = 16  # 16 x 16 blocks = 256 blocks = 4x the pool
SSD_CAPACITY = "64mb"


def ssd_args(path) -> list[str]:
    return ["--ssd-cache-path", str(path), "--ssd-cache-capacity", SSD_CAPACITY]


def pipeline(ssd_path, admission: str | None = None, io: str | None = None, pool: str = POOL,
             segment_size: str | None = None) -> str:
    adm = f'admission = "{admission}"\n' if admission else ""
    if io:
        adm += f'io = "{io}"\n'
    if segment_size:
        adm += f'segment_size = "{segment_size}"\n'
    return f"""
[[tier]]
kind = "dram"
capacity = "{pool}"

[[tier]]
kind = "ssd"
paths = ["{ssd_path}"]
capacity = "{SSD_CAPACITY}"
{adm}
[[registrar]]
kind = "host-memfd"

[[transport]]
kind = "memcpy"
"""


def metric(server, name, **labels) -> float:
    return pftest.metric_value(server.metrics(), name, **labels)


def hashes(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes for _ in range(n)]


def save(client, inst, kv, ids, hs, layers=None):
    layers = layers if layers is not None else kv.layer_names
    ok, msg = client.save(inst, 0, 0, 0, [(name, list(ids), list(hs)) for name in layers])
    assert ok is True, msg


def settle_demotions(server, timeout: float = 5.0) -> bool:
    """Waits (bounded) until nothing waits in the demotion queue and the demotion counters
    stop moving: the demoted blocks are on the SSD or accounted as failed/dropped. False
    when the queue did not drain in time (the SSD's writes do not complete)."""
    deadline = time.monotonic() + timeout
    last = None
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        m = server.metrics()
        now = (
            pftest.metric_value(m, "pegaflow_tier_demotions_total", tier="ssd"),
            pftest.metric_value(m, "pegaflow_ssd_blocks_total", op="write"),
            pftest.metric_value(m, "pegaflow_tier_demotion_queue_blocks"),
        )
        if now != last:
            last, stable_since = now, time.monotonic()
        elif now[2] == 0 and time.monotonic() - stable_since >= 0.3:
            return True
        time.sleep(0.02)
    return False


def demotion_figures(server) -> dict:
    return {
        (n, tuple(sorted(l.items()))): v
        for n, l, v in pftest.parse_metrics(server.metrics())
        if n.startswith(("pegaflow_tier_demotion", "pegaflow_ssd_blocks_total", "pegaflow_ssd_io_errors",
                         "pegaflow_cache_block_admission"))
    }


def fill_through_ssd(server, client, inst, kv, batches: int = BATCHES, query_first: bool = True):
    """Saves `batches` batches of kv.num_blocks new blocks (random bytes each), each queried
    first (a miss) when `query_first`. Returns [(hashes, [[bytes per layer] per block])]."""
    out = []
    for i in range(batches):
        kv.randomize()
        hs = hashes(kv.num_blocks)
        if query_first:
            r = client.query_prefetch(inst, hs, f"req-fill-{i}-{uuid.uuid4().hex[:6]}")
            assert isinstance(r, QueryReady) and r.num_hit_blocks == 0, r
        want = [[kv.block(l, b) for l in range(kv.num_layers)] for b in range(kv.num_blocks)]
        save(client, inst, kv, range(kv.num_blocks), hs)
        out.append((hs, want))
        # Pace the saves so that the demotion queue (a quarter of this tiny pool) never
        # sheds a block by design ("a full queue drops its oldest"): what this suite tests
        # is the SSD path, not queue overflow.
        assert settle_demotions(server), (
            f"after batch {i}: the demotion queue did not drain in 5 s (SSD writes not "
            f"completing?): {demotion_figures(server)}"
        )
    return out


def poll_until_ready(client, inst, hs, req, timeout: float = 10.0, max_polls: int = 5000):
    """QueryPrefetch with the same req_id and hashes until it is not Loading.
    Returns (first answer, final answer, number of polls)."""
    r = client.query_prefetch(inst, hs, req)
    first = r
    polls = 1
    deadline = time.monotonic() + timeout
    while isinstance(r, QueryLoading):
        assert time.monotonic() < deadline, f"still Loading after {timeout} s ({polls} polls)"
        assert polls < max_polls, f"still Loading after {polls} polls"
        time.sleep(0.005)
        r = client.query_prefetch(inst, hs, req)
        polls += 1
    return first, r, polls


def load_and_check(client, inst, kv, lease, want, dest_ids):
    """Loads `lease` into `dest_ids` (device cleared first) and checks every byte."""
    kv.mm[:] = b"\0" * kv.size  # only the server's copy can restore them
    st = PyLoadState()
    ok, msg = client.load(inst, 0, 0, st.shm_name(), [kv.layer_names], [(lease, [list(dest_ids)])])
    assert ok is True, msg
    assert pftest.wait_until(st.is_ready, 10), "load not ready after 10 s"
    assert st.get_state() == 1, st.get_state()
    for i, b in enumerate(dest_ids):
        for l in range(kv.num_layers):
            assert kv.block(l, b) == want[i][l], f"block {i} (dest {b}) layer {l} differs"


def start_ssd_server(fresh_server, ssd_dir, **kw):
    extra = kw.pop("extra_args", None)
    return fresh_server(pool_size=kw.pop("pool_size", POOL), extra_args=extra or ssd_args(ssd_dir), **kw)


# --------------------------------------------------------------------------------------------


def test_evicted_blocks_come_back_after_kill_9_and_restart(fresh_server, tmp_path, uid, host_kv):
    ssd = tmp_path / "ssd"
    s1 = start_ssd_server(fresh_server, ssd)
    client = EngineRpcClient(s1.endpoint)
    kv = host_kv()
    ns = "ns-" + uid
    ok, msg = kv.register(s1, uid, ns)
    assert ok is True, msg

    batches = fill_through_ssd(s1, client, uid, kv)
    total = BATCHES * kv.num_blocks
    pool_blocks = 64
    evicted = total - pool_blocks
    # Bounded wait: the evicted blocks (at least) are written to the SSD.
    pftest.wait_until(lambda: metric(s1, "pegaflow_ssd_blocks_total", op="write") >= evicted, timeout=20)
    m = s1.metrics()
    written = pftest.metric_value(m, "pegaflow_ssd_blocks_total", op="write")
    assert written >= evicted, (
        f"only {written} of >= {evicted} evicted blocks written to the SSD; demotions: "
        + str({n: v for n, l, v in pftest.parse_metrics(m) if n.startswith("pegaflow_tier_demotion")})
    )
    assert pftest.metric_value(m, "pegaflow_ssd_used_bytes") > 0
    assert any(p.name.startswith("segment-") for p in ssd.iterdir()), list(ssd.iterdir())

    # kill -9: no shutdown path runs.
    pid1 = s1.proc.pid
    os.kill(pid1, signal.SIGKILL)
    s1.proc.wait(timeout=10)
    assert s1.proc.returncode == -signal.SIGKILL

    s2 = start_ssd_server(fresh_server, ssd)
    m = s2.metrics()
    recovered = pftest.metric_value(m, "pegaflow_ssd_recovered_blocks")
    assert recovered > 0, "nothing recovered from the SSD directory"
    assert recovered >= evicted, (recovered, evicted)
    assert pftest.metric_value(m, "pegaflow_ssd_blocks_total", op="read") == 0

    # A fresh instance, same namespace and layout, on the new server.
    client2 = EngineRpcClient(s2.endpoint)
    kv2 = host_kv()
    inst2 = uid + "-after"
    ok, msg = kv2.register(s2, inst2, ns)
    assert ok is True, msg

    # The earliest batches were evicted from DRAM long before the kill: ask for 2 of them
    # (32 blocks, within the 64-block pool).
    hs = batches[0][0] + batches[1][0]
    want = batches[0][1] + batches[1][1]
    req = f"req-{uuid.uuid4().hex[:8]}"
    first, r, polls = poll_until_ready(client2, inst2, hs, req)
    assert isinstance(first, QueryLoading), f"first answer {first!r}: expected QueryLoading"
    assert isinstance(r, QueryReady), r
    assert r.num_hit_blocks == len(hs), (r.num_hit_blocks, len(hs), polls)
    assert metric(s2, "pegaflow_query_answers_total", outcome="loading") >= 1

    # Load them in two halves (the device has 16 slots) and check every byte.
    # The lease covers all 32 blocks; load 16 at a time from separate leases: release this
    # one and re-query each half (now resident in DRAM: Ready at once).
    client2.release(r.lease)
    for part in (0, 1):
        phs = hs[16 * part:16 * (part + 1)]
        r = client2.query_prefetch(inst2, phs, f"req-load-{part}-{uuid.uuid4().hex[:6]}")
        assert isinstance(r, QueryReady) and r.num_hit_blocks == 16, r
        load_and_check(client2, inst2, kv2, r.lease, want[16 * part:16 * (part + 1)], range(16))
    # Exactly the promoted blocks were read: one read per block, re-polls included.
    assert metric(s2, "pegaflow_ssd_blocks_total", op="read") == len(hs)


@pytest.mark.parametrize("io", ["flags", "posix"])
def test_loading_then_ready_without_restart(io, fresh_server, tmp_path, uid, host_kv):
    """`flags`: --ssd-cache-path (io = auto: io_uring where the kernel allows it);
    `posix`: the same through a pipeline file with io = "posix" (pread/pwrite)."""
    ssd = tmp_path / "ssd"
    if io == "flags":
        server = start_ssd_server(fresh_server, ssd)
    else:
        cfg = tmp_path / "pipeline.toml"
        cfg.write_text(pipeline(ssd, io=io))
        server = fresh_server(pool_size=POOL, extra_args=["--config", str(cfg)])
        assert f"io={io}" in server.get("/health?verbose=1")[1]
    client = EngineRpcClient(server.endpoint)
    kv = host_kv()
    ok, msg = kv.register(server, uid, "ns-" + uid)
    assert ok is True, msg

    batches = fill_through_ssd(server, client, uid, kv)
    evicted = BATCHES * kv.num_blocks - 64
    pftest.wait_until(lambda: metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted, timeout=20)
    assert metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted
    reads_before = metric(server, "pegaflow_ssd_blocks_total", op="read")
    assert reads_before == 0, reads_before
    loading_before = metric(server, "pegaflow_query_answers_total", outcome="loading")

    hs, want = batches[0]
    req = f"req-{uuid.uuid4().hex[:8]}"
    first, r, polls = poll_until_ready(client, uid, hs, req)
    assert isinstance(first, QueryLoading), f"first answer {first!r}: expected QueryLoading"
    assert isinstance(r, QueryReady), r
    assert r.num_hit_blocks == len(hs), (r.num_hit_blocks, polls)
    # Re-poll more with the same req_id and hashes: no new I/O.
    m = server.metrics()
    reads = pftest.metric_value(m, "pegaflow_ssd_blocks_total", op="read")
    assert reads == len(hs), f"{reads} SSD block reads for {len(hs)} promoted blocks after {polls} polls"
    assert pftest.metric_value(m, "pegaflow_query_answers_total", outcome="loading") - loading_before == polls - 1
    load_and_check(client, uid, kv, r.lease, want, range(kv.num_blocks))
    # The promoted blocks are in DRAM now: another query is Ready at once, with no SSD read.
    r2 = client.query_prefetch(uid, hs, f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(r2, QueryReady) and r2.num_hit_blocks == len(hs), r2
    client.release(r2.lease)
    assert metric(server, "pegaflow_ssd_blocks_total", op="read") == len(hs)


def test_two_servers_on_one_ssd_directory(fresh_server, tmp_path):
    ssd = tmp_path / "ssd"
    first = start_ssd_server(fresh_server, ssd)
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    args = [
        str(pftest.server_binary()),
        "--addr", f"127.0.0.1:{pftest.free_port()}",
        "--http-addr", f"127.0.0.1:{pftest.free_port()}",
        "--pool-size", POOL,
        "--fd-socket-path", str(second_dir / "fd.sock"),
        *ssd_args(ssd),
    ]
    p = subprocess.run(
        args, capture_output=True, text=True, timeout=20, env=dict(os.environ, NO_COLOR="1")
    )
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    err = p.stderr
    assert "in use by another process" in err, err[-2000:]
    assert f"(pid {first.proc.pid})" in err, (first.proc.pid, err[-2000:])
    assert str(ssd) in err, err[-2000:]
    # The first one is unharmed.
    assert first.alive()
    assert first.get("/health")[0] == 200


def test_layout_guard(fresh_server, tmp_path, uid, host_kv):
    ssd = tmp_path / "ssd"
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(pipeline(ssd, admission="always"))
    server = fresh_server(pool_size=POOL, extra_args=["--config", str(cfg)])
    client = EngineRpcClient(server.endpoint)
    ns = "ns-" + uid
    kv_a = host_kv()  # 256-byte segments
    ok, msg = kv_a.register(server, uid + "-a", ns)
    assert ok is True, msg
    batches = fill_through_ssd(server, client, uid + "-a", kv_a, query_first=False)
    evicted = BATCHES * kv_a.num_blocks - 64
    pftest.wait_until(lambda: metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted, timeout=20)
    assert metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted

    # The same layout sees them (Loading then Ready): the blocks are on the SSD.
    hs_same, want_same = batches[1]
    _, r, _ = poll_until_ready(client, uid + "-a", hs_same, f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(r, QueryReady) and r.num_hit_blocks == len(hs_same), r
    client.release(r.lease)

    # Another layout in the same namespace (512-byte segments): a plain miss.
    kv_b = host_kv(bytes_per_block=512)
    ok, msg = kv_b.register(server, uid + "-b", ns)
    assert ok is True, msg
    mism_before = metric(server, "pegaflow_tier_layout_mismatches_total", tier="ssd")
    loading_before = metric(server, "pegaflow_query_answers_total", outcome="loading")
    reads_before = metric(server, "pegaflow_ssd_blocks_total", op="read")
    hs, _ = batches[0]
    r = client.query_prefetch(uid + "-b", hs, f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(r, QueryReady), f"{r!r}: blocks of another layout must not be Loading"
    assert r.num_hit_blocks == 0, r
    assert metric(server, "pegaflow_tier_layout_mismatches_total", tier="ssd") > mism_before
    assert metric(server, "pegaflow_query_answers_total", outcome="loading") == loading_before
    assert metric(server, "pegaflow_ssd_blocks_total", op="read") == reads_before

    # Another layer count (same segment size): a miss too.
    kv_c = host_kv(num_layers=2)
    ok, msg = kv_c.register(server, uid + "-c", ns)
    assert ok is True, msg
    mism_before = metric(server, "pegaflow_tier_layout_mismatches_total", tier="ssd")
    r = client.query_prefetch(uid + "-c", batches[2][0], f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(r, QueryReady) and r.num_hit_blocks == 0, r
    assert metric(server, "pegaflow_tier_layout_mismatches_total", tier="ssd") > mism_before


def test_health_shows_the_ssd_tier(fresh_server, tmp_path):
    ssd = tmp_path / "ssd"
    server = start_ssd_server(fresh_server, ssd)
    # The probe answers exactly `ok`, as PegaFlow's; the detail is `?verbose=1`.
    assert server.get("/health") == (200, "ok")
    status, body = server.get("/health?verbose=1")
    assert status == 200, (status, body)
    lines = body.split("\n")
    assert lines[0] == "ok", body
    ssd_lines = [l for l in lines[1:] if l.startswith("ssd ")]
    assert ssd_lines, body
    line = next((l for l in ssd_lines if str(ssd) in l), None)
    assert line is not None, f"no /health?verbose=1 line names {ssd}:\n{body}"
    assert "io=" in line, line
    assert line.startswith(f"ssd {ssd}: ok;"), line
    assert metric(server, "pegaflow_ssd_io_engine") == 1


def test_membership_queries_never_answer_loading(fresh_server, tmp_path, uid, host_kv):
    """Group > 0 answers membership in DRAM only. Both groups are saved under the SAME hashes
    (as a hybrid model's groups are); group 0's copies are demoted to the SSD, group 1's are
    not (never promoted, so never demoted). A group-1 query of those hashes is a plain miss,
    never Loading, and starts no SSD read; the group-0 query of them does promote."""
    ssd = tmp_path / "ssd"
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(pipeline(ssd, admission="always"))
    server = fresh_server(pool_size=POOL, extra_args=["--config", str(cfg)])
    client = EngineRpcClient(server.endpoint)
    kv = host_kv()
    groups = [0, 0, 1, 1]
    g0 = [name for name, g in zip(kv.layer_names, groups) if g == 0]
    g1 = [name for name, g in zip(kv.layer_names, groups) if g == 1]
    ok, msg = kv.register(server, uid, "ns-" + uid, layer_group_ids=groups)
    assert ok is True, msg

    n = kv.num_blocks
    first = None
    # One block = one group's 2 layers (1 KiB): the pool holds 128; 2 x 16 new a batch.
    for i in range(BATCHES):
        kv.randomize()
        hs = hashes(n)
        ok, msg = client.save(uid, 0, 0, 0, [(l, list(range(n)), hs) for l in g0 + g1])
        assert ok is True, msg
        if i == 0:
            first = hs
        assert settle_demotions(server), f"after batch {i}: {demotion_figures(server)}"
    # At most 128 blocks are resident: at least BATCHES*n - 128 group-0 blocks were evicted.
    evicted0 = BATCHES * n - 128
    pftest.wait_until(lambda: metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted0, timeout=20)
    assert metric(server, "pegaflow_ssd_blocks_total", op="write") >= evicted0

    loading_before = metric(server, "pegaflow_query_answers_total", outcome="loading")
    reads_before = metric(server, "pegaflow_ssd_blocks_total", op="read")
    req = f"req-{uuid.uuid4().hex[:8]}"
    for _ in range(5):  # re-polls, as the connector would
        r = client.query_prefetch(uid, first, req, group_id=1)
        assert isinstance(r, QueryReady), f"membership query answered {r!r}"
        assert r.num_hit_blocks == 0, r
    assert metric(server, "pegaflow_query_answers_total", outcome="loading") == loading_before
    assert metric(server, "pegaflow_ssd_blocks_total", op="read") == reads_before

    # Group 0 of the same hashes does promote: the SSD held them.
    first_answer, r, _ = poll_until_ready(client, uid, first, f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(first_answer, QueryLoading), first_answer
    assert isinstance(r, QueryReady) and r.num_hit_blocks == n, r
    client.release(r.lease)
    assert metric(server, "pegaflow_ssd_blocks_total", op="read") == reads_before + n


def test_removing_the_owner_file_does_not_let_a_second_server_in(fresh_server, tmp_path):
    """The owner lock is on the store directory itself: unlinking the files in it that name
    the owner (`owner`; `lock` in earlier builds) leaves the second server refused."""
    ssd = tmp_path / "ssd"
    first = start_ssd_server(fresh_server, ssd)
    for name in ("owner", "lock"):
        (ssd / name).unlink(missing_ok=True)
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    args = [
        str(pftest.server_binary()),
        "--addr", f"127.0.0.1:{pftest.free_port()}",
        "--http-addr", f"127.0.0.1:{pftest.free_port()}",
        "--pool-size", POOL,
        "--fd-socket-path", str(second_dir / "fd.sock"),
        *ssd_args(ssd),
    ]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, NO_COLOR="1"))
    try:
        _, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("a second server started on a live SSD directory once its owner file was removed")
    assert p.returncode == 1, (p.returncode, err[-2000:])
    assert "in use by another process" in err, err[-2000:]
    assert f"(pid {first.proc.pid})" in err, (first.proc.pid, err[-2000:])
    assert first.alive()


# -- records on disk ---------------------------------------------------------------------------

RECORD_MAGIC = 0x50465243


def ssd_records(ssd) -> dict[bytes, tuple]:
    """Every record of every segment of the store at `ssd`, by block hash:
    (segment file, offset, header bytes, payload bytes, record bytes). Parsed from the
    on-disk format (docs/SSD.md §3): superblock (magic, version, alignment), segment header
    (magic, store id, slot, generation), then records `header | payload | trailer` padded to
    the alignment, walked until one is not of the segment's generation."""
    import struct

    sb = (ssd / "superblock").read_bytes()
    align = struct.unpack_from("<I", sb, 12)[0]
    out = {}
    for seg in sorted(ssd.glob("segment-*.dat")):
        b = seg.read_bytes()
        if b[:8] != b"PFSSDSG\x01":
            continue
        gen = struct.unpack_from("<Q", b, 20)[0]
        off = align
        while off + 48 <= len(b):
            magic, hlen, rgen, _seq, _group, ns_len, hash_len, slots, payload = struct.unpack_from(
                "<IIQQIHHIQ", b, off)
            if magic != RECORD_MAGIC or rgen != gen or hlen != 44 + ns_len + hash_len + 8 * slots + 4:
                break
            h = b[off + 44 + ns_len:off + 44 + ns_len + hash_len]
            rec = -(-(hlen + payload + 8) // align) * align
            out[h] = (seg, off, hlen, payload, rec)
            off += rec
    return out


def swap_payloads(a: tuple, b: tuple) -> None:
    """Swaps the payload and trailer of two records of the same size (a misdirected write
    each way), on disk, synced."""
    (fa, oa, ha, pa, _), (fb, ob, hb, pb, _) = a, b
    assert pa == pb, (pa, pb)
    n = pa + 8
    with open(fa, "r+b") as x, open(fb, "r+b") as y:
        x.seek(oa + ha)
        da = x.read(n)
        y.seek(ob + hb)
        db = y.read(n)
        x.seek(oa + ha)
        x.write(db)
        y.seek(ob + hb)
        y.write(da)
        x.flush()
        y.flush()
        os.fsync(x.fileno())
        os.fsync(y.fileno())


def swap_pairs(recs: dict, hs: list[bytes], pairs: int) -> list[bytes]:
    """Swaps `pairs` pairs among `hs`: the first across two segments where there are two,
    the rest neighbours. Returns the hashes whose payload is now another block's."""
    by_seg: dict = {}
    for h in hs:
        by_seg.setdefault(recs[h][0], []).append(h)
    segs = [v for v in by_seg.values() if v]
    chosen = []
    if len(segs) >= 2:
        chosen.append((segs[0].pop(), segs[1].pop()))
    rest = [h for v in segs for h in v]
    while len(chosen) < pairs and len(rest) >= 2:
        chosen.append((rest.pop(), rest.pop()))
    for x, y in chosen:
        swap_payloads(recs[x], recs[y])
    return [h for pair in chosen for h in pair]


def query_one(client, inst, kv, h, want):
    """Queries block `h` alone (polling through Loading). A hit is loaded and must be
    byte-exact; returns whether it was a hit."""
    _, r, _ = poll_until_ready(client, inst, [h], f"req-{uuid.uuid4().hex[:8]}")
    assert isinstance(r, QueryReady), r
    if r.num_hit_blocks == 0:
        return False
    load_and_check(client, inst, kv, r.lease, [want], [0])  # the load consumes the lease
    return True


def test_a_payload_swapped_on_disk_is_never_served(fresh_server, tmp_path, uid, host_kv):
    """Payloads and trailers swapped between records of the same size (within a segment and
    across segments), as a misdirected write leaves them: every such block is a miss —
    never Ready with the other block's bytes — live and after `kill -9` and a restart; the
    refusals are counted; untouched blocks load exact."""
    ssd = tmp_path / "ssd"
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(pipeline(ssd, admission="always", segment_size="256kb"))
    s1 = fresh_server(pool_size=POOL, extra_args=["--config", str(cfg)])
    client = EngineRpcClient(s1.endpoint)
    kv = host_kv()
    ns = "ns-" + uid
    ok, msg = kv.register(s1, uid, ns)
    assert ok is True, msg
    batches = fill_through_ssd(s1, client, uid, kv)
    evicted = BATCHES * kv.num_blocks - 64
    pftest.wait_until(lambda: metric(s1, "pegaflow_ssd_blocks_total", op="write") >= evicted, timeout=20)
    want = {h: w for hs, ws in batches for h, w in zip(hs, ws)}
    recs = ssd_records(ssd)
    # Batches 0-9 left DRAM long ago (it holds the last 4): their records are on the SSD.
    assert all(h in recs for hs, _ in batches[:10] for h in hs), "evicted blocks are on the SSD"
    assert len({recs[h][0] for hs, _ in batches[:10] for h in hs}) >= 2, "several segments"

    # Live: 4 pairs swapped among batches 0-3, asked for one by one.
    live = [h for hs, _ in batches[:4] for h in hs]
    swapped = swap_pairs(recs, live, 4)
    assert len(swapped) == 8
    served = [h.hex() for h in swapped if query_one(client, uid, kv, h, want[h])]
    assert not served, f"swapped blocks answered Ready: {served}"
    assert metric(s1, "pegaflow_ssd_corrupt_records_total", why="checksum") >= len(swapped)
    logged = s1.log_tail(2000).count("SSD record failed its checks")
    assert 1 <= logged <= 2, f"{logged} WARN lines for {len(swapped)} refusals (at most one per 10 s)"
    for h in batches[4][0][:4]:
        assert query_one(client, uid, kv, h, want[h]), "an untouched block loads exact"

    # kill -9, 4 more pairs swapped among batches 5-9, restart.
    s1.proc.kill()
    s1.proc.wait(timeout=10)
    later = [h for hs, _ in batches[5:10] for h in hs]
    swapped2 = swap_pairs(recs, later, 4)
    s2 = fresh_server(pool_size=POOL, extra_args=["--config", str(cfg)])
    client2 = EngineRpcClient(s2.endpoint)
    kv2 = host_kv()
    ok, msg = kv2.register(s2, uid + "-2", ns)
    assert ok is True, msg
    served = [h.hex() for h in swapped2 if query_one(client2, uid + "-2", kv2, h, want[h])]
    assert not served, f"swapped blocks answered Ready after the restart: {served}"
    refused = (metric(s2, "pegaflow_ssd_corrupt_records_total")
               + metric(s2, "pegaflow_ssd_recovery_dropped_records"))
    assert refused >= len(swapped2), refused
    untouched = [h for h in later if h not in swapped2][:4]
    for h in untouched:
        assert query_one(client2, uid + "-2", kv2, h, want[h]), "an untouched block loads exact"
    assert "SSD record failed its checks" in s2.log_tail(400) or \
        metric(s2, "pegaflow_ssd_recovery_dropped_records") >= len(swapped2)
