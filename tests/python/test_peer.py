"""Peer fetch through the PUBLISHED client: two servers share a Redis-backed directory and
a peer delegate, the `tcp` one or the RDMA emulator's (`rdma-emu`: one-sided READs of the
holder's pool, no RDMA hardware). A block saved on the first is asked for on the second: the
client sees QueryLoading while the second server fetches it, re-polls with the same req_id
and hashes (as the connector does), gets QueryReady, and the loaded bytes are exact.

Skips without `redis-server`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

import pftest
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryLoading, QueryReady

PIPELINE = """
[directory]
kind = "redis"
url = "redis://127.0.0.1:{port}"
key_prefix = "pf:pytest-peer:{tag}:"
stale_after_secs = 30
query_timeout_ms = 300

{peer}

[[tier]]
kind = "dram"
capacity = "64mb"

[[registrar]]
kind = "host-memfd"

[[transport]]
kind = "memcpy"
"""


@pytest.fixture
def redis_port():
    bin_ = shutil.which("redis-server")
    if bin_ is None:
        pytest.skip("redis-server is not installed")
    port = pftest.free_port()
    d = tempfile.mkdtemp(prefix="pegaflow-pytest-redis-")
    proc = subprocess.Popen(
        [bin_, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not listen"
            time.sleep(0.02)
    yield port
    proc.kill()
    proc.wait()
    shutil.rmtree(d, ignore_errors=True)


def save(client, inst, kv, ids, hs):
    ok, msg = client.save(inst, 0, 0, 0, [(name, list(ids), list(hs)) for name in kv.layer_names])
    assert ok is True, msg


PEERS = {
    "tcp": '[peer]\nkind = "tcp"\ndata_addr = "127.0.0.1:0"\n',
    "rdma-emu": '[peer]\nkind = "rdma-emu"\nnics = ["emu0", "emu1"]\n\n[peer.emu]\nsocket_dir = "{dir}"\n',
}


@pytest.mark.parametrize("kind", sorted(PEERS))
def test_a_block_saved_on_one_node_loads_byte_exact_on_another(kind, request, fresh_server, tmp_path, uid, host_kv, redis_port):
    cfg = tmp_path / "pipeline.toml"
    # The emulator's fabric sockets: a short folder (a socket path has at most 107 bytes).
    sock_dir = tempfile.mkdtemp(prefix="pf-")
    request.addfinalizer(lambda: shutil.rmtree(sock_dir, ignore_errors=True))
    peer = PEERS[kind].format(dir=sock_dir)
    cfg.write_text(PIPELINE.format(port=redis_port, tag=uuid.uuid4().hex[:8], peer=peer))
    a = fresh_server(pool_size="64mb", extra_args=["--config", str(cfg)])
    b = fresh_server(pool_size="64mb", extra_args=["--config", str(cfg)])
    ca, cb = EngineRpcClient(a.endpoint), EngineRpcClient(b.endpoint)
    ns = "ns-" + uid
    kva, kvb = host_kv(), host_kv()
    kva.randomize()
    kvb.randomize()
    ok, msg = kva.register(a, uid + "-a", ns)
    assert ok is True, msg
    ok, msg = kvb.register(b, uid + "-b", ns)
    assert ok is True, msg
    hs = [uuid.uuid4().bytes for _ in range(8)]
    want = [[kva.block(l, i) for l in range(kva.num_layers)] for i in range(8)]
    save(ca, uid + "-a", kva, range(8), hs)

    # The directory lists the first server within a heartbeat or two; until then the
    # second answers a plain miss (Ready 0). Each attempt is a new request.
    deadline = time.monotonic() + 15
    attempt = 0
    while True:
        req = f"req-{attempt}"
        r = cb.query_prefetch(uid + "-b", hs, req)
        loading = 0
        while isinstance(r, QueryLoading):
            loading += 1
            assert time.monotonic() < deadline, "still Loading"
            time.sleep(0.01)
            r = cb.query_prefetch(uid + "-b", hs, req)
        assert isinstance(r, QueryReady), r
        if r.num_hit_blocks == 8:
            break
        assert r.num_hit_blocks == 0, r
        assert time.monotonic() < deadline, "the second server never fetched the blocks"
        attempt += 1
        time.sleep(0.1)
    assert loading >= 1, "the fetch was answered QueryLoading first"

    st = PyLoadState()
    ok, msg = cb.load(uid + "-b", 0, 0, st.shm_name(), [kvb.layer_names], [(r.lease, [list(range(8, 16))])])
    assert ok is True, msg
    pftest.wait_until(st.is_ready, 10)
    assert st.get_state() == 1
    for i in range(8):
        for l in range(kvb.num_layers):
            assert kvb.block(l, 8 + i) == want[i][l], f"block {i} layer {l}"
    mb, ma = b.metrics(), a.metrics()
    assert pftest.metric_value(mb, "pegaflow_peer_fetch_blocks_total") == 8
    pftest.wait_until(lambda: pftest.metric_value(a.metrics(), "pegaflow_transfer_locks_held") == 0, 5)
    if kind == "tcp":
        assert pftest.metric_value(ma, "pegaflow_peer_serve_requests_total", outcome="ok") >= 1
    else:
        # One-sided: the holder's CPU served nothing; the requester posted the READs and
        # released the lock only once they had all landed.
        # Contiguous ranges are coalesced: 8 small blocks laid out back to back take from
        # one READ up to one per block.
        assert 1 <= pftest.metric_value(mb, "pegaflow_rdma_wrs_posted_total") <= 8
        assert pftest.metric_value(mb, "pegaflow_rdma_draining_bytes") == 0
