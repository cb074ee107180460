"""Server lifecycle as the published client sees it: Shutdown, and QueryPrefetch's silent miss
when the server is unreachable (engine-wire.md §5: UNAVAILABLE -> QueryReady(0) for
query_prefetch only).
"""

from __future__ import annotations

import pytest

from pegaflow import PegaFlowError, PegaflowInternal
from pegaflow.pegaflow import EngineRpcClient, QueryReady


def test_query_is_a_silent_miss_when_the_server_is_down(fresh_server):
    s = fresh_server()
    c = EngineRpcClient(s.endpoint)
    assert c.health()[0] is True
    assert s.stop() == 0
    r = c.query_prefetch("any-instance", [b"h0", b"h1"], "req-down")
    assert isinstance(r, QueryReady)
    assert r.num_hit_blocks == 0
    assert r.lease == b""
    assert list(r.hit_positions) == []
    # Every other RPC reports UNAVAILABLE as a plain PegaFlowError.
    with pytest.raises(PegaFlowError) as ei:
        c.health()
    assert type(ei.value) is PegaFlowError
    assert not isinstance(ei.value, PegaflowInternal)


def test_client_reconnects_after_a_server_restart(fresh_server):
    s = fresh_server()
    c = EngineRpcClient(s.endpoint)
    assert c.health()[0] is True
    ports = (s.grpc_port, s.http_port)
    assert s.stop() == 0
    with pytest.raises(PegaFlowError):
        c.health()
    s.start(ports=ports)  # same ports, same client object
    assert c.health()[0] is True


def test_shutdown_rpc_stops_the_server(fresh_server):
    s = fresh_server()
    c = EngineRpcClient(s.endpoint)
    ok, msg = c.shutdown()
    assert ok is True
    assert isinstance(msg, str)
    assert s.proc.wait(timeout=10) == 0
    r = c.query_prefetch("x", [b"h"], "req-after-shutdown")
    assert isinstance(r, QueryReady) and r.num_hit_blocks == 0


def test_shutdown_and_sigterm_exit_while_sessions_are_open(fresh_server):
    """An open Session stream (the vLLM scheduler always holds one) must not keep the server
    alive after Shutdown or SIGTERM."""
    s = fresh_server()
    holder = EngineRpcClient(s.endpoint)
    holder.start_session_watcher("held-session", "ns", 1, 1)
    ok, _ = EngineRpcClient(s.endpoint).shutdown()
    assert ok is True
    assert s.proc.wait(timeout=10) == 0

    s2 = fresh_server()
    holder2 = EngineRpcClient(s2.endpoint)
    holder2.start_session_watcher("held-session", "ns", 1, 1)
    assert s2.stop(timeout=10) == 0, "SIGTERM did not stop the server with a session open"
    del holder, holder2
