"""The data path driven by the PUBLISHED client (save / query_prefetch / load / release with a
real PyLoadState) on an instance whose KV memory is a host memfd registered natively through
the fd side channel (the published client cannot register host memory itself).

Layout: 4 layers x 16 blocks, KV-first split (K region then V region per layer),
bytes_per_block = 256, kv_stride = 16 * 256.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

import pftest
from pegaflow import PegaFlowError, PegaflowInternal
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryLoading, QueryReady


def hashes(n: int) -> list[bytes]:
    return [uuid.uuid4().bytes + bytes([i]) for i in range(n)]


def save_blocks(client, inst, kv: pftest.HostKv, block_ids: list[int], block_hashes: list[bytes]):
    saves = [(name, list(block_ids), list(block_hashes)) for name in kv.layer_names]
    ok, msg = client.save(inst, 0, 0, 0, saves)
    assert ok is True, msg


def query_ready(client, inst, hs, want: int, req_id: str | None = None, timeout: float = 3.0) -> QueryReady:
    """Query until `want` blocks hit (saves may seal asynchronously on PegaFlow); partial
    answers' leases are released."""
    req_id = req_id or f"req-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + timeout
    while True:
        r = client.query_prefetch(inst, hs, req_id)
        if isinstance(r, QueryReady) and r.num_hit_blocks >= want:
            return r
        if isinstance(r, QueryReady) and r.lease:
            client.release(r.lease)
        if time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def wait_load(st: PyLoadState, timeout: float = 10.0) -> int:
    pftest.wait_until(st.is_ready, timeout)
    return st.get_state()


def load(client, inst, kv, st, lease, targets):
    return client.load(inst, 0, 0, st.shm_name(), [kv.layer_names], [(lease, [targets])])


@pytest.fixture
def native(server, client, uid, host_kv):
    """A registered host-memfd instance with random KV content: (instance_id, kv)."""
    kv = host_kv()
    kv.randomize()
    ok, msg = kv.register(server, uid, "ns-" + uid)
    assert ok is True, msg
    yield uid, kv
    try:
        client.unregister_context(uid)
    except PegaFlowError:
        pass


def test_native_registration_is_listed_and_cannot_register_twice(server, native):
    inst, kv = native
    assert inst in server.instances()
    with pytest.raises(pftest.RawRpcError) as ei:
        pftest.raw_register(server.grpc_target, kv.register_request(inst, "ns-" + inst))
    assert ei.value.code.name == "FAILED_PRECONDITION", ei.value


def test_cold_query_is_an_empty_ready(client, native):
    inst, _ = native
    r = client.query_prefetch(inst, hashes(3), "req-cold")
    assert isinstance(r, QueryReady)
    assert r.num_hit_blocks == 0
    assert r.lease == b""
    assert list(r.hit_positions) == []


def test_save_query_load_restores_bytes(client, native):
    inst, kv = native
    src = [2, 3, 4, 5]
    dst = [9, 10, 11, 12]
    hs = hashes(len(src))
    save_blocks(client, inst, kv, src, hs)
    expected = {(l, b): kv.block(l, b) for l in range(kv.num_layers) for b in src}

    r = query_ready(client, inst, hs + hashes(1), want=4)
    assert isinstance(r, QueryReady)
    assert r.num_hit_blocks == 4, "the whole saved prefix hits, the unknown suffix does not"
    assert len(r.lease) == 16

    # Poison the destinations; remember everything else.
    for l in range(kv.num_layers):
        for b in dst:
            kv.fill_block(l, b, 0xEE)
    before = {(l, b): kv.block(l, b) for l in range(kv.num_layers) for b in range(kv.num_blocks)}

    st = PyLoadState()
    ok, msg = load(client, inst, kv, st, r.lease, dst)
    assert ok is True, msg
    assert wait_load(st) == 1

    for l in range(kv.num_layers):
        for s, d in zip(src, dst):
            assert kv.block(l, d) == expected[(l, s)], f"layer {l} block {d} != saved block {s}"
        for b in range(kv.num_blocks):
            if b not in dst:
                assert kv.block(l, b) == before[(l, b)], f"layer {l} block {b} was touched"

    # The lease was consumed by the only worker's load (world_size 1).
    with pytest.raises(PegaFlowError) as ei:
        client.release(r.lease)
    assert type(ei.value) is PegaFlowError


