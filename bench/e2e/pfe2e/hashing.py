"""vLLM's prefix-cache block hashes, as the published PegaFlow connector sends them.

vLLM keys every full block of `block_size` tokens by a hash chained over the whole prefix:
`hash_i = H((hash_{i-1}, tuple(tokens of block i), extra_keys))`, where `H` is the
`prefix_caching_hash_algo` (default `sha256`: SHA-256 of the object's pickle at the highest
protocol) and the first block's parent is `NONE_HASH` (`H(PYTHONHASHSEED)` when that variable
is set, 32 random bytes per process otherwise). A partial last block has no hash. The
connector (pegaflow-llm 0.25.1) keys its Save and QueryPrefetch calls with exactly these
digests when its block size equals vLLM's (`hash_scale` 1), and with every `hash_scale`-th one
otherwise. This module computes them without vLLM; it never touches a server or torch.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Iterable, Sequence

#: vLLM's default KV-cache block size in tokens (and the connector's).
BLOCK_TOKENS = 16

#: The seed used when none is given: what `PYTHONHASHSEED=0` gives vLLM.
DEFAULT_SEED = "0"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's `sha256` hash function: SHA-256 of `pickle.dumps(obj, HIGHEST_PROTOCOL)` (32 bytes)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The root parent of every chain: `sha256_pickle(seed)`, as vLLM's `init_none_hash` with
    `PYTHONHASHSEED=seed`."""
    return sha256_pickle(seed)


def block_hash(parent: bytes, block_tokens: Sequence[int], extra_keys: Any = None) -> bytes:
    """The hash of one full block given its parent's hash (vLLM's `hash_block_tokens`).

    Tokens are converted to Python ints first: a numpy or torch integer pickles differently,
    and vLLM hashes Python ints.
    """
    return sha256_pickle((parent, tuple(int(t) for t in block_tokens), extra_keys))


def chained_block_hashes(
    tokens: Sequence[int],
    block_tokens: int = BLOCK_TOKENS,
    seed: str = DEFAULT_SEED,
    extra_keys: Any = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """One hash per full block of `tokens` (a partial tail block gets none).

    `parent`: the hash of the block before `tokens[0]` (to continue a chain); `None` starts at
    the root (`none_hash(seed)`).

    Raises `ValueError` when `block_tokens` is not positive.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    prev = none_hash(seed) if parent is None else parent
    out = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        prev = block_hash(prev, tokens[start:start + block_tokens], extra_keys)
        out.append(prev)
    return out


def per_connector_block(hashes: Sequence[bytes], hash_scale: int) -> list[bytes]:
    """The connector's keys when its block holds `hash_scale` vLLM hash blocks: the last hash
    inside each connector block (vLLM's `BlockHashListWithBlockSize` rule); a trailing
    incomplete group is dropped.

    Raises `ValueError` when `hash_scale` is not positive.
    """
    if hash_scale <= 0:
        raise ValueError(f"hash_scale must be positive, got {hash_scale}")
    return list(hashes[hash_scale - 1::hash_scale])


def cached_prefix_blocks(num_tokens: int, new_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Full blocks a request of `num_tokens` can take from a cache when at least `new_tokens`
    of its last tokens must be computed (vLLM computes at least the last token, so a request
    whose every block is cached still runs one block: `new_tokens=1` gives
    `(num_tokens - 1) // block_tokens`).

    Raises `ValueError` on a non-positive `num_tokens`, `new_tokens` outside `1..=num_tokens`
    or a non-positive `block_tokens`.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if not 1 <= new_tokens <= num_tokens:
        raise ValueError(f"new_tokens must be in 1..={num_tokens}, got {new_tokens}")
    return (num_tokens - new_tokens) // block_tokens


def hex_short(hashes: Iterable[bytes], n: int = 3) -> str:
    """The first `n` hashes as 8-hex-digit prefixes, for logs."""
    hs = list(hashes)
    head = ",".join(h[:4].hex() for h in hs[:n])
    return f"[{head}{',…' if len(hs) > n else ''}] ({len(hs)})"
