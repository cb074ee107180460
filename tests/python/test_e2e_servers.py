"""The end-to-end TTFT harness (bench/e2e/pfe2e) against the real server binary, on CPU: the
pipeline files it writes pass the server's own check, it starts, asks and stops servers
(process groups included), its command line, and — where torch and transformers are installed
— a whole dry run: a tiny Llama whose paged KV cache is a host memfd registered with our
server, cold prefill, DRAM, peer and SSD hits byte- and logit-exact, the trace stage, the
report. The GPU run itself needs the GPU machine (bench/e2e/README.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pftest

E2E = Path(__file__).resolve().parents[2] / "bench" / "e2e"
sys.path.insert(0, str(E2E))

from pfe2e import report, servers  # noqa: E402


def test_metrics_parsing():
    text = """# HELP x y
pegaflow_ssd_write_bytes_total 1.5e3
pegaflow_tier_demotions_total{tier="ssd",outcome="written"} 4
pegaflow_tier_demotions_total{tier="ssd",outcome="failed"} 1
bad line
"""
    assert servers.metric_sum(text, "pegaflow_ssd_write_bytes_total") == 1500
    assert servers.metric_sum(text, "pegaflow_tier_demotions_total") == 5
    assert servers.metric_sum(text, "pegaflow_tier_demotions_total", outcome="written") == 4
    assert servers.metric_sum(text, "nope") == 0
    assert servers.split_addr("http://127.0.0.1:50055") == ("127.0.0.1", 50055)


@pytest.mark.parametrize("variant", ["full", "plain", "trace"])
def test_pipeline_files_pass_the_servers_check(tmp_path, variant):
    if variant == "full":
        toml = servers.ours_pipeline("10gb", str(tmp_path / "ssd"), "20gb", True, "http://127.0.0.1:50104", "127.0.0.1:50106", 4160, 60000)
    elif variant == "plain":
        toml = servers.ours_pipeline("1gb")
    else:
        toml = servers.ours_pipeline("8gb", str(tmp_path / "ssd"), "24gb", False, None, None, 1088, 60000, evict_ahead_percent=0)
    cfg = tmp_path / "p.toml"
    cfg.write_text(toml)
    r = subprocess.run([str(pftest.server_binary()), "--config", str(cfg), "--check-config"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    printed = subprocess.run([str(pftest.server_binary()), "--config", str(cfg), "--print-config"], capture_output=True, text=True, timeout=60).stdout
    if variant == "full":
        assert "write_through = true" in printed and 'kind = "tcp"' in printed and "max_promote_blocks = 4160" in printed
        assert "fetch_timeout_ms = 60000" in printed
    if variant == "trace":
        assert "evict_ahead_percent = 0" in printed and "write_through" not in printed


def test_start_ask_and_stop_our_server(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(servers.ours_pipeline("64mb"))
    g, h = pftest.free_port(), pftest.free_port()
    srv = servers.ours(str(pftest.server_binary()), "t", f"127.0.0.1:{g}", f"127.0.0.1:{h}", cfg, tmp_path)
    try:
        serving = servers.start_and_wait(srv, timeout=30, pinned_timeout=5)
        assert serving > 0 and srv.proc.alive()
        assert servers.grpc_healthy(srv.endpoint)
        st, body = srv.health()
        assert st == 200 and body.startswith("ok")
        assert "pegaflow_" in srv.metrics()
        assert srv.cleanup_memory() == {"evicted_blocks": 0, "evicted_bytes": 0, "reclaimed_bytes": 0, "still_referenced_blocks": 0}
        # A second server on the same ports is refused before it starts.
        twin = servers.ours(str(pftest.server_binary()), "twin", f"127.0.0.1:{g}", f"127.0.0.1:{h}", cfg, tmp_path)
        with pytest.raises(RuntimeError, match="already taken"):
            servers.start_and_wait(twin, timeout=5)
        assert twin.proc.popen is None
    finally:
        rc = srv.proc.stop()
    assert not srv.proc.alive() and rc is not None
    assert not servers.port_open("127.0.0.1", g)
    assert "serving" in srv.proc.log_tail(50)


def test_a_process_that_dies_at_start_is_reported_with_its_log(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[[tier]]\nkind = "no-such-tier"\n')
    g, h = pftest.free_port(), pftest.free_port()
    srv = servers.ours(str(pftest.server_binary()), "bad", f"127.0.0.1:{g}", f"127.0.0.1:{h}", cfg, tmp_path)
    with pytest.raises(RuntimeError, match="no-such-tier"):
        servers.start_and_wait(srv, timeout=20)


def test_stop_ends_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    p = servers.Proc("sh", ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], tmp_path / "sh.log")
    p.start()
    assert servers.wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 10)
    child = int(pidfile.read_text())
    try:
        assert _alive(child)
        p.stop(timeout=5)
        assert not p.alive()
        # The child was in the group: it went with its parent (a kill of the parent alone leaves it).
        assert servers.wait_until(lambda: not _alive(child), 5)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_command_line():
    from pfe2e import run

    a = run.parse_args(["--quick", "--out", "/tmp/x", "--ours-bin", "/bin/true"])
    assert a.lengths == [1024, 4096] and a.reps == 1 and a.trace_requests == 20
    assert a.stages == ["ours", "pegaflow", "trace"] and a.pegaflow_backends == ["direct", "kernel"]
    assert a.stage_budget == {"ours": 180.0, "pegaflow": 120.0, "trace": 90.0}
    with pytest.raises(SystemExit):
        run.parse_args(["--lengths", "20"])
    with pytest.raises(SystemExit):
        run.parse_args(["--stages", "ours,nope"])
    rec = {"kind": "hit", "server": "ours", "tier": "dram", "backend": "direct", "tokens": 1024, "status": "ok", "median_ttft_s": 0.01,
           "reps": [{"query_s": 0.001, "load_s": 0.002, "rebuild_s": 0.003, "suffix_s": 0.004}], "byte_exact": True, "logit_exact": True,
           "argmax_vs_cold": 1.0, "first_answers": ["ready"]}
    assert run.summary(rec).startswith("ours dram hit (direct) 1K: 10.00 ms (query 1.00, load 2.00")


def test_dry_run_on_cpu(tmp_path):
    """The whole harness on CPU: skipped where torch or transformers is missing (CI)."""
    pytest.importorskip("torch", reason="torch is not installed here (the GPU machine has it)")
    pytest.importorskip("transformers", reason="transformers is not installed here (the GPU machine has it)")
    bin_dir = pftest.server_binary().parent
    meta = bin_dir / "pegaflow-metaserver"
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "pfe2e.run", "--device", "cpu", "--model", "tiny", "--lengths", "64,1024", "--out", str(out),
           "--work", str(work), "--ssd-dir", str(tmp_path / "ssd"), "--ours-bin", str(pftest.server_binary()), "--port-base", str(_port_base()),
           "--pool", "64mb", "--ssd-capacity", "1gb", "--trace-requests", "12", "--trace-block-tokens", "16", "--trace-max-tokens", "1024",
           "--trace-pool", "512kb", "--trace-ssd-capacity", "1gb", "--budget-s", "400", "--reps", "2", "--cold-reps", "1"]
    if meta.is_file():
        cmd += ["--metaserver-bin", str(meta)]
    env = dict(os.environ, PYTHONPATH=str(E2E), E2E_T0=str(time.time()))
    r = subprocess.run(cmd, cwd=E2E, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    recs = report.read_records(out / "results.jsonl")
    hits = {(h["server"], h["tier"], h["tokens"]): h for h in recs if h["kind"] == "hit"}
    for tier in ("dram", "peer", "ssd"):
        for n in (64, 1024):
            h = hits[("ours", tier, n)]
            assert h["status"] == "ok", h
            assert h["byte_exact"] and h["logit_exact"], h
            assert len(h["reps"]) == (2 if tier == "dram" else 2)
            assert h["first_answers"] == (["ready"] if tier == "dram" else ["loading"]), h
    alone = [x for x in recs if x["kind"] == "suffix_alone"]
    assert alone and all(x["deterministic"] and x["conversion_exact"] for x in alone)
    stages = {x["stage"]: x for x in recs if x["kind"] == "stage"}
    assert stages["ours"]["status"] == "done" and stages["trace"]["status"] == "done"
    assert stages["pegaflow"]["status"] == "skipped"
    tr = next(x for x in recs if x["kind"] == "trace")
    assert tr["requests"] == 12 and tr["byte_exact"] and tr["hit_blocks"] > 0
    # A 512 KiB pool holds 128 blocks of 4 KiB: evictions, and blocks promoted back from the SSD.
    assert tr["server_metrics"]["evicted_blocks"] > 0
    for f in ("report.md", "ttft.svg", "results.json", "logs-tail.txt"):
        assert (out / f).is_file()
    assert "| 1K |" in (out / "report.md").read_text()
    # --resume: every stage has ended, nothing runs again.
    n = len(recs)
    r2 = subprocess.run(cmd + ["--resume"], cwd=E2E, env=env, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert not [x for x in report.read_records(out / "results.jsonl")[n:] if x["kind"] in ("hit", "stage_start")]


def _port_base() -> int:
    """12 consecutive free loopback ports."""
    import socket

    for _ in range(50):
        base = pftest.free_port()
        if base + 12 > 65535:
            continue
        ok = True
        for p in range(base, base + 12):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no 12 consecutive free ports")
