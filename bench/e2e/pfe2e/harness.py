"""The measured work: a transformers model with random weights whose KV cache lives in
vLLM's paged layout, registered with a KV-cache server through the published client, and
the phases of one prompt's time to first token — cold (one forward over the whole prompt)
and a cache hit (QueryPrefetch until Ready, Load into other pages, rebuild the model's cache
from them, forward of the new tokens) — with the checks that make a hit trustworthy: the
loaded pages equal the saved ones bit for bit, and the hit's logits equal those of the same
forward on the never-saved pages.

Needs torch and transformers (on the GPU machine, or on CPU for a dry run against our server
with host-memfd registration); everything a test can check without them lives in the
torch-free modules. Never starts or stops a process (`servers` does).
"""

from __future__ import annotations

import mmap
import os
import pickle
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import hashing, layout, models

# --------------------------------------------------------------------------------------------
# device and model
# --------------------------------------------------------------------------------------------


class Clock:
    """Wall time that first waits for the device's queued work (CUDA) so a timed region ends
    when its kernels end."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def build_model(spec: models.ModelSpec, device: torch.device, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """The model of `spec` with random weights (the architecture's own initialisation, seeded),
    bf16, allocated on `device` directly, in eval mode."""
    import transformers

    if spec.family == "llama":
        cfg_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif spec.family == "qwen3":
        cfg_cls, model_cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown model family {spec.family!r}")
    cfg = cfg_cls(**spec.config)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = model_cls._from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn)
    return model.eval()


def prompt_ids(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """`num_tokens` token ids drawn with `seed` (the same for the same arguments)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()


def forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any = None, keep: int = 1) -> tuple[torch.Tensor, Any]:
    """One forward of `ids` (`[1, T]`) on top of `cache` (None: an empty one); the logits of
    the last `keep` positions (`[1, keep, vocab]`) and the cache, which now holds the new
    tokens' K/V too."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits, out.past_key_values


def cache_layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (`[1, heads, seq, dim]`) of one layer of a transformers cache."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        return lay.keys, lay.values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers 4.x


def new_cache(model: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x
        return DynamicCache()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two bf16/fp16 tensors (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


# --------------------------------------------------------------------------------------------
# the engine's paged KV cache
# --------------------------------------------------------------------------------------------


def layer_names(num_layers: int) -> list[str]:
    """vLLM's attention layer names."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


