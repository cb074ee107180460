"""Every RPC of the published client against pegaflow-server: the Python outcome of each answer
and error (engine-wire.md §4-5): INVALID_ARGUMENT -> ValueError, INTERNAL -> PegaflowInternal,
any other code -> PegaFlowError, and status-bearing answers -> (ok, message).
"""

from __future__ import annotations

import os

import pytest

import pftest
from pegaflow import PegaFlowError, PegaflowInternal
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryReady


def register_args(iid: str, **over):
    """Positional arguments of register_context_batch, with overrides by name."""
    a = dict(
        instance_id=iid,
        namespace="ns-py",
        tp_rank=0,
        pp_rank=0,
        tp_size=1,
        world_size=1,
        device_id=0,
        layer_names=["layer.0"],
        wrapper_bytes_list=[b"W"],
        num_blocks_list=[4],
        bytes_per_block_list=[256],
        kv_stride_bytes_list=[0],
        segments_list=[1],
        transfer_backend="direct",
        page_first=False,
        layer_group_ids=None,
    )
    a.update(over)
    return list(a.values())


def assert_plain_pegaflow_error(excinfo, *needles: str):
    """A PegaFlowError that is not PegaflowInternal (so: neither INVALID_ARGUMENT nor INTERNAL)."""
    e = excinfo.value
    assert type(e) is PegaFlowError, f"{type(e).__name__}: {e}"
    for n in needles:
        assert n in str(e), str(e)


# -- Health ---------------------------------------------------------------------------------


def test_health_is_ok(client):
    ok, msg = client.health()
    assert ok is True
    assert isinstance(msg, str)


def test_client_endpoint_round_trips(server):
    c = EngineRpcClient(server.endpoint)
    assert c.endpoint() == server.endpoint


# -- RegisterContextBatch validation --------------------------------------------------------


BAD_REGISTRATIONS = {
    "tp_rank_ge_tp_size": dict(tp_rank=2, tp_size=2, world_size=2),
    "tp_size_zero": dict(tp_size=0),
    "world_size_zero": dict(world_size=0),
    "negative_device_id": dict(device_id=-1),
    "more_layer_names_than_wrappers": dict(layer_names=["layer.0", "layer.1"]),
    "num_blocks_list_too_long": dict(num_blocks_list=[4, 4]),
    "segments_list_empty": dict(segments_list=[]),
    "no_layers": dict(
        layer_names=[], wrapper_bytes_list=[], num_blocks_list=[], bytes_per_block_list=[],
        kv_stride_bytes_list=[], segments_list=[],
    ),
    "group_ids_length_mismatch": dict(layer_group_ids=[0, 1]),
    "duplicate_layer_names": dict(
        layer_names=["L", "L"], wrapper_bytes_list=[b"W", b"W"], num_blocks_list=[4, 4],
        bytes_per_block_list=[256, 256], kv_stride_bytes_list=[0, 0], segments_list=[1, 1],
    ),
    "empty_instance_id": dict(instance_id=""),
}


@pytest.mark.parametrize("case", sorted(BAD_REGISTRATIONS))
def test_register_bad_inputs_raise_value_error(client, server, uid, case):
    with pytest.raises(ValueError) as ei:
        client.register_context_batch(*register_args(uid, **BAD_REGISTRATIONS[case]))
    assert "register_context_batch RPC failed" in str(ei.value)
    assert "invalid argument" in str(ei.value)
    # Nothing was registered.
    assert uid not in server.instances()
    assert client.health()[0] is True


def test_register_version_gate_is_not_reachable_from_python():
    pytest.skip(
        "the published client always sends client_version 0.25.1 (field 15 is not settable "
        "from Python); the gate is covered by the Rust tests"
    )


def test_cuda_ipc_registration_without_gpu_is_internal_with_a_clear_message(client, server, uid):
    """A real CudaIPCWrapper pickle from an H200 sent to a server without a CUDA registrar."""
    wrapper = pftest.wrapper_default_pickle()
    facts = pftest.wrapper_default_facts()
    shape, stride = facts["shape"], facts["stride"]  # KV-first [2, N, ...] bf16
    elem = 2
    args = register_args(
        uid,
        layer_names=["model.layers.0.self_attn.attn"],
        wrapper_bytes_list=[wrapper],
        num_blocks_list=[shape[1]],
        bytes_per_block_list=[stride[1] * elem],
        kv_stride_bytes_list=[stride[0] * elem],
        segments_list=[2],
    )
    for _attempt in range(2):  # a failed registration leaves nothing behind: same error again
        with pytest.raises(PegaflowInternal) as ei:
            client.register_context_batch(*args)
        msg = str(ei.value)
        assert "register_context_batch RPC failed" in msg
        assert "Internal error" in msg
        assert "cuda" in msg.lower(), msg
        assert uid not in server.instances()
    ok, _ = client.health()
    assert ok is True


