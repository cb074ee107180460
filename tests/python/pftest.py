"""Helpers of the published-client conformance suite.

- `Server`: runs `pegaflow-server` on free ports with an fd side channel in a temp dir.
- A minimal protobuf encoder for `RegisterContextRequest` with this project's native fields
  (>= 100), which the published client cannot send, sent with grpcio as raw bytes.
- `HostKv`: a host KV cache in a memfd (KV-first split layout), registered natively through
  the fd side channel, then driven with the PUBLISHED client (`pegaflow.pegaflow`).
- Small HTTP helpers (no proxies) for the admin endpoints.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = Path(__file__).resolve().parent / "data"

# engine.proto
NATIVE_CLIENT_VERSION = "0.25.1+native-v1"
MEMORY_KIND_HOST_MEMFD = 1
MEMORY_KIND_CUDA_VMM = 2


# --------------------------------------------------------------------------------------------
# Server process
# --------------------------------------------------------------------------------------------


def server_binary() -> Path:
    env = os.environ.get("PEGAFLOW_SERVER_BIN")
    p = Path(env) if env else REPO_ROOT / "target" / "debug" / "pegaflow-server"
    if not p.is_file() or not os.access(p, os.X_OK):
        raise RuntimeError(
            f"pegaflow-server binary not found at {p}: run `cargo build --bin pegaflow-server` "
            "or set PEGAFLOW_SERVER_BIN"
        )
    return p


def third_party_binary() -> Path:
    """The examples' third-party server (`pegaflow-server-verify`), next to pegaflow-server:
    it links the `heap-store` tier below DRAM."""
    p = server_binary().parent / "pegaflow-server-verify"
    if not p.is_file() or not os.access(p, os.X_OK):
        raise RuntimeError(
            f"pegaflow-server-verify not found at {p}: run `cargo build --workspace --all-targets`"
        )
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a request; HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with _NO_PROXY.open(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    """One `pegaflow-server` process on free ports, logging to a file in its temp dir."""

    def __init__(
        self,
        pool_size: str = "256mb",
        extra_args: list[str] | None = None,
        binary: Path | None = None,
        metrics: bool = True,
    ):
        self.binary = binary
        # `--enable-prometheus` (off by default, as in PegaFlow): most tests read /metrics.
        self.serve_metrics = metrics
        self.dir = Path(tempfile.mkdtemp(prefix="pegaflow-pytest-"))
        self.fd_socket = str(self.dir / "fd.sock")
        self.log_path = self.dir / "server.log"
        self.pool_size = pool_size
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self.grpc_port = 0
        self.http_port = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 15.0, ports: tuple[int, int] | None = None) -> "Server":
        """Starts on free ports, or on `ports` = (grpc, http) (e.g. to restart in place)."""
        last = ""
        for _attempt in range(1 if ports else 3):
            self.grpc_port, self.http_port = ports or (free_port(), free_port())
            if self.grpc_port == self.http_port:
                continue
            args = [
                str(self.binary or server_binary()),
                "--addr", f"127.0.0.1:{self.grpc_port}",
                "--http-addr", f"127.0.0.1:{self.http_port}",
                "--pool-size", self.pool_size,
                "--fd-socket-path", self.fd_socket,
                "--log-level", "info",
                *(["--enable-prometheus"] if self.serve_metrics else []),
                *self.extra_args,
            ]
            env = dict(os.environ, NO_COLOR="1", RUST_BACKTRACE="1")
            logf = open(self.log_path, "ab")
            logf.write(f"=== {' '.join(args)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env)
            logf.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    status, body = http("GET", self.url("/health"), timeout=1.0)
                    # First line `ok`: a backend (an SSD tier) may add report lines.
                    if status == 200 and body.split("\n", 1)[0] == "ok":
                        return self
                except OSError:
                    pass
                time.sleep(0.02)
            last = self.log_tail()
            self.kill()
        raise RuntimeError(f"pegaflow-server did not become healthy:\n{last}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """For the published client (needs a scheme)."""
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def grpc_target(self) -> str:
        """For grpcio."""
        return f"127.0.0.1:{self.grpc_port}"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    # -- HTTP --------------------------------------------------------------------------------

    def get(self, path: str) -> tuple[int, str]:
        return http("GET", self.url(path))

    def post(self, path: str) -> tuple[int, str]:
        return http("POST", self.url(path))

    def instances(self) -> list[str]:
        status, body = self.get("/instances")
        assert status == 200, (status, body)
        return json.loads(body)["instances"]

    def metrics(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, (status, body)
        return body

    def log_tail(self, n: int = 80) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no server log>"
        return "\n".join(lines[-n:])


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    return sum(
        v for n, l, v in parse_metrics(text)
        if n == name and all(l.get(k) == want for k, want in labels.items())
    )


# --------------------------------------------------------------------------------------------
# Minimal protobuf encoding / decoding
# --------------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32/int64: 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field_no: int, wire: int) -> bytes:
    return _varint((field_no << 3) | wire)


def f_varint(field_no: int, v: int) -> bytes:
    return b"" if v == 0 else _key(field_no, 0) + _varint(v)


def f_len(field_no: int, payload: bytes, keep_empty: bool = False) -> bytes:
    if not payload and not keep_empty:
        return b""
    return _key(field_no, 2) + _varint(len(payload)) + payload


def f_str(field_no: int, s: str) -> bytes:
    return f_len(field_no, s.encode())


def f_repeated_len(field_no: int, items: list[bytes]) -> bytes:
    # Every element is emitted, empty ones included.
    return b"".join(f_len(field_no, x, keep_empty=True) for x in items)


def f_packed(field_no: int, values: list[int]) -> bytes:
    if not values:
        return b""
    return f_len(field_no, b"".join(_varint(v) for v in values), keep_empty=True)


def encode_register(
    *,
    instance_id: str,
    namespace: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    world_size: int = 1,
    device_id: int = 0,
    layer_names: list[str],
    wrapper_bytes: list[bytes] = (),
    num_blocks: list[int],
    bytes_per_block: list[int],
    kv_stride_bytes: list[int],
    segments: list[int],
    pp_rank: int = 0,
    client_version: str = NATIVE_CLIENT_VERSION,
    transfer_mode: int = 0,
    page_first: bool = False,
    layer_group_ids: list[int] = (),
    native_kv_tensors: list[tuple[int, int, int]] = (),
    native_alloc_size: int = 0,
    memory_kind: int = 0,
) -> bytes:
    """RegisterContextRequest (engine.proto), fields in ascending order as proto3 emits them."""
    tensors = [
        f_varint(1, off) + f_varint(2, size) + f_varint(3, stride)
        for off, size, stride in native_kv_tensors
    ]
    return b"".join([
        f_str(1, instance_id),
        f_str(2, namespace),
        f_varint(3, tp_rank),
        f_varint(4, tp_size),
        f_varint(5, world_size),
        f_varint(6, device_id),
        f_repeated_len(8, [n.encode() for n in layer_names]),
        f_repeated_len(9, list(wrapper_bytes)),
        f_packed(10, list(num_blocks)),
        f_packed(11, list(bytes_per_block)),
        f_packed(12, list(kv_stride_bytes)),
        f_packed(13, list(segments)),
        f_varint(14, pp_rank),
        f_str(15, client_version),
        f_varint(17, transfer_mode),
        f_varint(18, int(page_first)),
        f_packed(19, list(layer_group_ids)),
        f_repeated_len(100, tensors),
        f_varint(101, native_alloc_size),
        f_varint(102, memory_kind),
    ])


def decode_fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """[(field, wire type, value)] of one message level (varints and length-delimited only)."""
    out = []
    i = 0

    def varint() -> int:
        nonlocal i
        shift = v = 0
        while True:
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    while i < len(buf):
        key = varint()
        fno, wire = key >> 3, key & 7
        if wire == 0:
            out.append((fno, wire, varint()))
        elif wire == 2:
            n = varint()
            out.append((fno, wire, buf[i:i + n]))
            i += n
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def decode_status_response(buf: bytes) -> tuple[bool, str] | None:
    """(ok, message) of a `{1: ResponseStatus}` response; None when status is missing."""
    status = None
    for fno, wire, v in decode_fields(buf):
        if fno == 1 and wire == 2:
            ok, msg = False, ""
            for f2, w2, v2 in decode_fields(v):
                if f2 == 1 and w2 == 0:
                    ok = v2 != 0
                elif f2 == 2 and w2 == 2:
                    msg = v2.decode()
            status = (ok, msg)
    return status


# --------------------------------------------------------------------------------------------
# grpcio raw calls and the fd side channel
# --------------------------------------------------------------------------------------------

_GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]


class RawRpcError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def raw_unary(target: str, method: str, body: bytes, timeout: float = 30.0) -> bytes:
    with grpc.insecure_channel(target, options=_GRPC_OPTIONS) as ch:
        call = ch.unary_unary(
            f"/pegaflow.Engine/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            return call(body, timeout=timeout)
        except grpc.RpcError as e:  # grpc.Call
            raise RawRpcError(e.code(), e.details() or "") from None


def raw_register(target: str, body: bytes) -> tuple[bool, str]:
    """RegisterContextBatch with a hand-encoded request; (ok, message) or RawRpcError."""
    resp = raw_unary(target, "RegisterContextBatch", body)
    st = decode_status_response(resp)
    assert st is not None, f"register response missing status: {resp.hex()}"
    return st


def send_fd(socket_path: str, instance_id: str, device_id: int, fd: int) -> None:
    """One connection, one sendmsg: payload `instance_id\\0device_id` + the fd as SCM_RIGHTS."""
    payload = instance_id.encode() + b"\0" + str(device_id).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(socket_path)
        socket.send_fds(s, [payload], [fd])


# --------------------------------------------------------------------------------------------
# Host KV cache in a memfd
# --------------------------------------------------------------------------------------------


@dataclass
class HostKv:
    """A KV-first split cache: per layer, K of every block, then V of every block.

    Segment s of block b of layer l lives at `l*layer_bytes + s*kv_stride + b*bytes_per_block`,
    so the wire layout is segments=2, kv_stride=num_blocks*bytes_per_block and the native view's
    block stride is bytes_per_block.
    """

    num_layers: int = 4
    num_blocks: int = 16
    bytes_per_block: int = 256
    layer_prefix: str = "model.layers"
    fd: int = field(init=False)
    mm: mmap.mmap = field(init=False)

    def __post_init__(self):
        self.kv_stride = self.num_blocks * self.bytes_per_block
        self.layer_bytes = 2 * self.kv_stride
        self.size = self.num_layers * self.layer_bytes
        self.fd = os.memfd_create("pegaflow-pytest-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass

    @property
    def layer_names(self) -> list[str]:
        return [f"{self.layer_prefix}.{l}.attn" for l in range(self.num_layers)]

    def seg_offset(self, layer: int, block: int, seg: int) -> int:
        assert 0 <= block < self.num_blocks and seg in (0, 1)
        return layer * self.layer_bytes + seg * self.kv_stride + block * self.bytes_per_block

    def block(self, layer: int, block: int) -> bytes:
        """K then V of one block of one layer."""
        out = b""
        for seg in (0, 1):
            o = self.seg_offset(layer, block, seg)
            out += self.mm[o:o + self.bytes_per_block]
        return out

    def write_block(self, layer: int, block: int, data: bytes) -> None:
        assert len(data) == 2 * self.bytes_per_block
        for seg in (0, 1):
            o = self.seg_offset(layer, block, seg)
            self.mm[o:o + self.bytes_per_block] = data[seg * self.bytes_per_block:(seg + 1) * self.bytes_per_block]

    def fill_block(self, layer: int, block: int, byte: int) -> None:
        self.write_block(layer, block, bytes([byte]) * (2 * self.bytes_per_block))

    def randomize(self) -> None:
        self.mm[:] = os.urandom(self.size)

    def snapshot(self) -> bytes:
        return bytes(self.mm[:])

    def register_request(self, instance_id: str, namespace: str, device_id: int = 0, **kw) -> bytes:
        n = self.num_layers
        return encode_register(
            instance_id=instance_id,
            namespace=namespace,
            device_id=device_id,
            layer_names=self.layer_names,
            num_blocks=[self.num_blocks] * n,
            bytes_per_block=[self.bytes_per_block] * n,
            kv_stride_bytes=[self.kv_stride] * n,
            segments=[2] * n,
            native_kv_tensors=[(l * self.layer_bytes, self.layer_bytes, self.bytes_per_block) for l in range(n)],
            native_alloc_size=self.size,
            memory_kind=MEMORY_KIND_HOST_MEMFD,
            **kw,
        )

    def register(self, server: Server, instance_id: str, namespace: str, device_id: int = 0, **kw) -> tuple[bool, str]:
        """Sends the memfd on the side channel, then RegisterContextBatch (native fields).
        `kw`: other RegisterContextRequest fields (tp_rank, tp_size, world_size, ...)."""
        send_fd(server.fd_socket, instance_id, device_id, self.fd)
        return raw_register(server.grpc_target, self.register_request(instance_id, namespace, device_id, **kw))


def wait_until(pred, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def wrapper_default_pickle() -> bytes:
    """A real `pickle.dumps(CudaIPCWrapper(t))` from an H200 (default caching allocator)."""
    return bytes.fromhex((DATA_DIR / "wrapper_default.pickle.hex").read_text().strip())


def wrapper_default_facts() -> dict:
    return json.loads((DATA_DIR / "wrapper_default.facts.json").read_text())