@dataclass
class KvPages:
    """One page tensor per layer in `lay`'s layout, on the GPU (registered as CUDA IPC
    handles, as vLLM's connector does) or in one host memfd (registered natively, for a CPU
    dry run against our server)."""

    lay: layout.PagedLayout
    num_layers: int
    device: torch.device
    pages: list[torch.Tensor] = field(default_factory=list)
    _mm: Any = None
    _fd: int = -1

    @classmethod
    def allocate(cls, lay: layout.PagedLayout, num_layers: int, device: torch.device) -> "KvPages":
        kp = cls(lay, num_layers, device)
        if device.type == "cuda":
            kp.pages = [torch.zeros(lay.layer_shape, dtype=torch.bfloat16, device=device) for _ in range(num_layers)]
        else:
            size = lay.layer_bytes * num_layers
            kp._fd = os.memfd_create("pfe2e-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(kp._fd, size)
            kp._mm = mmap.mmap(kp._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            base = torch.frombuffer(kp._mm, dtype=torch.bfloat16).view(num_layers, *lay.layer_shape)
            kp.pages = [base[i] for i in range(num_layers)]
        return kp

    @property
    def names(self) -> list[str]:
        return layer_names(self.num_layers)

    @property
    def block_axis(self) -> int:
        return 1 if self.lay.kind == layout.KV_FIRST else 0

    def registration(self) -> layout.Registration:
        """The connector's registration of these tensors, from their real shape and strides."""
        t = self.pages[0]
        return layout.registration_from_strides(tuple(t.shape), tuple(t.stride()), t.element_size())

    def register(self, client: Any, instance_id: str, namespace: str, backend: str = "direct", page_first: bool = False,
                 grpc_target: str | None = None, fd_socket: str | None = None) -> tuple[bool, str]:
        """RegisterContextBatch as the connector sends it (CUDA IPC), or the native host-memfd
        registration (CPU: needs our server's `grpc_target` and `fd_socket`)."""
        reg = self.registration()
        lists = layout.registration_lists(reg, self.num_layers)
        if self.device.type == "cuda":
            from pegaflow.ipc_wrapper import CudaIPCWrapper

            wrappers = [pickle.dumps(CudaIPCWrapper(t)) for t in self.pages]
            dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return client.register_context_batch(
                instance_id, namespace, 0, 0, 1, 1, dev, self.names, wrappers, lists["num_blocks_list"], lists["bytes_per_block_list"],
                lists["kv_stride_bytes_list"], lists["segments_list"], backend, page_first, layer_group_ids=[0] * self.num_layers)
        pftest = _pftest()
        pftest.send_fd(fd_socket, instance_id, 0, self._fd)
        body = pftest.encode_register(
            instance_id=instance_id, namespace=namespace, layer_names=self.names, num_blocks=lists["num_blocks_list"],
            bytes_per_block=lists["bytes_per_block_list"], kv_stride_bytes=lists["kv_stride_bytes_list"], segments=lists["segments_list"],
            page_first=page_first, layer_group_ids=[0] * self.num_layers,
            native_kv_tensors=[(i * self.lay.layer_bytes, self.lay.layer_bytes, reg.bytes_per_block) for i in range(self.num_layers)],
            native_alloc_size=self.lay.layer_bytes * self.num_layers, memory_kind=pftest.MEMORY_KIND_HOST_MEMFD)
        return pftest.raw_register(grpc_target, body)

    @property
    def device_id(self) -> int:
        if self.device.type == "cuda":
            return self.device.index if self.device.index is not None else torch.cuda.current_device()
        return 0

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def scatter(self, cache: Any, block_ids: Sequence[int], token_start: int = 0) -> None:
        """Writes the whole blocks of `cache` from `token_start` into `block_ids`."""
        idx = self.index(block_ids)
        for l, pg in enumerate(self.pages):
            k, v = cache_layer_kv(cache, l)
            layout.scatter_kv(pg, idx, k, v, self.lay.kind, token_start)

    def rebuild(self, model: torch.nn.Module, block_ids: torch.Tensor, num_tokens: int) -> Any:
        """A transformers cache holding the first `num_tokens` tokens of the pages `block_ids`."""
        cache = new_cache(model)
        for l, pg in enumerate(self.pages):
            k, v = layout.gather_kv(pg, block_ids, num_tokens, self.lay.kind)
            cache.update(k, v, l)
        return cache

    def matches_cache(self, cache: Any, block_ids: torch.Tensor, num_tokens: int) -> bool:
        """Whether the pages hold exactly `cache`'s first `num_tokens` tokens."""
        for l, pg in enumerate(self.pages):
            k, v = layout.gather_kv(pg, block_ids, num_tokens, self.lay.kind)
            ck, cv = cache_layer_kv(cache, l)
            if not (bits_equal(layout.contiguous(k), ck[:, :, :num_tokens].contiguous()) and bits_equal(layout.contiguous(v), cv[:, :, :num_tokens].contiguous())):
                return False
        return True

    def poison(self, block_ids: torch.Tensor) -> None:
        """NaN into every byte of the pages `block_ids` (a load that writes nothing shows)."""
        for pg in self.pages:
            pg.index_fill_(self.block_axis, block_ids, float("nan"))

    def blocks_equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether pages `a[i]` and `b[i]` hold the same bits, for every layer and `i`."""
        ax = self.block_axis
        return all(bits_equal(pg.index_select(ax, a), pg.index_select(ax, b)) for pg in self.pages)

    def fingerprints(self, block_ids: torch.Tensor) -> list[tuple[int, int]]:
        """Two sums per block over every layer's K and V bits (plain and position-weighted):
        what a block's bytes must still give after a save and a load."""
        n = block_ids.numel()
        acc1 = torch.zeros(n, dtype=torch.int64, device=self.device)
        acc2 = torch.zeros(n, dtype=torch.int64, device=self.device)
        ax = self.block_axis
        for pg in self.pages:
            x = pg.index_select(ax, block_ids)
            if ax == 1:
                x = x.transpose(0, 1)
            x = x.reshape(n, -1).view(torch.int16).to(torch.int64)
            w = (torch.arange(x.shape[1], device=self.device, dtype=torch.int64) % 251) + 1
            acc1 += x.sum(1)
            acc2 += (x * w).sum(1)
        return list(zip(acc1.tolist(), acc2.tolist()))

    def close(self) -> None:
        self.pages = []
        if self._mm is not None:
            try:
                self._mm.close()
            except (BufferError, ValueError):
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pftest():
    """The CPU dry run's native registration helpers: tests/python/pftest.py of this repo (or
the folder `$PFE2E_PFTEST_DIR` names, for a copy of the package outside the repo)."""
    here = Path(__file__).resolve()
    cands = [Path(os.environ["PFE2E_PFTEST_DIR"])] if os.environ.get("PFE2E_PFTEST_DIR") else []
    cands += [up / "tests" / "python" for up in here.parents]
    for cand in cands:
        if (cand / "pftest.py").is_file():
            if str(cand) not in sys.path:
                sys.path.insert(0, str(cand))
            import pftest

            return pftest
    raise RuntimeError("the CPU dry run registers host memory through tests/python/pftest.py: not found (set PFE2E_PFTEST_DIR)")


# --------------------------------------------------------------------------------------------
# server calls
# --------------------------------------------------------------------------------------------


class HitError(RuntimeError):
    """A hit could not be measured (timeout, short hit, failed load); `status` says which."""

    def __init__(self, status: str, msg: str):
        super().__init__(msg)
        self.status = status


@dataclass
class Instance:
    """One registration of the pages with one server."""

    client: Any
    instance_id: str
    kv: KvPages

    def save(self, block_ids: Sequence[int], hashes: Sequence[bytes], batch: int) -> float:
        """Save RPCs of `batch` blocks (every layer), as the connector sends them; seconds."""
        t0 = time.perf_counter()
        for b in range(0, len(block_ids), batch):
            ids, hs = list(block_ids[b:b + batch]), list(hashes[b:b + batch])
            ok, msg = self.client.save(self.instance_id, 0, 0, self.kv.device_id, [(nm, ids, hs) for nm in self.kv.names])
            if not ok:
                raise RuntimeError(f"save of blocks {b}..{b + len(ids)} failed: {msg}")
        return time.perf_counter() - t0

    def query_until_ready(self, hashes: Sequence[bytes], timeout: float, poll_s: float = 0.0005, req_id: str | None = None) -> tuple[Any, int, str]:
        """QueryPrefetch, re-polled with the same request id and hashes while it answers
        Loading (as the connector does); (the Ready answer, polls, the first answer's kind).

        Raises `HitError("timeout")` when still Loading after `timeout` s."""
        from pegaflow.pegaflow import QueryReady

        rid = req_id or f"e2e-{uuid.uuid4().hex[:10]}"
        deadline = time.perf_counter() + timeout
        polls, first = 0, None
        while True:
            r = self.client.query_prefetch(self.instance_id, list(hashes), rid)
            polls += 1
            if first is None:
                first = "ready" if isinstance(r, QueryReady) else "loading"
            if isinstance(r, QueryReady):
                return r, polls, first
            if time.perf_counter() > deadline:
                raise HitError("timeout", f"still Loading after {timeout:.0f} s ({polls} polls)")
            if poll_s:
                time.sleep(poll_s)

    def release(self, r: Any) -> None:
        if r is not None and getattr(r, "lease", None) and r.num_hit_blocks > 0:
            try:
                self.client.release(r.lease)
            except Exception:
                pass

    def wait_visible(self, hashes: Sequence[bytes], timeout: float) -> float:
        """Seconds until a query hits all `hashes` (sealing is asynchronous after Save)."""
        t0 = time.perf_counter()
        while True:
            r, _, _ = self.query_until_ready(hashes, timeout)
            n = r.num_hit_blocks
            self.release(r)
            if n >= len(hashes):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"only {n} of {len(hashes)} saved blocks visible after {timeout:.0f} s")
            time.sleep(0.005)

    def load(self, lease: bytes, dest_ids: Sequence[int], timeout: float) -> None:
        """Load of a lease into `dest_ids` through a PyLoadState, spinning until done.

        Raises `HitError("load-failed")` on a refused or failed load or a timeout."""
        from pegaflow.pegaflow import PyLoadState

        ls = PyLoadState()
        ok, msg = self.client.load(self.instance_id, 0, self.kv.device_id, ls.shm_name(), [self.kv.names], [(lease, [list(dest_ids)])])
        if not ok:
            raise HitError("load-failed", f"load refused: {msg}")
        deadline = time.perf_counter() + timeout
        spins = 0
        while not ls.is_ready():
            spins += 1
            if spins % 4096 == 0 and time.perf_counter() > deadline:
                raise HitError("load-failed", f"load not done after {timeout:.0f} s")
        st = ls.get_state()
        if st != 1:
            raise HitError("load-failed", f"load state {st}")

    def unregister(self) -> None:
        try:
            self.client.unregister_context(self.instance_id)
        except Exception:
            pass


# --------------------------------------------------------------------------------------------
# one prompt
# --------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One prompt of `num_tokens` and what a hit of it needs: the cached prefix (`prefix_blocks`
    full blocks) and its chained hashes, the pages it was computed into (`src`) and the ones
    a hit loads into (`dest`)."""

    num_tokens: int
    ids: torch.Tensor  # [1, num_tokens] on the device
    prefix_blocks: int
    block_tokens: int
    hashes: list[bytes]
    src: list[int]
    dest: list[int]
    keep: int
    src_idx: torch.Tensor | None = None
    dest_idx: torch.Tensor | None = None

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_blocks * self.block_tokens

    @property
    def suffix_ids(self) -> torch.Tensor:
        return self.ids[:, self.prefix_tokens:]


def make_prompt(num_tokens: int, new_tokens: int, vocab: int, seed: int, kv: KvPages, src_first: int, dest_first: int,
                shuffle: bool = True) -> Prompt:
    """The prompt of `num_tokens` random tokens (`seed`), the longest whole-block prefix that
    leaves at least `new_tokens` to compute, its vLLM block hashes, and block tables in the
    regions starting at `src_first` and `dest_first` (shuffled, as a running engine's free
    list hands pages out)."""
    bt = kv.lay.block_tokens
    toks = prompt_ids(num_tokens, vocab, seed)
    nb = hashing.cached_prefix_blocks(num_tokens, new_tokens, bt)
    hashes = hashing.chained_block_hashes(toks, bt)[:nb]
    src = layout.block_table(src_first, nb, seed if shuffle else None)
    dest = layout.block_table(dest_first, nb, seed + 1 if shuffle else None)
    p = Prompt(num_tokens, torch.tensor([toks], dtype=torch.long, device=kv.device), nb, bt, hashes, src, dest, new_tokens)
    p.src_idx, p.dest_idx = kv.index(src), kv.index(dest)
    return p


@dataclass
class Reference:
    """What every hit of a prompt is checked against: the cold forward's logits and the
    suffix forward's logits on the never-saved pages."""

    cold_logits: torch.Tensor
    ref_logits: torch.Tensor
    ref_deterministic: bool


