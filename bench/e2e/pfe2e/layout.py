"""vLLM's paged KV-cache layout: shapes, what the connector registers for it, block tables,
and the conversion between pages and the contiguous per-request K/V a transformers model
takes.

Per attention layer vLLM holds one tensor of pages of `block_tokens` tokens:

- `kv-first` (FlashAttention's layout, the default): `[2, num_blocks, block_tokens, kv_heads,
  head_dim]`: K of every block, then V of every block. The connector registers it as 2
  segments per block: `bytes_per_block` = one block's K (stride of dim 1), `kv_stride_bytes`
  = the distance from K to V (stride of dim 0).
- `blocks-first` (FlashInfer's): `[num_blocks, 2, block_tokens, kv_heads, head_dim]`: one
  page holds K then V. Registered as 1 segment: `bytes_per_block` = the whole page,
  `kv_stride_bytes` 0.

transformers' cache holds per layer `key`, `value` of `[batch, kv_heads, seq, head_dim]`.
`gather_kv` builds those from a request's block table; `scatter_kv` writes them back. Both
are written with operations numpy arrays and torch tensors share (fancy indexing on the
first axis, `reshape`, `swapaxes`, `[None]`), so the same code is tested on CPU with numpy
and runs on the GPU with torch. This module never imports torch or talks to a server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

KV_FIRST = "kv-first"
BLOCKS_FIRST = "blocks-first"
LAYOUTS = (KV_FIRST, BLOCKS_FIRST)


@dataclass(frozen=True)
class Registration:
    """What the connector sends per layer in RegisterContextBatch for one KV tensor."""

    num_blocks: int
    bytes_per_block: int
    kv_stride_bytes: int
    segments: int


@dataclass(frozen=True)
class PagedLayout:
    """One layer's page tensor: `kind`, `num_blocks` pages of `block_tokens` tokens of
    `kv_heads` x `head_dim` elements of `dtype_bytes` bytes."""

    kind: str
    num_blocks: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.kind!r}")
        for name in ("num_blocks", "block_tokens", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's page tensor."""
        if self.kind == KV_FIRST:
            return (2, self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim)
        return (self.num_blocks, 2, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def segment_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block's K and V in one layer."""
        return 2 * self.segment_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's page tensor."""
        return self.num_blocks * self.block_bytes_per_layer

    def registration(self) -> Registration:
        """The registration of a contiguous tensor of this layout (see
        `registration_from_strides` for the rule)."""
        return registration_from_strides(self.layer_shape, contiguous_strides(self.layer_shape), self.dtype_bytes)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def registration_from_strides(shape: Sequence[int], strides: Sequence[int], element_size: int) -> Registration:
    """The connector's registration of a non-MLA attention KV tensor (pegaflow-llm 0.25.1):
    a tensor whose first dimension is 2 is KV-first (`num_blocks` = shape[1],
    `bytes_per_block` = stride[1] x element size, `kv_stride_bytes` = stride[0] x element size,
    2 segments); any other is blocks-first (`num_blocks` = shape[0], `bytes_per_block` =
    stride[0] x element size, `kv_stride_bytes` 0, 1 segment).

    Raises `ValueError` on a shape of fewer than 2 dimensions, a length mismatch, or a zero
    block count or block size.
    """
    if len(shape) < 2 or len(shape) != len(strides):
        raise ValueError(f"shape {tuple(shape)} and strides {tuple(strides)} do not describe a KV tensor")
    if shape[0] == 2:
        reg = Registration(shape[1], strides[1] * element_size, strides[0] * element_size, 2)
    else:
        reg = Registration(shape[0], strides[0] * element_size, 0, 1)
    if reg.num_blocks <= 0 or reg.bytes_per_block <= 0:
        raise ValueError(f"invalid KV tensor: shape {tuple(shape)} strides {tuple(strides)}")
    return reg


def registration_lists(reg: Registration, num_layers: int) -> dict[str, list[int]]:
    """RegisterContextBatch's per-layer lists for `num_layers` layers of one registration."""
    return {
        "num_blocks_list": [reg.num_blocks] * num_layers,
        "bytes_per_block_list": [reg.bytes_per_block] * num_layers,
        "kv_stride_bytes_list": [reg.kv_stride_bytes] * num_layers,
        "segments_list": [reg.segments] * num_layers,
    }


def block_table(first: int, count: int, shuffle_seed: int | None = None) -> list[int]:
    """`count` page ids from the region `[first, first + count)`: in order, or shuffled with
    `shuffle_seed` (a running engine's free list hands out scattered pages).

    Raises `ValueError` on a negative `first` or `count`.
    """
    if first < 0 or count < 0:
        raise ValueError(f"first and count must be >= 0, got {first}, {count}")
    ids = list(range(first, first + count))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(ids)
    return ids


def slot_mapping(block_ids: Sequence[int], num_tokens: int, block_tokens: int) -> list[int]:
    """vLLM's slot of each token: `block_ids[t // block_tokens] * block_tokens + t %
    block_tokens` for `t < num_tokens`.

    Raises `ValueError` when the table is too short for `num_tokens`.
    """
    if num_tokens > len(block_ids) * block_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_tokens} tokens cannot hold {num_tokens} tokens")
    return [block_ids[t // block_tokens] * block_tokens + t % block_tokens for t in range(num_tokens)]


def _kv_blocks(pages: Any, idx: Any, kind: str, which: int) -> Any:
    """`[n, block_tokens, heads, dim]` K (`which` 0) or V (1) of the pages `idx`."""
    if kind == KV_FIRST:
        return pages[which][idx]
    if kind == BLOCKS_FIRST:
        return pages[idx, which]
    raise ValueError(f"unknown layout {kind!r}")


def gather_kv(pages: Any, block_ids: Any, num_tokens: int, kind: str = KV_FIRST) -> tuple[Any, Any]:
    """K and V of a request's first `num_tokens` tokens, each `[1, kv_heads, num_tokens,
    head_dim]`, from one layer's page tensor and the request's block table.

    `block_ids`: the page ids in token order (a list, or an index array of the pages' own
    library and device); only the first `ceil(num_tokens / block_tokens)` are read. The
    result is a fresh array (indexing copies), laid out `[1, heads, tokens, dim]` as a view
    over `[tokens, heads, dim]` storage; `contiguous` makes it dense.

    Raises `ValueError` when the table is shorter than `num_tokens` needs.
    """
    block_tokens = pages.shape[2]
    need = -(-num_tokens // block_tokens)
    if need > len(block_ids):
        raise ValueError(f"{len(block_ids)} blocks of {block_tokens} tokens cannot hold {num_tokens} tokens")
    idx = block_ids[:need]
    out = []
    for which in (0, 1):
        blocks = _kv_blocks(pages, idx, kind, which)
        n, b, h, d = blocks.shape
        flat = blocks.reshape(n * b, h, d)[:num_tokens]
        out.append(flat.swapaxes(0, 1)[None])
    return out[0], out[1]


def scatter_kv(pages: Any, block_ids: Any, key: Any, value: Any, kind: str = KV_FIRST, token_start: int = 0) -> None:
    """Writes tokens `[token_start, token_start + len(block_ids) * block_tokens)` of `key`
    and `value` (`[1, kv_heads, seq, head_dim]`) into the pages `block_ids`, in order: the
    inverse of `gather_kv` for whole blocks. Only whole blocks are written (vLLM saves full
    blocks only).

    Raises `ValueError` when `key`/`value` do not hold that many tokens after `token_start`,
    or their heads and dims differ from the pages'.
    """
    block_tokens, heads, dim = pages.shape[2], pages.shape[3], pages.shape[4]
    n = len(block_ids)
    end = token_start + n * block_tokens
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] != 1 or t.shape[1] != heads or t.shape[3] != dim:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not match pages of {heads} heads x {dim}")
        if token_start < 0 or end > t.shape[2]:
            raise ValueError(f"{name} holds {t.shape[2]} tokens, {n} blocks from token {token_start} need {end}")
    if n == 0:
        return
    for which, t in ((0, key), (1, value)):
        blocks = t[0][:, token_start:end].swapaxes(0, 1).reshape(n, block_tokens, heads, dim)
        if kind == KV_FIRST:
            pages[which][block_ids] = blocks
        elif kind == BLOCKS_FIRST:
            pages[block_ids, which] = blocks
        else:
            raise ValueError(f"unknown layout {kind!r}")


def contiguous(x: Any) -> Any:
    """A dense copy (torch: `.contiguous()`; numpy: `ascontiguousarray` through `.copy()`)."""
    if hasattr(x, "contiguous"):
        return x.contiguous()
    return x.copy()
