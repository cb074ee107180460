"""The entry point of a run: `python3 -m pfe2e.run --out DIR [options]` (bench/e2e/README.md).

It writes every measurement as one JSON line to `DIR/results.jsonl` the moment it is made
(and a readable line to stdout), runs the stages in order within a time budget, keeps going
when a stage fails, and after each stage rewrites `report.md`, `ttft.svg` and `results.json`
from what is there. A watchdog thread ends a stage stuck past its time by stopping that
stage's servers and exiting (code 3); `--resume` then runs the stages that have no end record
yet (what `e2e-run.sh` does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pfe2e import models, report  # noqa: E402

STAGE_NAMES = ("ours", "pegaflow", "trace")


class Recorder:
    """Appends records to `results.jsonl` (flushed per line) and prints a readable line each."""

    def __init__(self, path: Path, t0: float):
        self.path = path
        self.t0 = t0
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, rec: dict) -> None:
        rec = dict(rec)
        rec.setdefault("t_s", round(time.time() - self.t0, 3))
        line = json.dumps(rec, default=str)
        with self.lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        print(f"[e2e] {summary(rec)}", flush=True)

    def note(self, text: str) -> None:
        self.write({"kind": "note", "text": text})

    def records(self) -> list[dict]:
        return report.read_records(self.path)


def summary(r: dict) -> str:
    """One readable line for a record."""
    k = r.get("kind")
    if k == "cold":
        return f"cold {report.fmt_tokens(r['tokens'])} ({r.get('server')}): {report.fmt_ms(r.get('median_s'))} ms median of {len(r.get('reps_s', []))}"
    if k == "suffix_alone":
        return (f"suffix forward alone {report.fmt_tokens(r['tokens'])} ({r.get('new_tokens')} tokens): {report.fmt_ms(r.get('median_s'), 2)} ms; "
                f"deterministic {r.get('deterministic')}; conversion exact {r.get('conversion_exact')}; argmax vs cold {r.get('argmax_vs_cold', 0):.2f}")
    if k == "save":
        return f"save {report.fmt_tokens(r['tokens'])} ({r.get('server')}): {r['blocks']} blocks in {r['save_s'] * 1000:.0f} ms ({r['save_gbps']:.1f} GB/s), visible after {r['visible_s'] * 1000:.0f} ms"
    if k == "hit":
        head = f"{r.get('server')} {r.get('tier')} hit ({r.get('backend')}) {report.fmt_tokens(r.get('tokens', 0))}: "
        if r.get("status") != "ok":
            return head + f"{r.get('status')}: {r.get('why', '')}"
        reps = r.get("reps", [])
        ph = {p: report.median([x[p] for x in reps]) for p in ("query_s", "load_s", "rebuild_s", "suffix_s")}
        return (head + f"{report.fmt_ms(r['median_ttft_s'], 2)} ms (query {report.fmt_ms(ph['query_s'], 2)}, load {report.fmt_ms(ph['load_s'], 2)}, "
                f"rebuild {report.fmt_ms(ph['rebuild_s'], 2)}, suffix {report.fmt_ms(ph['suffix_s'], 2)}); bytes exact {r.get('byte_exact')}, "
                f"logits exact {r.get('logit_exact')}, argmax vs cold {r.get('argmax_vs_cold', 0):.2f}, first answer {','.join(r.get('first_answers', []))}")
    if k == "trace":
        return (f"trace: {r['requests']} requests, hit rate {r['hit_rate']:.1%} (LRU sim {r['sim_lru_hit_rate']:.1%}, unbounded {r['sim_infinite_hit_rate']:.1%}); "
                f"TTFT mean {report.fmt_ms(r['with_mean_s'])} ms with / {report.fmt_ms(r['without_mean_s'])} ms without, "
                f"p99 {report.fmt_ms(r['with_p99_s'])} / {report.fmt_ms(r['without_p99_s'])} ms")
    if k == "stage":
        return f"stage {r.get('stage')}: {r.get('status')}" + (f" — {r.get('why')}" if r.get("why") else "")
    if k == "stage_start":
        return f"stage {r.get('stage')} starts ({r.get('budget_s')} s at most)"
    if k == "note":
        return f"note: {r.get('text')}"
    if k == "env":
        return f"env: {r.get('gpu')} driver {r.get('driver')}, torch {r.get('torch')}, transformers {r.get('transformers')}"
    return json.dumps(r, default=str)[:200]


def parse_args(argv=None) -> argparse.Namespace:
    class Fmt(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="python3 -m pfe2e.run", description=__doc__, formatter_class=Fmt)
    a = p.add_argument
    a("--out", default=os.environ.get("OUT") or "e2e-out", help="results folder: $OUT when set, else ./e2e-out")
    a("--work", default="/tmp/pfe2e-work", help="server logs and pipeline files")
    a("--stages", default=",".join(STAGE_NAMES), help="comma-separated, in order: ours, pegaflow, trace")
    a("--resume", action="store_true", help="skip the stages that already have an end (or start) record in --out")
    a("--quick", action="store_true", help="a small run: 1K and 4K, one rep each, 20 trace requests")
    a("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run against our server, host-memfd pages)")
    a("--model", default="llama-3.1-8b", help=f"one of {', '.join(models.MODELS)}")
    a("--layout", default="kv-first", choices=["kv-first", "blocks-first"], help="vLLM's page layout")
    a("--page-first", action="store_true", help="register with page_first (the server stores a block's layers together)")
    a("--lengths", default="1024,4096,16384,32768", help="context lengths in tokens")
    a("--new-tokens", type=int, default=16, help="tokens a hit still computes (at least; the prefix is whole blocks)")
    a("--seed", type=int, default=0, help="weights, prompts and block tables")
    a("--warmup", type=int, default=1, help="untimed cold forwards per length")
    a("--cold-reps", type=int, default=3, help="timed cold forwards per length")
    a("--pegaflow-cold-reps", type=int, default=1, help="cold forwards in the PegaFlow stage (the same work as ours')")
    a("--reps", type=int, default=3, help="timed DRAM hits per length and server (and suffix-alone reps)")
    a("--hit-warmup", type=int, default=1, help="untimed DRAM hits before the timed ones")
    a("--ssd-reps", type=int, default=2, help="timed SSD hits per length and server (DRAM emptied before each)")
    a("--peer-reps", type=int, default=2, help="timed peer hits per length (server B's DRAM emptied before each)")
    a("--no-ssd", dest="ssd", action="store_false", help="no SSD tier anywhere")
    a("--no-peer", dest="peer", action="store_false", help="no second server, no MetaServer")
    a("--save-batch", type=int, default=512, help="blocks per Save RPC")
    a("--pool", default=None, help="DRAM pool of each server; none: every length's prefix + 25 %% + 1 GiB")
    a("--ssd-capacity", default=None, help="SSD tier capacity; none: the pool's")
    a("--ssd-dir", default="/tmp/pfe2e-ssd", help="where the SSD tiers live (emptied first)")
    a("--ours-bin", default=None, help="pegaflow-server; none: the one beside this package, else target/release, target/debug")
    a("--metaserver-bin", default=None, help="a MetaServer; none: our pegaflow-metaserver beside this package, else the wheel's")
    a("--python", default=sys.executable, help="the Python that runs PegaFlow's server (needs torch)")
    a("--pegaflow-backends", default="direct,kernel", help="PegaFlow's copy backends to measure; the first saves and does the SSD hits")
    a("--port-base", type=int, default=50100, help="12 loopback ports from here")
    a("--query-timeout", type=float, default=30.0, help="seconds a DRAM query may stay Loading")
    a("--slow-query-timeout", type=float, default=120.0, help="SSD and peer hits")
    a("--load-timeout", type=float, default=60.0, help="seconds a Load may take")
    a("--promote-deadline-ms", type=int, default=60000, help="our servers' promotion and peer fetch deadline")
    a("--server-start-timeout", type=float, default=120.0, help="seconds a server may take to serve")
    a("--budget-s", type=float, default=420.0, help="the whole run, from $E2E_T0 (set by e2e-run.sh) or this start")
    a("--stage-budget", default="ours=180,pegaflow=120,trace=90", help="seconds per stage at most")
    a("--min-length-left-s", type=float, default=20.0, help="a context length starts only with this much of its stage left")
    a("--min-rep-left-s", type=float, default=4.0, help="a rep (or trace request) starts only with this much left")
    a("--watchdog-grace-s", type=float, default=45.0, help="past a stage's time by this much, the watchdog ends the run")
    a("--trace", default=None, help="the Mooncake trace; none: $E2E_TRACE, beside this package, else bench/data")
    a("--trace-requests", type=int, default=250, help="the first N requests")
    a("--trace-block-tokens", type=int, default=64, help="tokens per 512-token trace block (scale)")
    a("--trace-max-tokens", type=int, default=16384, help="longer prompts keep their first whole blocks")
    a("--trace-pool", default="8gb", help="the trace server's DRAM tier")
    a("--trace-ssd-capacity", default="24gb", help="the trace server's SSD tier (0 with --no-ssd)")
    a("--bus-probe-mib", type=int, default=1024, help="size of the pinned copy that measures the bus")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.cold_reps, args.reps, args.ssd_reps, args.peer_reps = "1024,4096", 1, 1, 1, 1
        args.trace_requests = min(args.trace_requests, 20)
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    for s in args.stages:
        if s not in STAGE_NAMES:
            p.error(f"unknown stage {s!r}; stages: {', '.join(STAGE_NAMES)}")
    args.pegaflow_backends = [b.strip() for b in args.pegaflow_backends.split(",") if b.strip()]
    if not args.pegaflow_backends or any(b not in ("direct", "kernel") for b in args.pegaflow_backends):
        p.error("--pegaflow-backends takes direct and/or kernel")
    args.stage_budget = {k: float(v) for k, _, v in (x.partition("=") for x in args.stage_budget.split(",") if x)}
    if any(n < args.new_tokens + 16 for n in args.lengths):
        p.error(f"every length must hold at least one block plus --new-tokens ({args.new_tokens + 16})")
    args.ours_bin = args.ours_bin or _find_bin(["pegaflow-server"])
    args.metaserver_bin = args.metaserver_bin or _find_bin(["pegaflow-metaserver"]) or _wheel_metaserver()
    return args


def _find_bin(names: list[str]) -> str | None:
    root = HERE.parent
    for d in (root, root.parent.parent / "target" / "release", root.parent.parent / "target" / "debug"):
        for n in names:
            c = d / n
            if c.is_file() and os.access(c, os.X_OK):
                return str(c)
    return None


def _wheel_metaserver() -> str | None:
    from pfe2e import servers

    return servers.find_wheel_binary("pegaflow-metaserver-py")


def env_record(args, device) -> dict:
    import torch

    rec = {"kind": "env", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__, "model": args.model,
           "layout": args.layout, "page_first": args.page_first, "new_tokens": args.new_tokens, "lengths": args.lengths,
           "ours_bin": args.ours_bin, "metaserver_bin": args.metaserver_bin, "cpus": os.cpu_count()}
    try:
        import transformers

        rec["transformers"] = transformers.__version__
    except ImportError:
        rec["transformers"] = None
    try:
        import pegaflow

        rec["pegaflow_client"] = getattr(pegaflow, "__version__", "?")
    except ImportError:
        pass
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
        rec["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            rec["driver"] = q.stdout.strip().splitlines()[0] if q.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            rec["driver"] = None
        rec.update(bus_probe(device, args.bus_probe_mib))
    else:
        rec["gpu"] = "none (CPU dry run)"
    rec["ssd_medium"] = medium(args.ssd_dir)
    return rec


def bus_probe(device, mib: int, reps: int = 5) -> dict:
    """Pinned host <-> device copy rates of one `mib` MiB copy (median of `reps`), bytes/s."""
    import torch

    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = n / sorted(times[1:])[len(times[1:]) // 2]
    out["bus_probe_mib"] = mib
    del host, dev
    torch.cuda.empty_cache()
    return out


def medium(path: str) -> str:
    """The filesystem and device under `path` (its nearest existing parent), from /proc/mounts."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    best = ("", "?", "?")
    try:
        real = str(p.resolve())
        for line in open("/proc/mounts", encoding="utf-8"):
            dev, mnt, fs = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fs)
    except OSError:
        pass
    return f"{path} on {best[1]} ({best[2]}, mounted at {best[0] or '?'})"


