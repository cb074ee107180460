"""Session liveness (engine-wire.md §6, pegaflow-behavior.md §1.4): start_session_watcher returns
at once; when the owning process dies the server unregisters the instance; a newer session
supersedes an older one; idle keepalive pings never end a session.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pftest
from pegaflow import PegaFlowError
from pegaflow.pegaflow import EngineRpcClient, PyLoadState

CHILD = Path(__file__).resolve().parent / "session_child.py"


def test_start_session_watcher_returns_at_once(server, uid):
    c = EngineRpcClient(server.endpoint)
    t0 = time.monotonic()
    assert c.start_session_watcher(uid, "ns", 1, 1) is None
    assert time.monotonic() - t0 < 1.0
    # Unary calls keep working on the same connection while the stream is open.
    assert c.health()[0] is True


def test_killed_session_owner_cleans_up_its_instance_within_a_second(server, uid):
    ns = "ns-" + uid
    child = subprocess.Popen(
        [sys.executable, str(CHILD), server.endpoint, server.grpc_target, server.fd_socket, uid, ns],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = child.stdout.readline().strip()
        assert line == "READY", f"child said {line!r}: {child.stdout.read() if child.poll() is not None else ''}"
        assert uid in server.instances()
        observer = EngineRpcClient(server.endpoint)
        r = observer.query_prefetch(uid, [b"h"], "req-alive")
        assert r.num_hit_blocks == 0

        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
        t0 = time.monotonic()
        gone = pftest.wait_until(lambda: uid not in server.instances(), timeout=1.0, interval=0.01)
        elapsed = time.monotonic() - t0
        assert gone, f"instance still registered {elapsed:.2f}s after the session owner was killed"

        with pytest.raises(PegaFlowError) as ei:
            observer.query_prefetch(uid, [b"h"], "req-dead")
        assert type(ei.value) is PegaFlowError
        assert "not found" in str(ei.value)

        st = PyLoadState()
        with pytest.raises(PegaFlowError) as ei:
            observer.load(uid, 0, 0, st.shm_name(), [["model.layers.0.attn"]], [(bytes(16), [[1]])])
        assert "not found" in str(ei.value)
        assert st.get_state() < 0
        with pytest.raises(PegaFlowError) as ei:
            observer.save(uid, 0, 0, 0, [("model.layers.0.attn", [1], [b"h"])])
        assert "not found" in str(ei.value)

        # The id is free again: a restarted worker can register under it.
        kv = pftest.HostKv(num_layers=1, num_blocks=4)
        try:
            ok, msg = kv.register(server, uid, ns)
            assert ok, msg
            assert observer.unregister_context(uid)[0] is True
        finally:
            kv.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout:
            child.stdout.close()


def test_newer_session_supersedes_and_dropping_the_client_cleans_up(server, uid, host_kv):
    ns = "ns-" + uid
    c = EngineRpcClient(server.endpoint)
    c.start_session_watcher(uid, ns, 1, 1)
    kv = host_kv(num_layers=1, num_blocks=4)
    assert kv.register(server, uid, ns)[0]
    # Calling again replaces the stream: the client cancels the old one, which must not
    # clean up the instance (the newer session owns it now).
    c.start_session_watcher(uid, ns, 1, 1)
    time.sleep(0.5)
    assert uid in server.instances()
    assert c.query_prefetch(uid, [b"h"], "req-1").num_hit_blocks == 0

    # Dropping the client closes its connection: the current session ends.
    del c
    gc.collect()
    assert pftest.wait_until(lambda: uid not in server.instances(), timeout=2.0), (
        "instance still registered after the session's client was dropped"
    )


def test_session_ended_by_unregister_is_harmless(server, client, uid, host_kv):
    """Unregistering while the session is open, then closing it, leaves the server healthy."""
    ns = "ns-" + uid
    c = EngineRpcClient(server.endpoint)
    c.start_session_watcher(uid, ns, 1, 1)
    kv = host_kv(num_layers=1, num_blocks=4)
    assert kv.register(server, uid, ns)[0]
    assert client.unregister_context(uid)[0] is True
    del c
    gc.collect()
    time.sleep(0.2)
    assert uid not in server.instances()
    assert client.health()[0] is True


@pytest.mark.slow
def test_idle_session_survives_60_seconds_of_keepalive_pings(server, uid, host_kv):
    """The client pings every 5 s; the server must answer and never GOAWAY (too_many_pings)."""
    ns = "ns-" + uid
    c = EngineRpcClient(server.endpoint)
    c.start_session_watcher(uid, ns, 1, 1)
    kv = host_kv(num_layers=1, num_blocks=4)
    assert kv.register(server, uid, ns)[0]
    try:
        time.sleep(60)
        assert uid in server.instances(), "the idle session ended"
        assert c.health()[0] is True
        assert c.query_prefetch(uid, [b"h"], "req-idle").num_hit_blocks == 0
        assert "too_many_pings" not in server.log_path.read_text(errors="replace")
    finally:
        try:
            EngineRpcClient(server.endpoint).unregister_context(uid)
        except PegaFlowError:
            pass