def cold_ttft(model, clock: Clock, p: Prompt) -> tuple[float, torch.Tensor, Any]:
    """One forward over the whole prompt: (seconds to the first token on the host, the last
    `keep` positions' logits, the cache)."""
    t0 = clock.now()
    logits, cache = forward(model, p.ids, None, p.keep)
    int(logits[0, -1].argmax())
    return clock.now() - t0, logits, cache


def suffix_alone(model, clock: Clock, kv: KvPages, p: Prompt) -> tuple[float, torch.Tensor]:
    """The suffix forward on a cache rebuilt (untimed) from the never-saved pages: (its
    seconds, its logits)."""
    cache = kv.rebuild(model, p.src_idx, p.prefix_tokens)
    t0 = clock.now()
    logits, cache = forward(model, p.suffix_ids, cache, p.keep)
    int(logits[0, -1].argmax())
    dt = clock.now() - t0
    del cache
    return dt, logits


def hit_once(model, clock: Clock, inst: Instance, p: Prompt, ref: Reference, query_timeout: float, load_timeout: float,
             before: Callable[[], None] | None = None, query_inst: Instance | None = None) -> dict:
    """One cache hit of `p`: poison the destination pages, `before()` (e.g. evict DRAM), then
    timed: QueryPrefetch until Ready, Load into `p.dest`, rebuild the cache from those pages,
    forward the new tokens, first token on the host. Untimed after: the loaded pages against
    the saved ones, the logits against the reference (bit for bit) and the cold forward's
    argmax. `query_inst`: the registration that queries and loads (another server's, for a
    peer hit); default `inst`.

    Raises `HitError` when the hit is short, times out or its load fails."""
    q = query_inst or inst
    kv = q.kv
    kv.poison(p.dest_idx)
    clock.sync()
    if before is not None:
        before()
    t0 = clock.now()
    r, polls, first = q.query_until_ready(p.hashes, query_timeout)
    t_q = time.perf_counter()
    if r.num_hit_blocks < p.prefix_blocks:
        q.release(r)
        raise HitError("partial", f"{r.num_hit_blocks} of {p.prefix_blocks} blocks hit (first answer {first}, {polls} polls)")
    q.load(r.lease, p.dest, load_timeout)
    t_l = time.perf_counter()
    cache = kv.rebuild(model, p.dest_idx, p.prefix_tokens)
    t_r = clock.now()
    logits, cache = forward(model, p.suffix_ids, cache, p.keep)
    int(logits[0, -1].argmax())
    t_s = clock.now()
    del cache
    byte_exact = kv.blocks_equal(p.dest_idx, p.src_idx)
    logit_exact = bits_equal(logits, ref.ref_logits)
    agree = (logits[0].argmax(-1) == ref.cold_logits[0].argmax(-1)).float().mean().item()
    return {
        "ttft_s": t_s - t0, "query_s": t_q - t0, "load_s": t_l - t_q, "rebuild_s": t_r - t_l, "suffix_s": t_s - t_r,
        "polls": polls, "first_answer": first, "byte_exact": byte_exact, "logit_exact": logit_exact, "argmax_vs_cold": agree,
    }
