"""The tier stack driven by the PUBLISHED client: a two-tier pipeline (dram over the
examples' `heap-store` tier, in the third-party binary `pegaflow-server-verify`) demotes blocks
under DRAM pressure and promotes them on QueryPrefetch: the client sees QueryLoading, re-polls
with the same req_id and hashes (as the connector does every scheduler step), then QueryReady,
and the loaded bytes are exact.

Layout (pftest.HostKv defaults): 4 layers x 16 blocks, 256-byte segments: 2 KiB per block.
DRAM: 128 KiB = 64 blocks.
"""

from __future__ import annotations

import time
import uuid

import pytest

import pftest
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryLoading, QueryReady

TWO_TIER = """
[store]
promote_deadline_ms = 10000

[[tier]]
kind = "dram"
capacity = "128kb"

[[tier]]
kind = "heap-store"
capacity = "16mb"
layers = ["metrics"]

[[registrar]]
kind = "host-memfd"

[[transport]]
kind = "memcpy"
"""


@pytest.fixture
def two_tier(fresh_server, tmp_path):
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(TWO_TIER)
    return fresh_server(
        pool_size="128kb",
        binary=pftest.third_party_binary(),
        extra_args=["--config", str(cfg)],
    )


def save(client, inst, kv, ids, hs):
    ok, msg = client.save(inst, 0, 0, 0, [(name, list(ids), list(hs)) for name in kv.layer_names])
    assert ok is True, msg


def test_demoted_blocks_come_back_through_loading_then_ready(two_tier, uid, host_kv):
    server = two_tier
    client = EngineRpcClient(server.endpoint)
    kv = host_kv()
    kv.randomize()
    ok, msg = kv.register(server, uid, "ns-" + uid)
    assert ok is True, msg

    first = [uuid.uuid4().bytes for _ in range(8)]
    want = [[kv.block(l, b) for l in range(kv.num_layers)] for b in range(8)]
    save(client, uid, kv, range(8), first)
    # Push the first 8 blocks out of DRAM (64 blocks) with 8 saves of 8 new blocks each.
    for _ in range(9):
        kv.randomize()
        save(client, uid, kv, range(8, 16), [uuid.uuid4().bytes for _ in range(8)])
    # The first blocks now live below DRAM only: the query is answered Loading first.
    pftest.wait_until(
        lambda: pftest.metric_value(server.metrics(), "pegaflow_tier_demotions_total", outcome="written") >= 8,
        timeout=10,
    )
    kv.randomize()  # the device copies are gone; only the server's copy can restore them
    req = f"req-{uuid.uuid4().hex[:8]}"
    r = client.query_prefetch(uid, first, req)
    assert isinstance(r, QueryLoading), r
    deadline = time.monotonic() + 10
    polls = 1
    while isinstance(r, QueryLoading):
        assert time.monotonic() < deadline, "still Loading after 10 s"
        time.sleep(0.01)
        r = client.query_prefetch(uid, first, req)
        polls += 1
    assert isinstance(r, QueryReady), r
    assert r.num_hit_blocks == 8, r
    st = PyLoadState()
    ok, msg = client.load(uid, 0, 0, st.shm_name(), [kv.layer_names], [(r.lease, [list(range(8, 16))])])
    assert ok is True, msg
    pftest.wait_until(st.is_ready, 10)
    assert st.get_state() == 1
    for b in range(8):
        for l in range(kv.num_layers):
            assert kv.block(l, 8 + b) == want[b][l], f"block {b} layer {l}"
    m = server.metrics()
    # However many re-polls, the promotion read each block once.
    assert pftest.metric_value(m, "pegaflow_tier_ops_total", op="get", outcome="ok") == 8, polls
    assert pftest.metric_value(m, "pegaflow_query_answers_total", outcome="loading") >= 1
