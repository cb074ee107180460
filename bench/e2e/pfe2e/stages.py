"""The stages of a run — `ours` (cold, and hits from our server's DRAM, from a second server
over the peer path, and from its SSD tier), `pegaflow` (the same prompts against PegaFlow
0.25.1's server from the wheel: DRAM hits with both of its copy backends, and its SSD tier) and
`trace` (the Mooncake conversation trace, with the server against without it) — each a
function of a `Context` that starts its servers, measures, writes records and stops what it
started. Needs torch (through `harness`).
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import harness, hashing, layout, models, report, servers, trace

GIB = 1 << 30


class Skip(Exception):
    """A stage that cannot run here (recorded as skipped, with the reason)."""


@dataclass
class Context:
    """What the stages share: options, the record writer, the device, the model (built once)."""

    args: Any
    rec: Any  # run.Recorder
    device: torch.device
    spec: models.ModelSpec
    work: Path
    deadline: float = 0.0  # time.monotonic() by which the current stage must end
    phase: str = ""
    procs: list = field(default_factory=list)
    _model: Any = None
    _lock: Any = field(default_factory=threading.Lock)

    @property
    def model(self):
        if self._model is None:
            t0 = time.perf_counter()
            self.set_phase("build model")
            self._model = harness.build_model(self.spec, self.device, seed=self.args.seed)
            self.rec.note(f"model {self.spec.name} built on {self.device} in {time.perf_counter() - t0:.1f} s "
                          f"({sum(p.numel() for p in self._model.parameters()) / 1e9:.2f} B parameters)")
        return self._model

    @property
    def clock(self) -> harness.Clock:
        return harness.Clock(self.device)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def set_phase(self, name: str) -> None:
        self.phase = name
        print(f"[e2e] {time.strftime('%H:%M:%S')} {name} ({self.left():.0f} s left in stage)", flush=True)

    def start(self, srv: servers.Server) -> float:
        self.procs.append(srv.proc)
        s = servers.start_and_wait(srv, timeout=self.args.server_start_timeout)
        self.rec.note(f"{srv.proc.name} serving after {s:.1f} s ({' '.join(srv.proc.argv[1:])})")
        return s

    def start_plain(self, proc: servers.Proc, addr: str) -> None:
        self.procs.append(proc)
        servers.start_plain(proc, addr, timeout=self.args.server_start_timeout)

    def stop_all(self) -> None:
        with self._lock:
            procs, self.procs = list(self.procs), []
        for p in reversed(procs):
            p.stop()


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------


def prefix_blocks(args) -> list[int]:
    return [hashing.cached_prefix_blocks(n, args.new_tokens, hashing.BLOCK_TOKENS) for n in args.lengths]


def default_pool_bytes(args, spec: models.ModelSpec) -> int:
    """Room for every length's prefix at once, plus a quarter and 1 GiB; whole GiB, >= 4 GiB."""
    need = sum(prefix_blocks(args)) * spec.kv_bytes_per_block(hashing.BLOCK_TOKENS)
    return max(4, -(-(need * 5 // 4 + GIB) // GIB)) * GIB


def size_arg(nbytes: int) -> str:
    return f"{nbytes // GIB}gb" if nbytes % GIB == 0 else f"{-(-nbytes // (1 << 20))}mb"


def parse_size(s: str) -> int:
    s = s.strip().lower()
    for suf, mul in (("tb", 1 << 40), ("gb", GIB), ("mb", 1 << 20), ("kb", 1 << 10)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


# --------------------------------------------------------------------------------------------
# per-length measurement
# --------------------------------------------------------------------------------------------


@dataclass
class Tier:
    """One hit source of a stage: how its hits are made."""

    server: str  # "ours" | "pegaflow"
    tier: str  # "dram" | "ssd" | "peer"
    backend: str
    inst: harness.Instance
    reps: int
    query_timeout: float
    before: Callable[[], None] | None = None  # before each rep, untimed (e.g. evict DRAM)
    after: Callable[[], None] | None = None  # after each rep (e.g. empty the peer's DRAM)
    query_inst: harness.Instance | None = None
    warmup: int = 0


def measure_hits(ctx: Context, t: Tier, p: harness.Prompt, ref: harness.Reference, kv_bytes: int) -> dict:
    """`t.warmup` untimed and `t.reps` timed hits of `p`; writes and returns the `hit` record."""
    a = ctx.args
    rec = {"kind": "hit", "server": t.server, "tier": t.tier, "backend": t.backend, "tokens": p.num_tokens,
           "prefix_blocks": p.prefix_blocks, "kv_bytes": kv_bytes, "new_tokens": p.num_tokens - p.prefix_tokens, "reps": [], "warmup": []}
    try:
        for i in range(t.warmup + t.reps):
            if ctx.left() < a.min_rep_left_s and i >= t.warmup + 1:
                rec["note"] = f"stopped after {len(rec['reps'])} reps: the stage's time is up"
                break
            ctx.set_phase(f"{t.server} {t.tier} hit {report.fmt_tokens(p.num_tokens)} rep {i - t.warmup + 1}/{t.reps}" if i >= t.warmup else
                          f"{t.server} {t.tier} hit {report.fmt_tokens(p.num_tokens)} warm-up")
            r = harness.hit_once(ctx.model, ctx.clock, t.inst, p, ref, t.query_timeout, a.load_timeout, before=t.before, query_inst=t.query_inst)
            if t.after is not None:
                t.after()
            (rec["warmup"] if i < t.warmup else rec["reps"]).append(r)
        reps = rec["reps"]
        if not reps:
            rec["status"] = "no-reps"
        else:
            rec["status"] = "ok"
            rec["median_ttft_s"] = statistics.median(x["ttft_s"] for x in reps)
            rec["byte_exact"] = all(x["byte_exact"] for x in reps + rec["warmup"])
            rec["logit_exact"] = all(x["logit_exact"] for x in reps + rec["warmup"])
            rec["argmax_vs_cold"] = min(x["argmax_vs_cold"] for x in reps)
            rec["first_answers"] = sorted({x["first_answer"] for x in reps})
            if t.tier in ("ssd", "peer") and "ready" in rec["first_answers"]:
                # Ready at the first poll: the prefix was still in DRAM, not read from the tier.
                rec["status"], rec["why"] = "not-evicted", "a query answered Ready at once: the hit came from DRAM"
            if t.tier == "dram" and "loading" in rec["first_answers"]:
                # Loading first: part of the prefix was read from below DRAM, not a DRAM hit.
                rec["status"], rec["why"] = "not-resident", "a query answered Loading first: the prefix was not all in DRAM"
            if t.tier in ("ssd", "peer"):
                qs = statistics.median(x["query_s"] for x in reps)
                rec["ssd_read_gbps" if t.tier == "ssd" else "peer_fetch_gbps"] = kv_bytes / qs / 1e9 if qs > 0 else None
    except harness.HitError as e:
        rec["status"], rec["why"] = e.status, str(e)
    except Exception as e:  # noqa: BLE001 - a failed tier must not end the stage
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        rec["status"], rec["why"] = "failed", f"{type(e).__name__}: {e}"
    ctx.rec.write(rec)
    return rec


def wait_ssd_written(ctx: Context, srv: servers.Server, base: float, want_bytes: int, timeout: float) -> None:
    """Waits until the server's `pegaflow_ssd_write_bytes_total` grew by `want_bytes` since
    `base`, or stopped growing for 10 s, or `timeout`; notes what it saw."""
    name = "pegaflow_ssd_write_bytes_total"
    t0 = time.monotonic()
    last, last_change = base, t0
    while True:
        v = servers.metric_sum(srv.metrics(), name)
        if v != last:
            last, last_change = v, time.monotonic()
        if v - base >= want_bytes:
            ctx.rec.note(f"{srv.proc.name}: {(v - base) / GIB:.2f} GiB written to the SSD tier after {time.monotonic() - t0:.1f} s")
            return
        if time.monotonic() - last_change > 10 or time.monotonic() - t0 > timeout:
            ctx.rec.note(f"{srv.proc.name}: only {(v - base) / GIB:.2f} of {want_bytes / GIB:.2f} GiB reached the SSD tier "
                         f"({name}); an SSD hit may be partial")
            return
        time.sleep(0.1)


def run_lengths(ctx: Context, label: str, kv: harness.KvPages, saver: harness.Instance, tiers_for: Callable[[harness.Prompt], list[Tier]],
                ssd_server: servers.Server | None, cold_reps: int, measure_alone: bool) -> None:
    """For each context length, in order: cold forwards, the prefix's pages, the reference
    suffix forward, Save through `saver`, then every tier's hits. Stops at the first length
    the stage's time or the GPU's memory does not allow."""
    a = ctx.args
    spec = ctx.spec
    model = ctx.model
    nbs = prefix_blocks(a)
    region = max(nbs) + 1
    prev: tuple[int, float] | None = None  # (tokens, seconds) of the last length measured
    for n, nb in zip(a.lengths, nbs):
        # The time a length takes grows about linearly past a few K tokens (the copies and the
        # SSD reads are per byte; the forwards' attention part grows faster but is small).
        need = max(a.min_length_left_s, 1.2 * prev[1] * n / prev[0]) if prev else a.min_length_left_s
        if ctx.left() < need:
            ctx.rec.note(f"{label}: {report.fmt_tokens(n)} and longer skipped: {ctx.left():.0f} s left in the stage, "
                         f"about {need:.0f} s needed")
            break
        t_len = time.monotonic()
        ctx.set_phase(f"{label} {report.fmt_tokens(n)}: prompt")
        p = harness.make_prompt(n, a.new_tokens, spec.config["vocab_size"], a.seed + n, kv, 0, region)
        kv_bytes = nb * spec.kv_bytes_per_block(p.block_tokens)
        try:
            with torch.inference_mode():
                # cold
                times, logits, cache = [], None, None
                for i in range(a.warmup + cold_reps):
                    ctx.set_phase(f"{label} {report.fmt_tokens(n)}: cold forward {i + 1}/{a.warmup + cold_reps}")
                    cache = None
                    dt, logits, cache = harness.cold_ttft(model, ctx.clock, p)
                    if i >= a.warmup:
                        times.append(dt)
                ctx.rec.write({"kind": "cold", "server": label, "tokens": n, "reps_s": times, "median_s": statistics.median(times),
                               "logits_finite": bool(torch.isfinite(logits.float()).all())})
                # the engine's pages: the cold forward's KV of the prefix
                kv.scatter(cache, p.src)
                conv_exact = kv.matches_cache(cache, p.src_idx, p.prefix_tokens)
                del cache
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                # the reference: the suffix forward on the never-saved pages
                ctx.set_phase(f"{label} {report.fmt_tokens(n)}: reference suffix forward")
                alone, ref_logits, det = [], None, True
                for _ in range(1 + (a.reps if measure_alone else 1)):
                    dt, lg = harness.suffix_alone(model, ctx.clock, kv, p)
                    if ref_logits is None:
                        ref_logits = lg
                    else:
                        det &= harness.bits_equal(lg, ref_logits)
                        alone.append(dt)
                ref = harness.Reference(logits, ref_logits, det)
                ctx.rec.write({"kind": "suffix_alone", "server": label, "tokens": n, "new_tokens": n - p.prefix_tokens,
                               "reps_s": alone, "median_s": statistics.median(alone) if alone else None,
                               "deterministic": det, "conversion_exact": conv_exact,
                               "argmax_vs_cold": (ref_logits[0].argmax(-1) == logits[0].argmax(-1)).float().mean().item()})
                if not conv_exact:
                    raise RuntimeError("pages -> cache conversion is not exact; hits would not be comparable")
                # save, as the connector: a query (a miss) first, then the Saves
                ctx.set_phase(f"{label} {report.fmt_tokens(n)}: save {nb} blocks ({kv_bytes / GIB:.2f} GiB)")
                r, _, _ = saver.query_until_ready(p.hashes, a.query_timeout)
                pre_hits = r.num_hit_blocks
                saver.release(r)
                ssd_base = servers.metric_sum(ssd_server.metrics(), "pegaflow_ssd_write_bytes_total") if ssd_server else 0.0
                save_s = saver.save(p.src, p.hashes, a.save_batch)
                vis_s = saver.wait_visible(p.hashes, a.query_timeout)
                ctx.rec.write({"kind": "save", "server": label, "tokens": n, "blocks": nb, "kv_bytes": kv_bytes, "save_s": save_s,
                               "visible_s": vis_s, "save_gbps": kv_bytes / save_s / 1e9, "hits_before_save": pre_hits})
                if ssd_server is not None:
                    ctx.set_phase(f"{label} {report.fmt_tokens(n)}: waiting for the SSD writes")
                    wait_ssd_written(ctx, ssd_server, ssd_base, kv_bytes, timeout=min(120.0, max(10.0, ctx.left() - 30)))
                for t in tiers_for(p):
                    measure_hits(ctx, t, p, ref, kv_bytes)
            prev = (n, time.monotonic() - t_len)
        except torch.cuda.OutOfMemoryError as e:
            ctx.rec.note(f"{label}: {report.fmt_tokens(n)} ran out of GPU memory ({str(e).splitlines()[0]}); longer lengths skipped")
            torch.cuda.empty_cache()
            break


# --------------------------------------------------------------------------------------------
# stage: ours
# --------------------------------------------------------------------------------------------


def _ports(base: int) -> dict[str, str]:
    h = "127.0.0.1"
    return {"a_grpc": f"{h}:{base}", "a_http": f"{h}:{base + 1}", "b_grpc": f"{h}:{base + 2}", "b_http": f"{h}:{base + 3}",
            "meta_grpc": f"{h}:{base + 4}", "meta_http": f"{h}:{base + 5}", "a_peer": f"{h}:{base + 6}", "b_peer": f"{h}:{base + 7}",
            "pf_grpc": f"{h}:{base + 8}", "pf_http": f"{h}:{base + 9}", "t_grpc": f"{h}:{base + 10}", "t_http": f"{h}:{base + 11}"}


def _fresh_dir(p: Path) -> Path:
    shutil.rmtree(p, ignore_errors=True)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _cpu_extra(ctx: Context, name: str) -> tuple[list[str], str | None]:
    """Our server's extra flags on a CPU dry run: the fd side channel for host memfds."""
    if ctx.device.type == "cuda":
        return [], None
    sock = str(ctx.work / f"fd-{name}.sock")
    return ["--fd-socket-path", sock], sock


def _register(ctx: Context, srv: servers.Server, kv: harness.KvPages, name: str, namespace: str, backend: str, sock: str | None) -> harness.Instance:
    from pegaflow.pegaflow import EngineRpcClient

    client = EngineRpcClient(srv.endpoint)
    inst = f"e2e-{name}-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    ok, msg = kv.register(client, inst, namespace, backend=backend, page_first=ctx.args.page_first, grpc_target=srv.grpc_addr, fd_socket=sock)
    if not ok:
        raise RuntimeError(f"registration with {srv.proc.name} failed: {msg}")
    ctx.rec.note(f"registered {inst} with {srv.proc.name} (backend {backend}) in {time.perf_counter() - t0:.2f} s")
    return harness.Instance(client, inst, kv)


def stage_ours(ctx: Context) -> None:
    a = ctx.args
    if not a.ours_bin:
        raise RuntimeError("no pegaflow-server binary (--ours-bin)")
    ports = _ports(a.port_base)
    pool = a.pool or size_arg(default_pool_bytes(a, ctx.spec))
    ssd_cap = a.ssd_capacity or pool
    max_blocks = max(prefix_blocks(a))
    promote = max(800, 2 * max_blocks + 64)
    meta = None
    if a.peer and a.metaserver_bin:
        ctx.set_phase("start the MetaServer")
        try:
            ctx.start_plain(servers.Proc("metaserver", [a.metaserver_bin, "--addr", ports["meta_grpc"], "--http-addr", ports["meta_http"]],
                                         ctx.work / "server-metaserver.log"), ports["meta_grpc"])
            meta = f"http://{ports['meta_grpc']}"
            ctx.rec.note(f"MetaServer {a.metaserver_bin} listening on {ports['meta_grpc']}")
        except RuntimeError as e:
            ctx.rec.note(f"the MetaServer did not start ({str(e).splitlines()[0]}): the peer tier is skipped")
    elif a.peer:
        ctx.rec.note("no MetaServer binary (ours or the wheel's): the peer tier is skipped")
    ssd_dir = _fresh_dir(Path(a.ssd_dir) / "ours-a") if a.ssd else None
    extra, sock_a = _cpu_extra(ctx, "a")
    srv_a = None
    # Should a part refuse to start here, fall back to fewer parts rather than lose the stage.
    attempts = [(ssd_dir, meta)] + ([(None, meta)] if ssd_dir else []) + ([(None, None)] if meta else [])
    for k, (sd, mt) in enumerate(attempts):
        cfg_a = ctx.work / "ours-a.toml"
        cfg_a.write_text(servers.ours_pipeline(pool, str(sd) if sd else None, ssd_cap, True, mt, ports["a_peer"] if mt else None,
                                               promote, a.promote_deadline_ms))
        srv_a = servers.ours(a.ours_bin, "ours-a", ports["a_grpc"], ports["a_http"], cfg_a, ctx.work, extra)
        ctx.set_phase("start our server A")
        try:
            ctx.start(srv_a)
            break
        except RuntimeError as e:
            ctx.procs.remove(srv_a.proc)
            srv_a = None
            ctx.rec.note(f"our server A did not start with SSD={bool(sd)} directory={bool(mt)}: {str(e)[-600:]}")
            if k + 1 == len(attempts):
                raise
    ssd_dir, meta = sd, mt
    srv_b, sock_b = None, None
    if meta:
        cfg_b = ctx.work / "ours-b.toml"
        cfg_b.write_text(servers.ours_pipeline(pool, None, ssd_cap, False, meta, ports["b_peer"], promote, a.promote_deadline_ms))
        extra_b, sock_b = _cpu_extra(ctx, "b")
        srv_b = servers.ours(a.ours_bin, "ours-b", ports["b_grpc"], ports["b_http"], cfg_b, ctx.work, extra_b)
        ctx.set_phase("start our server B (peer)")
        try:
            ctx.start(srv_b)
        except RuntimeError as e:
            ctx.procs.remove(srv_b.proc)
            srv_b = None
            ctx.rec.note(f"our server B did not start ({str(e)[-600:]}): the peer tier is skipped")
    model = ctx.model  # noqa: F841 - built before the pages, so the weights come first in memory
    lay = layout.PagedLayout(a.layout, 2 * (max_blocks + 1), hashing.BLOCK_TOKENS, ctx.spec.kv_heads, ctx.spec.head_dim)
    kv = harness.KvPages.allocate(lay, ctx.spec.num_layers, ctx.device)
    ns = f"e2e-{ctx.spec.name}-{uuid.uuid4().hex[:8]}"
    inst_a = _register(ctx, srv_a, kv, "ours-a", ns, "direct", sock_a)
    inst_b = _register(ctx, srv_b, kv, "ours-b", ns, "direct", sock_b) if srv_b else None
    warmed: set[int] = set()

    def peer_warm(p: harness.Prompt) -> None:
        """An untimed fetch through B until it sees the whole prefix (the directory's
        advertisement is asynchronous), then B's DRAM emptied again."""
        if p.num_tokens in warmed:
            return
        deadline = time.monotonic() + 60
        while True:
            r, _, _ = inst_b.query_until_ready(p.hashes, a.query_timeout)
            got = r.num_hit_blocks
            inst_b.release(r)
            if got >= p.prefix_blocks or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        srv_b.cleanup_memory()
        warmed.add(p.num_tokens)

    def tiers_for(p: harness.Prompt) -> list[Tier]:
        # SSD before peer: B has never held this prompt then, so A's promotion finds no other
        # holder in the directory and reads its SSD; the last SSD hit leaves the prefix in A's
        # DRAM (promoted blocks are advertised) for B to fetch.
        out = [Tier("ours", "dram", "direct", inst_a, a.reps, a.query_timeout, warmup=a.hit_warmup)]
        if ssd_dir is not None and a.ssd_reps > 0:
            out.append(Tier("ours", "ssd", "direct", inst_a, a.ssd_reps, a.slow_query_timeout, before=srv_a.cleanup_memory))
        if inst_b is not None and a.peer_reps > 0:
            out.append(Tier("ours", "peer", "direct", inst_a, a.peer_reps, a.slow_query_timeout, before=lambda: peer_warm(p),
                            after=srv_b.cleanup_memory, query_inst=inst_b))
        return out

    try:
        run_lengths(ctx, "ours", kv, inst_a, tiers_for, srv_a if ssd_dir else None, a.cold_reps, True)
    finally:
        for inst in (inst_b, inst_a):
            if inst is not None:
                inst.unregister()
        kv.close()
        ctx.stop_all()


# --------------------------------------------------------------------------------------------
# stage: pegaflow
# --------------------------------------------------------------------------------------------


def stage_pegaflow(ctx: Context) -> None:
    a = ctx.args
    if ctx.device.type != "cuda":
        raise Skip("PegaFlow's server registers GPU memory only (CUDA IPC): nothing to measure on a CPU dry run")
    ports = _ports(a.port_base)
    pool = a.pool or size_arg(default_pool_bytes(a, ctx.spec))
    ssd_cap = a.ssd_capacity or pool
    max_blocks = max(prefix_blocks(a))
    ssd_file = None
    if a.ssd:
        d = _fresh_dir(Path(a.ssd_dir) / "pegaflow")
        ssd_file = str(d / "cache.dat")
    srv = servers.pegaflow(a.python, "pegaflow", ports["pf_grpc"], ports["pf_http"], pool, ctx.work, ssd_file, ssd_cap,
                           max(800, 2 * max_blocks + 64))
    ctx.set_phase("start PegaFlow's server")
    try:
        ctx.start(srv)
    except RuntimeError as e:
        if not ssd_file:
            raise
        ctx.rec.note(f"PegaFlow's server did not start with its SSD cache ({str(e).splitlines()[0]}); retrying without it")
        ssd_file = None
        srv = servers.pegaflow(a.python, "pegaflow", ports["pf_grpc"], ports["pf_http"], pool, ctx.work, None, ssd_cap, max(800, 2 * max_blocks + 64))
        ctx.start(srv)
    model = ctx.model  # noqa: F841
    lay = layout.PagedLayout(a.layout, 2 * (max_blocks + 1), hashing.BLOCK_TOKENS, ctx.spec.kv_heads, ctx.spec.head_dim)
    kv = harness.KvPages.allocate(lay, ctx.spec.num_layers, ctx.device)
    ns = f"e2e-{ctx.spec.name}-{uuid.uuid4().hex[:8]}"
    backends = [b for b in a.pegaflow_backends if b]
    inst = _register(ctx, srv, kv, f"pf-{backends[0]}", ns, backends[0], None)
    try:
        def tiers_for(p: harness.Prompt) -> list[Tier]:
            out = [Tier("pegaflow", "dram", backends[0], inst, a.reps, a.query_timeout, warmup=a.hit_warmup)]
            if ssd_file and a.ssd_reps > 0:
                out.append(Tier("pegaflow", "ssd", backends[0], inst, a.ssd_reps, a.slow_query_timeout, before=srv.cleanup_memory))
            return out

        run_lengths(ctx, "pegaflow", kv, inst, tiers_for, srv if ssd_file else None, a.pegaflow_cold_reps, False)
        # The other backends: a registration each (one at a time), DRAM hits of the same
        # prompts; a warm-up hit first brings back what the SSD phase evicted.
        for be in backends[1:]:
            if ctx.left() < a.min_length_left_s:
                ctx.rec.note(f"pegaflow: backend {be} skipped: {ctx.left():.0f} s left in the stage")
                break
            inst.unregister()
            inst = _register(ctx, srv, kv, f"pf-{be}", ns, be, None)
            _hits_again(ctx, kv, inst, "pegaflow", be)
    finally:
        inst.unregister()
        kv.close()
        ctx.stop_all()


def _hits_again(ctx: Context, kv: harness.KvPages, inst: harness.Instance, label: str, backend: str) -> None:
    """DRAM hits of the prompts already saved (same seeds), with a fresh reference each."""
    a = ctx.args
    nbs = prefix_blocks(a)
    region = max(nbs) + 1
    for n, nb in zip(a.lengths, nbs):
        if ctx.left() < a.min_length_left_s:
            ctx.rec.note(f"{label} {backend}: {report.fmt_tokens(n)} and longer skipped: {ctx.left():.0f} s left")
            break
        p = harness.make_prompt(n, a.new_tokens, ctx.spec.config["vocab_size"], a.seed + n, kv, 0, region)
        with torch.inference_mode():
            ctx.set_phase(f"{label} {backend} {report.fmt_tokens(n)}: cold forward and reference")
            _, logits, cache = harness.cold_ttft(ctx.model, ctx.clock, p)
            kv.scatter(cache, p.src)
            del cache
            _, ref_logits = harness.suffix_alone(ctx.model, ctx.clock, kv, p)
            ref = harness.Reference(logits, ref_logits, True)
            t = Tier(label, "dram", backend, inst, a.reps, a.slow_query_timeout, warmup=max(1, a.hit_warmup))
            measure_hits(ctx, t, p, ref, nb * ctx.spec.kv_bytes_per_block(p.block_tokens))


# --------------------------------------------------------------------------------------------
# stage: trace
# --------------------------------------------------------------------------------------------


def stage_trace(ctx: Context) -> None:
    a = ctx.args
    if not a.ours_bin:
        raise RuntimeError("no pegaflow-server binary (--ours-bin)")
    path = trace.find([a.trace] if a.trace else [])
    reqs = trace.load(path, a.trace_requests)
    bt_scale = a.trace_block_tokens
    scaled = [trace.scale(r, i, bt_scale, a.trace_max_tokens) for i, r in enumerate(reqs)]
    ports = _ports(a.port_base)
    spec = ctx.spec
    block_bytes = spec.kv_bytes_per_block(hashing.BLOCK_TOKENS)
    pool_bytes = parse_size(a.trace_pool)
    ssd_dir = _fresh_dir(Path(a.ssd_dir) / "trace") if a.ssd else None
    cfg = ctx.work / "ours-trace.toml"
    cfg.write_text(servers.ours_pipeline(a.trace_pool, str(ssd_dir) if ssd_dir else None, a.trace_ssd_capacity, False, None, None,
                                         max(800, a.trace_max_tokens // hashing.BLOCK_TOKENS + 64), a.promote_deadline_ms, evict_ahead_percent=0))
    extra, sock = _cpu_extra(ctx, "t")
    srv = servers.ours(a.ours_bin, "ours-trace", ports["t_grpc"], ports["t_http"], cfg, ctx.work, extra)
    ctx.set_phase("start our server for the trace")
    ctx.start(srv)
    model = ctx.model
    max_blocks = a.trace_max_tokens // hashing.BLOCK_TOKENS + 1
    lay = layout.PagedLayout(a.layout, max_blocks + 1, hashing.BLOCK_TOKENS, spec.kv_heads, spec.head_dim)
    kv = harness.KvPages.allocate(lay, spec.num_layers, ctx.device)
    inst = _register(ctx, srv, kv, "trace", f"e2e-trace-{uuid.uuid4().hex[:8]}", "direct", sock)
    table = layout.block_table(0, max_blocks, a.seed)
    table_idx = kv.index(table)
    lru, inf = trace.LruSim(pool_bytes, block_bytes), trace.InfiniteSim()
    # Every version saved under a hash (a block evicted and computed again by a forward of
    # another shape may differ in its last bits; the server may serve either).
    fingerprints: dict[bytes, set[tuple[int, int]]] = {}
    rows = []
    clock = ctx.clock
    vocab = spec.config["vocab_size"]
    try:
        with torch.inference_mode():
            ctx.set_phase("trace: warm-up forwards")
            for n in (256, 1024, 4096):
                if n <= a.trace_max_tokens:
                    harness.forward(model, torch.zeros((1, n), dtype=torch.long, device=ctx.device), None, 1)
            for sr in scaled:
                if ctx.left() < a.min_rep_left_s:
                    ctx.rec.note(f"trace: stopped after {len(rows)} of {len(scaled)} requests: the stage's time is up")
                    break
                if len(rows) % 25 == 0:
                    ctx.set_phase(f"trace: request {len(rows) + 1}/{len(scaled)}")
                toks = trace.request_token_ids(sr, bt_scale, vocab, a.seed)
                n = len(toks)
                full = n // hashing.BLOCK_TOKENS
                q = hashing.cached_prefix_blocks(n, 1)
                hs = hashing.chained_block_hashes(toks)
                ids = torch.tensor([toks], dtype=torch.long, device=ctx.device)
                # without the server: the whole prompt
                t0 = clock.now()
                lg, cache = harness.forward(model, ids, None, 1)
                tok_without = int(lg[0, -1].argmax())
                ttft_without = clock.now() - t0
                del cache, lg
                # the LRU model and the unbounded cache, before the server sees the request
                h_lru, h_inf = lru.query(hs[:q]), inf.query(hs[:q])
                # with the server
                t0 = clock.now()
                r, polls, first = inst.query_until_ready(hs[:q], a.slow_query_timeout)
                h = r.num_hit_blocks
                cache = None
                if h > 0:
                    inst.load(r.lease, table[:h], a.load_timeout)
                    cache = kv.rebuild(model, table_idx[:h], h * hashing.BLOCK_TOKENS)
                lg, cache = harness.forward(model, ids[:, h * hashing.BLOCK_TOKENS:], cache, 1)
                tok_with = int(lg[0, -1].argmax())
                ttft_with = clock.now() - t0
                exact = True
                if h > 0:
                    got = kv.fingerprints(table_idx[:h])
                    exact = all(f in fingerprints.get(x, ()) for x, f in zip(hs[:h], got))
                # the new blocks go to the server (after the first token, as the connector saves)
                t_save = 0.0
                if full > h:
                    kv.scatter(cache, table[h:full], token_start=h * hashing.BLOCK_TOKENS)
                    for x, f in zip(hs[h:full], kv.fingerprints(table_idx[h:full])):
                        fingerprints.setdefault(x, set()).add(f)
                    t_save = inst.save(table[h:full], hs[h:full], a.save_batch)
                del cache, lg
                lru.save(hs[h_lru:full])
                inf.save(hs[h_inf:full])
                rows.append({"i": sr.index, "tokens": n, "queried": q, "hit": h, "hit_lru": h_lru, "hit_inf": h_inf, "first": first,
                             "polls": polls, "ttft_with_s": ttft_with, "ttft_without_s": ttft_without, "save_s": t_save,
                             "agree": tok_with == tok_without, "exact": exact, "truncated": sr.truncated})
    finally:
        inst.unregister()
        kv.close()
        metrics = srv.metrics()
        ctx.stop_all()
    if not rows:
        raise RuntimeError("no request of the trace ran")
    qsum = sum(x["queried"] for x in rows)
    w = [x["ttft_with_s"] for x in rows]
    wo = [x["ttft_without_s"] for x in rows]
    ctx.rec.write({
        "kind": "trace", "requests": len(rows), "requests_asked": len(scaled), "trace_block_tokens": bt_scale,
        "max_tokens": a.trace_max_tokens, "truncated": sum(x["truncated"] for x in rows), "tokens": sum(x["tokens"] for x in rows),
        "pool": a.trace_pool, "ssd": bool(ssd_dir), "block_bytes": block_bytes,
        "queried_blocks": qsum, "hit_blocks": sum(x["hit"] for x in rows),
        "hit_rate": sum(x["hit"] for x in rows) / qsum if qsum else 0.0,
        "sim_lru_hit_rate": sum(x["hit_lru"] for x in rows) / qsum if qsum else 0.0,
        "sim_infinite_hit_rate": sum(x["hit_inf"] for x in rows) / qsum if qsum else 0.0,
        "requests_matching_lru": sum(1 for x in rows if x["hit"] == x["hit_lru"]),
        "loading_answers": sum(1 for x in rows if x["first"] == "loading"),
        "with_mean_s": report.mean(w), "with_p50_s": report.percentile(w, 50), "with_p99_s": report.percentile(w, 99),
        "without_mean_s": report.mean(wo), "without_p50_s": report.percentile(wo, 50), "without_p99_s": report.percentile(wo, 99),
        "argmax_agree": sum(x["agree"] for x in rows), "byte_exact": all(x["exact"] for x in rows),
        "server_metrics": {key: servers.metric_sum(metrics, name, **lb) for key, name, lb in (
            ("evicted_blocks", "pegaflow_cache_block_evictions_total", {}),
            ("ssd_write_bytes", "pegaflow_ssd_write_bytes_total", {}),
            ("promoted_blocks", "pegaflow_tier_promotions_total", {"outcome": "promoted"}),
            ("demoted_written_blocks", "pegaflow_tier_demotions_total", {"outcome": "written"}),
            ("demoted_dropped_queue_full_blocks", "pegaflow_tier_demotions_total", {"outcome": "dropped_queue_full"}))},
        "per_request": rows,
    })


STAGES = {"ours": stage_ours, "pegaflow": stage_pegaflow, "trace": stage_trace}