# -- UnregisterContext ------------------------------------------------------------------------


def test_unregister_unknown_instance_is_pegaflow_error(client, uid):
    with pytest.raises(PegaFlowError) as ei:
        client.unregister_context(uid)
    assert_plain_pegaflow_error(ei, "unregister_context RPC failed", "not found", uid)


# -- Release ----------------------------------------------------------------------------------


def test_release_unknown_lease_is_pegaflow_error(client):
    with pytest.raises(PegaFlowError) as ei:
        client.release(os.urandom(16))
    assert_plain_pegaflow_error(ei, "release RPC failed")


def test_release_empty_lease_is_value_error(client):
    with pytest.raises(ValueError) as ei:
        client.release(b"")
    assert "release RPC failed" in str(ei.value)


def test_release_wrong_length_lease_is_value_error(client):
    with pytest.raises(ValueError):
        client.release(b"LEASE-REL")


# -- QueryPrefetch ----------------------------------------------------------------------------


def test_query_empty_req_id_is_value_error(client, uid):
    with pytest.raises(ValueError) as ei:
        client.query_prefetch(uid, [b"h"], "")
    assert "req_id must not be empty" in str(ei.value)


def test_query_unknown_instance_is_pegaflow_error(client, uid):
    with pytest.raises(PegaFlowError) as ei:
        client.query_prefetch(uid, [b"h0", b"h1"], "req-1")
    assert_plain_pegaflow_error(ei, "query_prefetch RPC failed", "not found")


# -- Save -------------------------------------------------------------------------------------


def test_save_unknown_instance_is_pegaflow_error(client, uid):
    with pytest.raises(PegaFlowError) as ei:
        client.save(uid, 0, 0, 0, [("layer.0", [1], [b"h"])])
    assert_plain_pegaflow_error(ei, "save RPC failed", "not found")


def test_save_negative_device_is_value_error(client, uid):
    with pytest.raises(ValueError):
        client.save(uid, 0, 0, -3, [("layer.0", [1], [b"h"])])


def test_save_ids_hashes_mismatch_is_value_error(client, uid):
    with pytest.raises(ValueError):
        client.save(uid, 0, 0, 0, [("layer.0", [1, 2], [b"h"])])


# -- Load -------------------------------------------------------------------------------------


def test_load_unknown_instance_fails_and_marks_the_load_state(client, uid):
    st = PyLoadState()
    assert st.get_state() == 0
    with pytest.raises(PegaFlowError) as ei:
        client.load(uid, 0, 0, st.shm_name(), [["layer.0"]], [(os.urandom(16), [[1]])])
    assert_plain_pegaflow_error(ei, "load RPC failed", "not found")
    assert st.get_state() < 0
    assert st.is_ready()


def test_load_with_a_missing_load_state_is_a_precondition_failure(client, uid):
    # PegaFlow answers INTERNAL here; a load-state object the client never created is the
    # client's mistake: FAILED_PRECONDITION (a plain PegaFlowError), not PegaflowInternal.
    with pytest.raises(PegaFlowError) as ei:
        client.load(uid, 0, 0, "pega_load_does_not_exist", [["layer.0"]], [(os.urandom(16), [[1]])])
    assert_plain_pegaflow_error(ei, "load RPC failed", "does not exist")


# -- Session ----------------------------------------------------------------------------------


def test_session_with_empty_instance_id_is_value_error(client):
    with pytest.raises(ValueError) as ei:
        client.start_session_watcher("", "ns", 1, 1)
    assert "session RPC failed" in str(ei.value)
    # The client and server keep working.
    assert client.health()[0] is True


def test_query_empty_hash_list_on_unknown_instance_still_checks_the_instance(client, uid):
    with pytest.raises(PegaFlowError):
        client.query_prefetch(uid, [], "req-empty")


def test_status_answers_are_tuples_not_exceptions(client, server, uid, host_kv):
    """Successful status-bearing RPCs return (True, str); they never answer without a status."""
    kv = host_kv(num_layers=1, num_blocks=4)
    ok, _ = kv.register(server, uid, "ns-" + uid)
    assert ok
    r = client.save(uid, 0, 0, 0, [])
    assert r[0] is True and isinstance(r[1], str)
    q = client.query_prefetch(uid, [], "req-0")
    assert isinstance(q, QueryReady)
    assert (q.num_hit_blocks, q.lease, list(q.hit_positions)) == (0, b"", [])
    r = client.unregister_context(uid)
    assert r[0] is True and isinstance(r[1], str)
