"""The HTTP endpoints (pegaflow-behavior.md §8.1, §1.5, §5.3): /health, /metrics,
/instances, POST /instances/cleanup[?id=], POST /cache/memory/cleanup.
"""

from __future__ import annotations

import json
import uuid

import pytest

import pftest
from pegaflow import PegaFlowError
from pegaflow.pegaflow import EngineRpcClient, PyLoadState


def test_health_endpoint(server):
    assert server.get("/health") == (200, "ok")


def test_metrics_count_rpcs_by_method_and_status(server, client, uid):
    before = server.metrics()
    client.health()
    client.health()
    with pytest.raises(ValueError):
        client.query_prefetch(uid, [b"h"], "")
    with pytest.raises(PegaFlowError):
        client.unregister_context(uid)
    after = server.metrics()

    name = "pegaflow_rpc_requests_total"
    assert name in after
    d = lambda **l: pftest.metric_value(after, name, **l) - pftest.metric_value(before, name, **l)  # noqa: E731
    assert d(method="health", status="ok") == 2
    # Errors are counted under their own (non-ok) status label.
    samples = [(l, v) for n, l, v in pftest.parse_metrics(after) if n == name]
    assert all(set(l) >= {"method", "status"} for l, _ in samples), samples
    q_err = {l["status"] for l, _ in samples if l["method"] == "query_prefetch" and l["status"] != "ok"}
    u_err = {l["status"] for l, _ in samples if l["method"] == "unregister_context" and l["status"] != "ok"}
    assert q_err and u_err
    assert q_err != u_err, "INVALID_ARGUMENT and FAILED_PRECONDITION share a status label"
    assert sum(d(method="query_prefetch", status=s) for s in q_err) == 1
    assert sum(d(method="unregister_context", status=s) for s in u_err) == 1


def test_instances_and_cleanup_by_id(server, client, uid, host_kv):
    kv = host_kv(num_layers=1, num_blocks=4)
    assert kv.register(server, uid, "ns-" + uid)[0]
    assert uid in server.instances()
    status, body = server.post(f"/instances/cleanup?id={uid}")
    assert status == 200, body
    j = json.loads(body)
    assert j["removed_instances"] == [uid]
    assert "removed_tensors" in j
    assert uid not in server.instances()
    with pytest.raises(PegaFlowError) as ei:
        client.query_prefetch(uid, [b"h"], "req-x")
    assert "not found" in str(ei.value)
    # Unknown (or already removed) ids are 404.
    status, body = server.post(f"/instances/cleanup?id={uid}")
    assert status == 404, body
    status, _ = server.post(f"/instances/cleanup?id=never-{uuid.uuid4().hex}")
    assert status == 404


def test_cleanup_without_id_removes_every_instance(fresh_server, host_kv):
    s = fresh_server()
    ids = [f"all-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    for i in ids:
        assert host_kv(num_layers=1, num_blocks=4).register(s, i, "ns-all")[0]
    assert sorted(s.instances()) == sorted(ids)
    status, body = s.post("/instances/cleanup")
    assert status == 200, body
    assert sorted(json.loads(body)["removed_instances"]) == sorted(ids)
    assert s.instances() == []


def test_memory_cleanup_evicts_everything_but_keeps_leased_blocks_loadable(fresh_server, host_kv):
    s = fresh_server()
    c = EngineRpcClient(s.endpoint)
    inst = "memclean-" + uuid.uuid4().hex[:8]
    kv = host_kv()
    kv.randomize()
    assert kv.register(s, inst, "ns-mem")[0]
    hs = [uuid.uuid4().bytes for _ in range(4)]
    ok, msg = c.save(inst, 0, 0, 0, [(n, [0, 1, 2, 3], hs) for n in kv.layer_names])
    assert ok, msg
    saved = {(l, b): kv.block(l, b) for l in range(kv.num_layers) for b in (0, 1)}
    leased = c.query_prefetch(inst, hs[:2], "req-hold")
    assert leased.num_hit_blocks == 2

    status, body = s.post("/cache/memory/cleanup")
    assert status == 200, body
    j = json.loads(body)
    assert set(j) >= {"evicted_blocks", "evicted_bytes", "reclaimed_bytes", "still_referenced_blocks"}
    assert j["evicted_blocks"] == 4
    assert j["still_referenced_blocks"] == 2
    # 4 blocks x 4 layers x (K + V) of 256 bytes, at least.
    assert j["evicted_bytes"] >= 4 * kv.num_layers * 2 * kv.bytes_per_block
    assert 0 < j["reclaimed_bytes"] <= j["evicted_bytes"]

    # The index is empty now...
    r = c.query_prefetch(inst, hs, "req-after")
    assert r.num_hit_blocks == 0 and r.lease == b""
    # ...but the leased blocks are still whole and loadable.
    for l in range(kv.num_layers):
        for b in (8, 9):
            kv.fill_block(l, b, 0xEE)
    st = PyLoadState()
    ok, msg = c.load(inst, 0, 0, st.shm_name(), [kv.layer_names], [(leased.lease, [[8, 9]])])
    assert ok, msg
    assert pftest.wait_until(st.is_ready, 10.0)
    assert st.get_state() == 1
    for l in range(kv.num_layers):
        assert kv.block(l, 8) == saved[(l, 0)]
        assert kv.block(l, 9) == saved[(l, 1)]

    status, body = s.post("/cache/memory/cleanup")
    assert status == 200
    assert json.loads(body)["evicted_blocks"] == 0


def test_metrics_route_is_off_unless_enabled(fresh_server):
    # As PegaFlow's server: /metrics only with --enable-prometheus; /health either way.
    s = fresh_server(metrics=False)
    assert s.get("/health") == (200, "ok")
    status, _ = s.get("/metrics")
    assert status == 404
    s = fresh_server(metrics=False, extra_args=["--enable-prometheus", "false"])
    assert s.get("/metrics")[0] == 404
    s = fresh_server(metrics=False, extra_args=["--enable-prometheus"])
    assert s.get("/metrics")[0] == 200