def test_absent_target_is_skipped_and_block_zero_is_loaded(client, native):
    inst, kv = native
    src = [4, 5, 6, 7]
    hs = hashes(4)
    save_blocks(client, inst, kv, src, hs)
    saved = {(l, b): kv.block(l, b) for l in range(kv.num_layers) for b in src}
    r = query_ready(client, inst, hs, want=4)
    assert r.num_hit_blocks == 4

    for l in range(kv.num_layers):
        for b in (0, 1, 13, 14):
            kv.fill_block(l, b, 0x5A)
    before = kv.snapshot()

    st = PyLoadState()
    # lease block i -> target: [0, None, 13, None]
    ok, msg = load(client, inst, kv, st, r.lease, [0, None, 13, None])
    assert ok is True, msg
    assert wait_load(st) == 1
    for l in range(kv.num_layers):
        assert kv.block(l, 0) == saved[(l, 4)], "target 0 is block 0, not 'absent'"
        assert kv.block(l, 13) == saved[(l, 6)]
        for b in (1, 14):
            assert kv.block(l, b) == bytes([0x5A]) * 512, "absent targets write nothing"
    changed = [i for i in range(kv.size) if kv.mm[i] != before[i]]
    allowed = set()
    for l in range(kv.num_layers):
        for b in (0, 13):
            for seg in (0, 1):
                o = kv.seg_offset(l, b, seg)
                allowed.update(range(o, o + kv.bytes_per_block))
    assert set(changed) <= allowed


def test_partial_prefix_hits_only_the_prefix(client, native):
    inst, kv = native
    hs = hashes(4)
    save_blocks(client, inst, kv, [1, 2], hs[:2])
    save_blocks(client, inst, kv, [3], hs[3:])
    r = query_ready(client, inst, hs, want=2)
    assert r.num_hit_blocks == 2, "h0 h1 hit, h2 missing stops the prefix even though h3 is cached"
    assert len(r.lease) == 16
    client.release(r.lease)
    r = client.query_prefetch(inst, [hs[2], hs[0]], "req-gap")
    assert r.num_hit_blocks == 0 and r.lease == b""


def test_release_then_release_again_and_load_of_released_lease(client, native):
    inst, kv = native
    hs = hashes(2)
    save_blocks(client, inst, kv, [0, 1], hs)
    r = query_ready(client, inst, hs, want=2)
    assert r.num_hit_blocks == 2
    assert client.release(r.lease) is None
    with pytest.raises(PegaFlowError) as ei:
        client.release(r.lease)
    assert type(ei.value) is PegaFlowError
    assert "unknown or expired" in str(ei.value)

    before = kv.snapshot()
    st = PyLoadState()
    with pytest.raises(PegaFlowError) as ei:
        load(client, inst, kv, st, r.lease, [8, 9])
    assert type(ei.value) is PegaFlowError
    assert st.get_state() < 0
    assert kv.snapshot() == before


def test_load_lease_block_count_mismatch_is_value_error(client, native):
    inst, kv = native
    hs = hashes(2)
    save_blocks(client, inst, kv, [0, 1], hs)
    r = query_ready(client, inst, hs, want=2)
    assert r.num_hit_blocks == 2
    before = kv.snapshot()
    st = PyLoadState()
    with pytest.raises(ValueError):
        load(client, inst, kv, st, r.lease, [8, 9, 10, 11])
    assert st.get_state() < 0
    assert kv.snapshot() == before


def test_load_empty_lease_is_value_error(client, native):
    inst, kv = native
    st = PyLoadState()
    with pytest.raises(ValueError):
        load(client, inst, kv, st, b"", [1])
    assert st.get_state() < 0


def test_load_without_leases_succeeds_at_once(client, native):
    inst, kv = native
    st = PyLoadState()
    ok, msg = client.load(inst, 0, 0, st.shm_name(), [kv.layer_names], [])
    assert ok is True, msg
    assert wait_load(st) == 1


