"""The published client's own cost per Save RPC: the Save that pf_bench.py sends (32 layers,
`--batch` block ids and hashes per layer) to an instance the server does not know, so the
server decodes the request and refuses it without copying anything. The time per RPC is the
client building and encoding the request, the HTTP/2 round trip and the server's decode: the
floor under every Save of that shape, on any server. Needs no GPU.

    python3 client_floor.py [--endpoint URL] [--batch 256] [--layers 32] [--rpcs 200] [--torch]

`--torch` first imports torch and starts CUDA in this process, as pf_bench.py's process has
(its threads and allocator are then there while the client works), so that the floor is
measured in the same kind of process as the bench it bounds.

Prints one JSON line: mean and p50 milliseconds per RPC, and the Save GB/s ceiling this floor
allows for 2 MiB blocks (bytes per RPC / (the p50 floor + the bytes at `--bus-gbps`)).
"""
import argparse, hashlib, json, time

from pegaflow.pegaflow import EngineRpcClient

try:
    from pegaflow import PegaFlowError
except ImportError:  # older wheels: any exception of the call
    PegaFlowError = Exception

p = argparse.ArgumentParser()
p.add_argument("--endpoint", default="http://127.0.0.1:50055")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--batch", type=int, default=256, help="blocks per Save RPC")
p.add_argument("--block-bytes", type=int, default=2 << 20, help="bytes of one block, all layers")
p.add_argument("--bus-gbps", type=float, default=55.2, help="copy bandwidth assumed for the ceiling")
p.add_argument("--rpcs", type=int, default=200)
p.add_argument("--tag", default="server")
p.add_argument("--torch", action="store_true", help="import torch and start CUDA first, as pf_bench.py does")
a = p.parse_args()
if a.torch:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()

client = EngineRpcClient(a.endpoint)
names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
inst = "client-floor-unknown-instance"
times = []
msg = ""
for r in range(a.rpcs + 10):
    ids = list(range(a.batch))
    hashes = [hashlib.sha256(f"floor-{r}-{i}".encode()).digest() for i in range(a.batch)]
    t0 = time.perf_counter()
    try:
        ok, msg = client.save(inst, 0, 0, 0, [(nm, ids, hashes) for nm in names])
    except PegaFlowError as e:  # the client raises on a non-OK status
        ok, msg = False, str(e)
    dt = time.perf_counter() - t0
    if ok:
        raise SystemExit(f"the server accepted a save for an unknown instance: {msg}")
    if "not found" not in msg:
        raise SystemExit(f"expected an unknown-instance refusal, got: {msg}")
    if r >= 10:  # warm-up
        times.append(dt)
times.sort()
mean = sum(times) / len(times)
p50 = times[len(times) // 2]
payload = a.batch * a.block_bytes
# The median, not the mean: a server that pins its pool in the background just after start
# can stall a few of the first RPCs by tens of milliseconds.
ceiling = payload / (p50 + payload / (a.bus_gbps * 1e9)) / 1e9
print(json.dumps({
    "tag": a.tag, "phase": "client_floor", "torch": a.torch, "batch": a.batch, "layers": a.layers,
    "rpcs": len(times), "mean_ms": round(mean * 1e3, 3), "p50_ms": round(p50 * 1e3, 3),
    "save_ceiling_gbps": round(ceiling, 1), "refusal": msg[:120],
}), flush=True)
