"""KV events in vLLM's ZMQ wire format, read by a subscriber written from vLLM's own struct
definitions (msgspec) and pyzmq, as a KV-aware router reads a vLLM engine.

The publisher is driven by `kv_events_emit`, an example binary of the pegaflow-events-zmq
crate (built by `cargo build --workspace --all-targets`, or
`cargo build -p pegaflow-events-zmq --example kv_events_emit`); PEGAFLOW_EVENTS_EMIT_BIN
overrides its path. It publishes a fixed script, spelled out again in `expected()` below.
"""

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import pytest

msgspec = pytest.importorskip("msgspec", reason="scripts/python-venv.sh installs msgspec")
zmq = pytest.importorskip("zmq", reason="scripts/python-venv.sh installs pyzmq")

ROOT = Path(__file__).resolve().parents[2]
EMIT = Path(
    os.environ.get(
        "PEGAFLOW_EVENTS_EMIT_BIN", ROOT / "target" / "debug" / "examples" / "kv_events_emit"
    )
)
TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DIGEST = bytes(range(1, 33))
ExternalBlockHash = Union[bytes, int]


def vllm_structs(generation: str):
    """vLLM's `KVEventBatch` and events as one vLLM generation declares them.

    - "medium": the published kv_events_subscriber example once `medium` was added (no
      `data_parallel_rank` in its batch, no `lora_name`).
    - "lora_name": the array-like structs once `lora_name` was added: exactly the fields
      this server sends, so re-encoding must give the same bytes.
    - "array-latest": the last array-like generation (vLLM 0.23): later fields with defaults.
    - "map": newer vLLM, events no longer array-like (tagged maps).
    """
    array_like = generation != "map"

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        pass

    if generation == "medium":

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: Optional[ExternalBlockHash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: Optional[str]

    elif generation == "lora_name":

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: Optional[ExternalBlockHash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: Optional[str]

    else:

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: Optional[ExternalBlockHash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list[Any]] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: Optional[str]
            group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    if generation == "medium":

        class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: list[Any]

    else:

        class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: list[Any]
            data_parallel_rank: Optional[int] = None

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return KVEventBatch


def expected(hash_form: str):
    """The emitter's script: one list of (tag, fields) per batch."""
    digest = DIGEST if hash_form == "bytes" else int.from_bytes(DIGEST, "big") & (2**64 - 1)

    def stored(hashes, parent, tokens, block_size, medium, lora_id=None, lora_name=None):
        return (
            "BlockStored",
            dict(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=block_size,
                lora_id=lora_id,
                medium=medium,
                lora_name=lora_name,
            ),
        )

    def removed(hashes, medium):
        return ("BlockRemoved", dict(block_hashes=hashes, medium=medium))

    return [
        [stored([1, 2, 3], None, list(range(1, 49)), 16, "CPU")],
        [stored([4], 3, list(range(49, 65)), 16, "DISK", lora_id=7, lora_name="adapter-a")],
        [removed([1, 2], "CPU")],
        [stored([digest, 2**64 - 1], digest, [], 256, "cxl-pool")],
        [removed([4], "DISK")],
        [("AllBlocksCleared", {})],
        [
            stored([10], None, list(range(70_000, 70_004)), 4, None),
            removed([10], None),
            stored([11, 12], 10, list(range(0, 8)), 4, "CPU"),
        ],
    ]


class Emitter:
    """The example publisher as a child process, one JSON line per command."""

    def __init__(self, *args: str):
        if not EMIT.exists():
            pytest.fail(
                f"no {EMIT}: run 'cargo build -p pegaflow-events-zmq --example kv_events_emit' "
                "(or set PEGAFLOW_EVENTS_EMIT_BIN)"
            )
        self.proc = subprocess.Popen(
            [str(EMIT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.endpoints = self.read()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def read(self, timeout: float = 15.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            err = self.proc.stderr.read() if self.proc.poll() is not None else "(still running)"
            raise AssertionError(f"kv_events_emit said nothing for {timeout}s; stderr: {err}")
        return json.loads(line)

    def cmd(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def emitter():
    started: list[Emitter] = []

    def start(*args: str) -> Emitter:
        e = Emitter(*args)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def live_subscriber(ctx, em: Emitter, topic: bytes = TOPIC):
    """A SUB socket whose subscription has reached the publisher: probes are published
    until one arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(em.endpoints["pub"])
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        em.cmd("probe")
        if sub.poll(200):
            sub.recv_multipart()
            return sub
    raise AssertionError("the subscription never reached the publisher")


def receive_script(sub, first: int, last: int) -> dict[int, tuple[bytes, bytes]]:
    """Receives batches `first..=last` (skipping late probes); asserts no gap, no repeat."""
    got: dict[int, tuple[bytes, bytes]] = {}
    expect = first
    while expect <= last:
        assert sub.poll(15_000), f"batch {expect} never arrived"
        frames = sub.recv_multipart()
        assert len(frames) == 3, "a batch is [topic, seq, payload]"
        topic, seq_bytes, payload = frames
        assert len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        if seq < first:
            continue  # a probe that arrived late
        assert seq == expect, f"expected batch {expect}, got {seq}: a gap or a repeat"
        got[seq] = (topic, payload)
        expect += 1
    return got


def check_batch(batch, want_events, dp_rank, generation):
    assert isinstance(batch.ts, float)
    assert abs(batch.ts - time.time()) < 120, "ts is seconds since the epoch"
    if generation != "medium":
        assert batch.data_parallel_rank == dp_rank
    assert len(batch.events) == len(want_events)
    for ev, (tag, fields) in zip(batch.events, want_events):
        assert type(ev).__name__ == tag
        for name, value in fields.items():
            if name == "lora_name" and generation == "medium":
                continue
            assert getattr(ev, name) == value, f"{tag}.{name}"


@pytest.mark.parametrize(
    "encoding,hash_form,dp_rank",
    [("array", "int", 3), ("map", "bytes", None), ("map", "int", 0)],
)
def test_every_batch_decodes_with_vllms_structs(emitter, ctx, encoding, hash_form, dp_rank):
    args = ["--encoding", encoding, "--block-hash", hash_form]
    if dp_rank is not None:
        args += ["--dp-rank", str(dp_rank)]
    em = emitter(*args)
    sub = live_subscriber(ctx, em)
    other = ctx.socket(zmq.SUB)
    other.connect(em.endpoints["pub"])
    other.setsockopt(zmq.SUBSCRIBE, b"another-topic")

    span = em.cmd("script")
    got = receive_script(sub, span["first"], span["last"])
    want = expected(hash_form)
    assert len(got) == len(want)

    generations = ["medium", "lora_name", "array-latest"] if encoding == "array" else ["map"]
    for (seq, (topic, payload)), want_events in zip(sorted(got.items()), want):
        assert topic == TOPIC
        for generation in generations:
            batch = msgspec.msgpack.decode(payload, type=vllm_structs(generation))
            check_batch(batch, want_events, dp_rank, generation)
        # Byte for byte what msgspec writes for the struct generation with our fields.
        exact = "lora_name" if encoding == "array" else "map"
        batch = msgspec.msgpack.decode(payload, type=vllm_structs(exact))
        assert msgspec.msgpack.encode(batch) == payload, f"batch {seq} differs from msgspec"
    # A subscriber to another topic got none of it (topic-prefix filtering in libzmq).
    assert not other.poll(200)


def replay(ctx, endpoint: str, start: bytes) -> list[tuple[int, bytes]]:
    """A DEALER requester: sends [b"", start] and reads answers up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start])
    out = []
    while True:
        assert dealer.poll(15_000), "the replay answer stalled"
        frames = dealer.recv_multipart()
        assert len(frames) == 3 and frames[0] == b"", "[empty delimiter, seq, payload]"
        _, seq_bytes, payload = frames
        if seq_bytes == END_SEQ:
            assert payload == b"", "the end marker carries an empty payload"
            dealer.close(linger=0)
            return out
        out.append((int.from_bytes(seq_bytes, "big"), payload))


def test_a_gap_is_recovered_through_the_replay_socket(emitter, ctx):
    em = emitter("--encoding", "array", "--dp-rank", "1")
    sub = live_subscriber(ctx, em)
    span = em.cmd("script")
    first, last = span["first"], span["last"]
    stream = receive_script(sub, first, last)

    # A subscriber that lost first+2 .. first+4 sees first+5 next, and asks from first+2,
    # as vLLM's example subscriber does.
    applied = [s for s in stream if not first + 2 <= s <= first + 4]
    gap_at = next(s for a, s in zip(applied, applied[1:]) if s != a + 1)
    assert gap_at == first + 5
    answers = replay(ctx, em.endpoints["replay"], (first + 2).to_bytes(8, "big"))
    assert [s for s, _ in answers] == list(range(first + 2, last + 1))
    for seq, payload in answers:
        assert payload == stream[seq][1], f"replayed batch {seq} differs from the live one"
    KVEventBatch = vllm_structs("lora_name")
    want = expected("int")
    for seq, payload in answers:
        check_batch(
            msgspec.msgpack.decode(payload, type=KVEventBatch),
            want[seq - first],
            1,
            "lora_name",
        )

    # Past the newest batch: the end marker alone. A malformed request: the same.
    assert replay(ctx, em.endpoints["replay"], (last + 1).to_bytes(8, "big")) == []
    assert replay(ctx, em.endpoints["replay"], b"\x01\x02") == []
    # vLLM's example subscriber asks with a REQ socket; its first answer arrives.
    req = ctx.socket(zmq.REQ)
    req.connect(em.endpoints["replay"])
    req.send(last.to_bytes(8, "big"))
    assert req.poll(15_000)
    seq_bytes, payload = req.recv_multipart()
    assert int.from_bytes(seq_bytes, "big") == last and payload == stream[last][1]
    stats = em.cmd("stats")
    assert stats["replay_requests"] == 4
    assert stats["replay_rejected"] == 1


def test_the_replay_buffer_keeps_only_the_newest_batches(emitter, ctx):
    em = emitter("--buffer-steps", "3")
    span = em.cmd("script")
    answers = replay(ctx, em.endpoints["replay"], (0).to_bytes(8, "big"))
    # Asked from 0, answered from the oldest kept: the first number says what was lost.
    assert [s for s, _ in answers] == [span["last"] - 2, span["last"] - 1, span["last"]]
    assert em.cmd("stats")["replay_buffer_batches"] == 3