def test_load_with_a_missing_load_state_is_not_internal(client, native):
    # PegaFlow answers INTERNAL; here a missing object is FAILED_PRECONDITION (PegaFlowError)
    # and nothing is consumed.
    inst, kv = native
    with pytest.raises(PegaFlowError) as ei:
        client.load(inst, 0, 0, "shm-x", [kv.layer_names], [(os.urandom(16), [[1]])])
    assert not isinstance(ei.value, PegaflowInternal), ei.value
    assert "does not exist" in str(ei.value), ei.value


def test_save_validation_on_a_registered_instance(client, native):
    inst, kv = native
    name = kv.layer_names[0]
    with pytest.raises(ValueError):
        client.save(inst, 0, 0, 0, [("no.such.layer", [1], [b"h"])])
    with pytest.raises(ValueError):
        client.save(inst, 0, 0, 0, [(name, [kv.num_blocks], [b"h"])])  # block id out of range
    with pytest.raises(ValueError):
        client.save(inst, 0, 0, 0, [(name, [1, 2], [b"h"])])  # ids / hashes mismatch
    with pytest.raises(ValueError):
        client.save(inst, 0, 0, -1, [(name, [1], [b"h"])])
    # None of the refused saves made anything queryable.
    r = client.query_prefetch(inst, [b"h"], "req-v")
    assert r.num_hit_blocks == 0


def test_lease_is_bound_to_its_instance(server, client, native, host_kv):
    inst_a, kv_a = native
    inst_b = inst_a + "-b"
    kv_b = host_kv()
    ok, msg = kv_b.register(server, inst_b, "ns-" + inst_a)  # same namespace
    assert ok, msg
    try:
        hs = hashes(2)
        save_blocks(client, inst_a, kv_a, [0, 1], hs)
        r = query_ready(client, inst_a, hs, want=2)
        assert r.num_hit_blocks == 2
        st = PyLoadState()
        with pytest.raises(PegaFlowError) as ei:
            load(client, inst_b, kv_b, st, r.lease, [2, 3])
        assert type(ei.value) is PegaFlowError
        assert st.get_state() < 0
        # The lease survives the refused load: instance A can still use it.
        st = PyLoadState()
        ok, msg = load(client, inst_a, kv_a, st, r.lease, [2, 3])
        assert ok, msg
        assert wait_load(st) == 1
        for l in range(kv_a.num_layers):
            assert kv_a.block(l, 2) == kv_a.block(l, 0)
            assert kv_a.block(l, 3) == kv_a.block(l, 1)
    finally:
        client.unregister_context(inst_b)


def test_cached_blocks_survive_unregister_and_serve_another_instance(server, client, uid, host_kv):
    ns = "ns-" + uid
    kv_a = host_kv()
    kv_a.randomize()
    assert kv_a.register(server, uid + "-a", ns)[0]
    hs = hashes(3)
    save_blocks(client, uid + "-a", kv_a, [5, 6, 7], hs)
    saved = {(l, b): kv_a.block(l, b) for l in range(kv_a.num_layers) for b in (5, 6, 7)}
    assert client.unregister_context(uid + "-a")[0] is True
    with pytest.raises(PegaFlowError):
        client.query_prefetch(uid + "-a", hs, "req-gone")

    kv_b = host_kv()
    assert kv_b.register(server, uid + "-b", ns)[0]
    try:
        r = query_ready(client, uid + "-b", hs, want=3)
        assert r.num_hit_blocks == 3
        st = PyLoadState()
        ok, msg = load(client, uid + "-b", kv_b, st, r.lease, [0, 1, 2])
        assert ok, msg
        assert wait_load(st) == 1
        for l in range(kv_b.num_layers):
            for s, d in zip((5, 6, 7), (0, 1, 2)):
                assert kv_b.block(l, d) == saved[(l, s)]
    finally:
        client.unregister_context(uid + "-b")


def test_namespaces_are_isolated(server, client, uid, host_kv):
    kv_a, kv_b = host_kv(), host_kv()
    kv_a.randomize()
    assert kv_a.register(server, uid + "-a", "ns-a-" + uid)[0]
    assert kv_b.register(server, uid + "-b", "ns-b-" + uid)[0]
    try:
        hs = hashes(2)
        save_blocks(client, uid + "-a", kv_a, [0, 1], hs)
        assert query_ready(client, uid + "-a", hs, want=2).num_hit_blocks == 2
        r = client.query_prefetch(uid + "-b", hs, "req-other-ns")
        assert r.num_hit_blocks == 0 and r.lease == b""
    finally:
        client.unregister_context(uid + "-a")
        client.unregister_context(uid + "-b")