class Watchdog(threading.Thread):
    """Ends the run when the current stage is past its time by the grace (a call that never
    returns): stops the stage's servers, writes the stage's end, rewrites the report, exits 3."""

    def __init__(self, ctx, out: Path, grace: float):
        super().__init__(daemon=True)
        self.ctx, self.out, self.grace = ctx, out, grace
        self.stage: str | None = None
        self.fired = threading.Event()

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            st = self.stage
            if st is None or time.monotonic() < self.ctx.deadline + self.grace:
                continue
            self.fired.set()
            self.ctx.rec.write({"kind": "stage", "stage": st, "status": "failed",
                                "why": f"watchdog: still in '{self.ctx.phase}' {self.grace:.0f} s past the stage's time"})
            try:
                self.ctx.stop_all()
                finish(self.out, self.ctx.rec, self.ctx.work)
            finally:
                os._exit(3)


def finish(out: Path, rec: Recorder, work: Path | None = None) -> str:
    md = report.write_all(out, rec.records())
    if work is not None:
        tails = []
        for log in sorted(work.glob("server-*.log")):
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            tails.append(f"===== {log.name} (last 80 of {len(lines)} lines)\n" + "\n".join(lines[-80:]))
        (out / "logs-tail.txt").write_text("\n\n".join(tails) + "\n", encoding="utf-8")
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = float(os.environ.get("E2E_T0") or time.time())
    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out / "results.jsonl", t0)
    mono_end = time.monotonic() + args.budget_s - (time.time() - t0)
    ended = {r.get("stage") for r in rec.records() if r.get("kind") == "stage"} if args.resume else set()
    if args.resume:
        started = {r.get("stage") for r in rec.records() if r.get("kind") == "stage_start"}
        for s in started - ended:
            rec.write({"kind": "stage", "stage": s, "status": "failed", "why": "the process running it ended without a word (killed?)"})
            ended.add(s)
    elif (out / "results.jsonl").exists():
        (out / "results.jsonl").unlink()

    import torch

    from pfe2e import stages

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[e2e] no CUDA device: use --device cpu for a dry run", file=sys.stderr)
        return 2
    spec = models.get(args.model)
    ctx = stages.Context(args, rec, device, spec, work)
    if not any(r.get("kind") == "env" for r in rec.records()):
        rec.write(env_record(args, device))
    dog = Watchdog(ctx, out, args.watchdog_grace_s)
    dog.start()
    todo = [s for s in args.stages if s not in ended]
    for i, name in enumerate(todo):
        now = time.monotonic()
        reserve = 45.0 * (len(todo) - i - 1)
        budget = min(args.stage_budget.get(name, 120.0), mono_end - now - reserve)
        if budget < 30:
            rec.write({"kind": "stage", "stage": name, "status": "skipped", "why": f"{mono_end - now:.0f} s left of the run's budget"})
            continue
        ctx.deadline = now + budget
        rec.write({"kind": "stage_start", "stage": name, "budget_s": round(budget, 1)})
        dog.stage = name
        status, why = "done", None
        try:
            stages.STAGES[name](ctx)
        except stages.Skip as e:
            status, why = "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - one stage's failure must not lose the others
            status, why = "failed", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if not dog.fired.is_set():
                dog.stage = None
                ctx.stop_all()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if dog.fired.is_set():
            while True:  # the watchdog has written the stage's end and ends the process
                time.sleep(1)
        rec.write({"kind": "stage", "stage": name, "status": status, "why": why, "elapsed_s": time.monotonic() - now})
        finish(out, rec, work)
    md = finish(out, rec, work)
    print("\n" + md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
