"""The processes a run starts (our `pegaflow-server`, `pegaflow-metaserver`, PegaFlow's
server from the wheel) and what the harness asks of them over HTTP: health, Prometheus
metrics, `POST /cache/memory/cleanup`.

Every process is started in its own session and stopped through its process group (PegaFlow's
`python3 -m pegaflow._server` serves from a child process, which outlives a kill of its
parent), SIGTERM first and SIGKILL after a timeout; only processes started here are ever
signalled. Never imports torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on `host:port`."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def split_addr(addr: str) -> tuple[str, int]:
    """`host:port` (or `http://host:port`) as a pair."""
    a = addr.split("://", 1)[-1].rstrip("/")
    host, _, port = a.rpartition(":")
    return host.strip("[]"), int(port)


def http(method: str, url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of one HTTP request; status 0 with the error text when nothing answered."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(v for n, ls, v in parse_metrics(text) if n == name and all(ls.get(k) == w for k, w in labels.items()))


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> object:
    """Polls `pred` until it returns a true value or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


@dataclass
class Proc:
    """A process started in its own session, its output in `log_path`."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen | None = field(default=None, init=False)
    started_at: float = field(default=0.0, init=False)

    def start(self) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM to the process group, then SIGKILL after `timeout` s; the exit code."""
        if self.popen is None:
            return None
        pgid = self.popen.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; children of the group may still be alive.
            if not _group_alive(pgid):
                break
        return self.popen.poll()

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_has(self, pattern: str) -> bool:
        try:
            return re.search(pattern, self.log_path.read_text(errors="replace")) is not None
        except OSError:
            return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class Server:
    """A KV-cache server the harness drives: its process, gRPC endpoint and HTTP base URL."""

    proc: Proc
    grpc_addr: str
    http_addr: str
    kind: str  # "ours" or "pegaflow"

    @property
    def endpoint(self) -> str:
        return f"http://{self.grpc_addr}"

    @property
    def http_base(self) -> str:
        return f"http://{self.http_addr}"

    def metrics(self) -> str:
        st, body = http("GET", self.http_base + "/metrics")
        return body if st == 200 else ""

    def health(self) -> tuple[int, str]:
        return http("GET", self.http_base + "/health")

    def cleanup_memory(self) -> dict:
        """`POST /cache/memory/cleanup`: every block leaves the DRAM index (lower tiers keep
        theirs). Raises `RuntimeError` on a non-200 answer."""
        st, body = http("POST", self.http_base + "/cache/memory/cleanup", timeout=60)
        if st != 200:
            raise RuntimeError(f"{self.proc.name}: /cache/memory/cleanup answered {st}: {body[:200]}")
        try:
            return json.loads(body)
        except ValueError:
            return {"raw": body[:200]}


def grpc_healthy(endpoint: str) -> bool:
    """Whether the Engine service at `endpoint` answers Health ok (through the published client)."""
    try:
        from pegaflow.pegaflow import EngineRpcClient

        return bool(EngineRpcClient(endpoint).health()[0])
    except Exception:
        return False


def start_and_wait(srv: Server, timeout: float, pinned_timeout: float = 60.0) -> float:
    """Starts `srv`, waits until its gRPC Health answers and (ours) until its log says the
    landing tier is pinned or cannot be; returns the seconds to serving.

    Raises `RuntimeError` with the log's tail when a port is taken, the process exits or
    `timeout` passes.
    """
    for addr in (srv.grpc_addr, srv.http_addr):
        h, p = split_addr(addr)
        if port_open(h, p):
            raise RuntimeError(f"{srv.proc.name}: {addr} is already taken (a server left running?)")
    srv.proc.start()
    t0 = srv.proc.started_at
    ok = wait_until(lambda: (not srv.proc.alive()) or grpc_healthy(srv.endpoint), timeout, 0.25)
    if not srv.proc.alive() or not ok:
        srv.proc.stop()
        raise RuntimeError(f"{srv.proc.name} did not serve within {timeout:.0f} s:\n{srv.proc.log_tail()}")
    serving_s = time.monotonic() - t0
    if srv.kind == "ours" and srv.proc.log_has("pegaflow-server starting"):
        wait_until(lambda: srv.proc.log_has(r"landing tier pinned|cannot pin|CUDA driver not available"), pinned_timeout, 0.25)
    return serving_s