def test_unregister_then_everything_is_not_found(client, native):
    inst, kv = native
    hs = hashes(1)
    save_blocks(client, inst, kv, [0], hs)
    r = query_ready(client, inst, hs, want=1)
    assert r.num_hit_blocks == 1
    ok, msg = client.unregister_context(inst)
    assert ok is True, msg
    for call in (
        lambda: client.query_prefetch(inst, hs, "req-after"),
        lambda: client.save(inst, 0, 0, 0, [(kv.layer_names[0], [1], [b"x"])]),
        lambda: client.unregister_context(inst),
    ):
        with pytest.raises(PegaFlowError) as ei:
            call()
        assert type(ei.value) is PegaFlowError
        assert "not found" in str(ei.value)
    # Unregistering dropped the instance's leases.
    with pytest.raises(PegaFlowError):
        client.release(r.lease)


def test_concurrent_clients_share_one_server(server, native):
    """Several published clients (one connection each) and threads at once."""
    import concurrent.futures

    inst, kv = native
    hs = hashes(4)
    save_blocks(EngineRpcClient(server.endpoint), inst, kv, [0, 1, 2, 3], hs)
    clients = [EngineRpcClient(server.endpoint) for _ in range(4)]

    def work(i):
        c = clients[i % len(clients)]
        r = c.query_prefetch(inst, hs, f"req-{i}")
        assert isinstance(r, (QueryReady, QueryLoading))
        if isinstance(r, QueryReady) and r.lease:
            c.release(r.lease)
        return r.num_hit_blocks if isinstance(r, QueryReady) else -1

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(work, range(32)))
    assert results == [4] * 32


def test_tp2_blocks_seal_when_every_rank_saved_and_each_rank_loads_once(server, client, uid, host_kv):
    """Naive TP=2: a block is visible once both ranks saved their shard; one lease serves one
    load per worker (world_size = 2) and is then gone."""
    ns = "ns-" + uid
    kvs = [host_kv(), host_kv()]
    for rank, kv in enumerate(kvs):
        kv.randomize()
        ok, msg = kv.register(server, uid, ns, device_id=rank, tp_rank=rank, tp_size=2, world_size=2)
        assert ok, msg
    try:
        hs = hashes(2)
        ok, msg = client.save(uid, 0, 0, 0, [(n, [0, 1], hs) for n in kvs[0].layer_names])
        assert ok, msg
        r = client.query_prefetch(uid, hs, "req-half")
        assert r.num_hit_blocks == 0 and r.lease == b"", "rank 0's shard alone is not a block"
        ok, msg = client.save(uid, 1, 0, 1, [(n, [0, 1], hs) for n in kvs[1].layer_names])
        assert ok, msg
        r = query_ready(client, uid, hs, want=2)
        assert r.num_hit_blocks == 2

        for rank, kv in enumerate(kvs):
            st = PyLoadState()
            ok, msg = client.load(uid, rank, rank, st.shm_name(), [kv.layer_names], [(r.lease, [[6, 7]])])
            assert ok, msg
            assert wait_load(st) == 1
            for l in range(kv.num_layers):
                assert kv.block(l, 6) == kv.block(l, 0), f"rank {rank} layer {l}"
                assert kv.block(l, 7) == kv.block(l, 1), f"rank {rank} layer {l}"
        # Both shares are spent.
        st = PyLoadState()
        with pytest.raises(PegaFlowError):
            client.load(uid, 0, 0, st.shm_name(), [kvs[0].layer_names], [(r.lease, [[8, 9]])])
        assert st.get_state() < 0
    finally:
        client.unregister_context(uid)


def test_requests_larger_than_tonics_default_4mib_are_accepted(client, native):
    """The published client sends up to 64 MiB; the server must not keep tonic's 4 MiB limit."""
    inst, _ = native
    many = [os.urandom(32) for _ in range(200_000)]  # ~7 MiB on the wire
    r = client.query_prefetch(inst, many, "req-big")
    assert isinstance(r, QueryReady)
    assert r.num_hit_blocks == 0
