"""The Save GB/s an ideal server would give through the published client: against
`pegaflow-wake-probe --hold-us H --lead-us L`, which answers every Save after exactly H µs,
send pf_bench.py's Saves (32 layers, `--batch` block ids and hashes per layer, `--blocks` per
rep, the calls back to back as pf_bench.py makes them) and print, per rep, the GB/s that
2 MiB blocks would move in that time. With H = the batch's bytes at the bus's bandwidth, that
is a server whose only cost is the copy itself; with H = 0 it is the client's floor (the
probe decodes the request and answers at once).

    python3 ideal_save.py --hold-us 1216 [--batch 32] [--blocks 2048] [--reps 3]

Prints one JSON line: the hold, the per-rep GB/s, the p50 call and the mean call (ms).
"""
import argparse, hashlib, json, statistics as st, time

from pegaflow.pegaflow import EngineRpcClient

p = argparse.ArgumentParser()
p.add_argument("--endpoint", default="http://127.0.0.1:50055")
p.add_argument("--hold-us", type=int, required=True, help="what the probe was started with")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--batch", type=int, default=256, help="blocks per Save RPC")
p.add_argument("--blocks", type=int, default=2048, help="blocks per rep")
p.add_argument("--block-bytes", type=int, default=2 << 20, help="bytes of one block, all layers")
p.add_argument("--reps", type=int, default=3)
p.add_argument("--gap-s", type=float, default=0.1, help="idle time between reps (the bench's query, Load and check)")
p.add_argument("--warmup", type=int, default=10, help="untimed Saves first (pf_bench.py registers and queries before its first rep)")
p.add_argument("--tag", default="")
p.add_argument("--torch", action="store_true", help="import torch and start CUDA first, as pf_bench.py does")
a = p.parse_args()
if a.torch:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
client = EngineRpcClient(a.endpoint)
names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
gbps, calls = [], []
ids = list(range(a.batch))
for w in range(a.warmup):
    hashes = [hashlib.sha256(f"ideal-warmup-{w}-{i}".encode()).digest() for i in range(a.batch)]
    client.save("ideal", 0, 0, 0, [(nm, ids, hashes) for nm in names])
time.sleep(a.gap_s)
for rep in range(a.reps):
    n = a.blocks
    hashes = [hashlib.sha256(f"ideal-{rep}-{i}".encode()).digest() for i in range(n)]
    ids = list(range(n))
    t0 = time.perf_counter()
    for b in range(0, n, a.batch):
        bi, bh = ids[b:b + a.batch], hashes[b:b + a.batch]
        ts = time.perf_counter()
        ok, msg = client.save("ideal", 0, 0, 0, [(nm, bi, bh) for nm in names])
        calls.append(time.perf_counter() - ts)
        if not ok:
            raise SystemExit(f"probe refused: {msg}")
    t = time.perf_counter() - t0
    gbps.append(round(n * a.block_bytes / t / 1e9, 2))
    time.sleep(a.gap_s)
print(json.dumps({"phase": "ideal_save", "tag": a.tag, "hold_us": a.hold_us, "batch": a.batch,
                  "rep_gbps": gbps, "p50_ms": round(st.median(calls) * 1e3, 3),
                  "mean_ms": round(st.mean(calls) * 1e3, 3)}), flush=True)