def start_plain(proc: Proc, addr: str, timeout: float) -> float:
    """Starts `proc` and waits until `addr` accepts connections; the seconds it took.

    Raises `RuntimeError` with the log's tail when the port is taken beforehand, the process
    exits or `timeout` passes."""
    h, p = split_addr(addr)
    if port_open(h, p):
        raise RuntimeError(f"{proc.name}: {addr} is already taken")
    proc.start()
    ok = wait_until(lambda: (not proc.alive()) or port_open(h, p), timeout, 0.1)
    if not proc.alive() or not ok:
        proc.stop()
        raise RuntimeError(f"{proc.name} did not listen on {addr} within {timeout:.0f} s:\n{proc.log_tail()}")
    return time.monotonic() - proc.started_at


def ours_pipeline(
    pool: str,
    ssd_dir: str | None = None,
    ssd_capacity: str = "16gb",
    write_through: bool = True,
    metaserver: str | None = None,
    peer_data_addr: str | None = None,
    max_promote_blocks: int = 800,
    promote_deadline_ms: int = 5000,
    evict_ahead_percent: int | None = None,
) -> str:
    """The pipeline file (TOML) of one of our servers: a DRAM tier of `pool`; an SSD tier in
    `ssd_dir` (write-through: every sealed block is written at once and stays in DRAM, so a
    DRAM cleanup leaves an SSD copy to promote); a MetaServer directory and the TCP peer
    path. Promotions may take `max_promote_blocks` blocks and `promote_deadline_ms`; a peer
    fetch as long and as large as a prompt's whole prefix (defaults cap one at 3 s and 4 GiB).
    """
    out = ["[store]", f"max_promote_blocks = {max_promote_blocks}", f"promote_deadline_ms = {promote_deadline_ms}"]
    if evict_ahead_percent is not None:
        out.append(f"evict_ahead_percent = {evict_ahead_percent}")
    out.append("")
    if metaserver:
        out += ["[directory]", 'kind = "metaserver"', f'addr = "{metaserver}"', ""]
        if peer_data_addr:
            out += ["[peer]", 'kind = "tcp"', f'data_addr = "{peer_data_addr}"', f"fetch_timeout_ms = {promote_deadline_ms}", "max_fetch_bytes = 68719476736", ""]
    out += ["[[tier]]", 'kind = "dram"', f'capacity = "{pool}"', ""]
    if ssd_dir:
        out += ["[[tier]]", 'kind = "ssd"', f'paths = ["{ssd_dir}"]', f'capacity = "{ssd_capacity}"']
        if write_through:
            out.append("write_through = true")
        out.append("")
    return "\n".join(out)


def ours(binary: str, name: str, grpc_addr: str, http_addr: str, config_path: Path, log_dir: Path, extra: Sequence[str] = ()) -> Server:
    """Our server with the pipeline at `config_path`, Prometheus on."""
    argv = [binary, "--config", str(config_path), "--addr", grpc_addr, "--http-addr", http_addr, "--enable-prometheus", *extra]
    return Server(Proc(name, argv, log_dir / f"server-{name}.log"), grpc_addr, http_addr, "ours")


def pegaflow(python: str, name: str, grpc_addr: str, http_addr: str, pool: str, log_dir: Path, ssd_file: str | None = None,
             ssd_capacity: str = "16gb", max_prefetch_blocks: int = 800, extra: Sequence[str] = ()) -> Server:
    """PegaFlow's own server from the wheel (`python3 -m pegaflow._server`), Prometheus on; its
    SSD cache in the single file `ssd_file` (a directory makes it panic)."""
    argv = [python, "-m", "pegaflow._server", "--addr", grpc_addr, "--http-addr", http_addr, "--pool-size", pool,
            "--enable-prometheus", "--max-prefetch-blocks", str(max_prefetch_blocks)]
    if ssd_file:
        argv += ["--ssd-cache-path", ssd_file, "--ssd-cache-capacity", ssd_capacity]
    argv += list(extra)
    return Server(Proc(name, argv, log_dir / f"server-{name}.log"), grpc_addr, http_addr, "pegaflow")


def find_wheel_binary(name: str) -> str | None:
    """A binary shipped inside the installed `pegaflow` package (e.g. `pegaflow-metaserver-py`)."""
    try:
        import pegaflow

        p = Path(pegaflow.__file__).parent / name
        return str(p) if p.is_file() and os.access(p, os.X_OK) else None
    except ImportError:
        return None
