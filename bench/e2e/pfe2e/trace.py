"""The Mooncake conversation trace for the multi-request run: reading it, scaling its
512-token blocks down to what one GPU prefills in the run's time, deterministic token ids per
trace block (so that requests sharing a prefix of hash ids share that prefix of tokens and so
of vLLM block hashes), and an exact model of the server's DRAM tier under LRU eviction.

The LRU model follows the rules of the replay bench's simulation (bench/src/sim.rs): the
capacity is rounded down to the DRAM tier's 512-byte granule and a block's footprint up to
it; a query touches the resident prefix of its hashes and stops at the first miss; a save
plans the hashes not resident (a repeated one once, a resident one untouched), is refused
whole when they exceed the capacity, evicts the least recently used blocks until they fit,
and inserts them in order as the most recently used. It matches a server whose
`[store] evict_ahead_percent` is 0 and that has no tier below DRAM; with an SSD tier the
server's hits lie between this model and an unbounded cache (`InfiniteSim`).

Never imports torch or talks to a server.
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterable, Sequence

#: Tokens one trace block covers (the Mooncake release's block size).
TRACE_BLOCK_TOKENS = 512

#: File name of the shipped trace.
TRACE_FILE = "mooncake_conversation_trace.jsonl"

#: The DRAM tier's allocation granule in bytes.
GRANULE = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: arrival (ms from the start), prompt length in tokens, prefix
    block hash ids (one per 512-token block; the last may be partial)."""

    timestamp: int
    input_length: int
    hash_ids: tuple[int, ...]
    output_length: int = 0


def parse(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests from JSONL lines, sorted by timestamp (stable). Blank lines are skipped.

    Raises `ValueError` naming the line of a malformed request.
    """
    out = []
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            o = json.loads(line)
            out.append(TraceRequest(int(o["timestamp"]), int(o["input_length"]), tuple(int(h) for h in o["hash_ids"]), int(o.get("output_length", 0))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {i + 1} is not a request object: {e}") from None
    out.sort(key=lambda r: r.timestamp)
    return out


def load(path: str | os.PathLike, limit: int | None = None) -> list[TraceRequest]:
    """The trace at `path`, sorted by timestamp, its first `limit` requests when given."""
    with open(path, encoding="utf-8") as f:
        reqs = parse(f)
    return reqs if limit is None else reqs[:limit]


def find(extra: Sequence[str | os.PathLike] = ()) -> Path:
    """The trace file: `$E2E_TRACE`, then `extra`, then beside this package (the `.gpu/`
    folder), then the repository's `bench/data/`.

    Raises `FileNotFoundError` listing where it looked.
    """
    here = Path(__file__).resolve().parent
    cands = []
    if os.environ.get("E2E_TRACE"):
        cands.append(Path(os.environ["E2E_TRACE"]))
    cands += [Path(p) for p in extra]
    cands += [here.parent / TRACE_FILE, here.parent.parent / "data" / TRACE_FILE, here.parent.parent.parent / "bench" / "data" / TRACE_FILE]
    for c in cands:
        if c.is_file():
            return c
    raise FileNotFoundError(f"no trace found (looked at {', '.join(str(c) for c in cands)}); set E2E_TRACE")


@dataclass(frozen=True)
class ScaledRequest:
    """A trace request scaled to `block_tokens` tokens per trace block: its kept hash ids,
    its prompt length in tokens and the tokens of its last (possibly partial) block."""

    index: int
    hash_ids: tuple[int, ...]
    num_tokens: int
    last_block_tokens: int
    truncated: bool


def scale(req: TraceRequest, index: int, block_tokens: int, max_tokens: int | None = None) -> ScaledRequest:
    """`req` with each 512-token trace block scaled to `block_tokens` tokens: every block but
    the last is `block_tokens` long; the last keeps its share of 512 (rounded up, at least 1
    token). A request longer than `max_tokens` keeps its first `max_tokens // block_tokens`
    blocks, all whole.

    Raises `ValueError` on a non-positive `block_tokens`, a `max_tokens` below one block, or
    a request without blocks.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if max_tokens is not None and max_tokens < block_tokens:
        raise ValueError(f"max_tokens {max_tokens} is below one block of {block_tokens}")
    n = len(req.hash_ids)
    if n == 0:
        raise ValueError(f"request {index} has no blocks")
    tail = req.input_length - TRACE_BLOCK_TOKENS * (n - 1)
    tail = min(max(tail, 1), TRACE_BLOCK_TOKENS)
    last = min(block_tokens, max(1, -(-tail * block_tokens // TRACE_BLOCK_TOKENS)))
    total = block_tokens * (n - 1) + last
    if max_tokens is not None and total > max_tokens:
        k = max_tokens // block_tokens
        return ScaledRequest(index, req.hash_ids[:k], k * block_tokens, block_tokens, True)
    return ScaledRequest(index, req.hash_ids, total, last, False)


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0, low: int = 0) -> list[int]:
    """The `block_tokens` token ids of trace block `hash_id`: the same for the same id, seed
    and size, drawn uniformly from `[low, vocab_size)`."""
    rng = random.Random(f"pfe2e:{seed}:{hash_id}")
    return [rng.randrange(low, vocab_size) for _ in range(block_tokens)]


def request_token_ids(req: ScaledRequest, block_tokens: int, vocab_size: int, seed: int = 0, low: int = 0) -> list[int]:
    """The prompt of `req`: each kept trace block's ids, the last cut to its length."""
    out: list[int] = []
    for i, h in enumerate(req.hash_ids):
        ids = block_token_ids(h, block_tokens, vocab_size, seed, low)
        out += ids if i + 1 < len(req.hash_ids) else ids[:req.last_block_tokens]
    return out


@dataclass
class SaveOutcome:
    """What one save did to the model."""

    inserted: int = 0
    evicted: int = 0
    rejected: bool = False


class LruSim:
    """The DRAM tier under LRU (module doc): `capacity_bytes` of blocks of `block_bytes`."""

    def __init__(self, capacity_bytes: int, block_bytes: int):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.capacity = capacity_bytes // GRANULE * GRANULE
        self.footprint = -(-block_bytes // GRANULE) * GRANULE
        self.used = 0
        self._lru: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def lru_order(self) -> list[Hashable]:
        """Resident keys, least recently used first."""
        return list(self._lru)

    def query(self, keys: Sequence[Hashable]) -> int:
        """Touches the resident prefix of `keys`; returns its length."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            self._lru.move_to_end(k)
            n += 1
        return n

    def save(self, keys: Sequence[Hashable]) -> SaveOutcome:
        """Inserts the keys not resident (module doc)."""
        plan: list[Hashable] = []
        seen = set()
        for k in keys:
            if k not in self._lru and k not in seen:
                plan.append(k)
                seen.add(k)
        out = SaveOutcome()
        if not plan:
            return out
        need = len(plan) * self.footprint
        if need > self.capacity:
            out.rejected = True
            return out
        while self.capacity - self.used < need and self._lru:
            self._lru.popitem(last=False)
            self.used -= self.footprint
            out.evicted += 1
        for k in plan:
            self._lru[k] = None
            self.used += self.footprint
            out.inserted += 1
        return out


class InfiniteSim:
    """An unbounded cache: every saved key stays (the most any tier stack can hit)."""

    def __init__(self):
        self._keys: set[Hashable] = set()

    def query(self, keys: Sequence[Hashable]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def save(self, keys: Sequence[Hashable]) -> SaveOutcome:
        new = [k for k in dict.fromkeys(keys) if k not in self._keys]
        self._keys.update(new)
        return SaveOutcome(inserted=len(new))
