"""The time of one device-to-host copy of `--mib` MiB into pinned memory (torch, CUDA events),
median of `--reps` after 5 warm-up copies, in µs: what the copy of one Save batch takes on this
bus, whoever issues it. Prints one JSON line.

    python3 dma_time.py --mib 64 [--reps 50]
"""
import argparse, json, statistics as st
import torch

p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, required=True)
p.add_argument("--reps", type=int, default=50)
a = p.parse_args()
n = a.mib << 20
src = torch.empty(n, dtype=torch.uint8, device="cuda")
dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
t = []
for i in range(a.reps + 5):
    b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b.record()
    dst.copy_(src, non_blocking=True)
    e.record()
    e.synchronize()
    if i >= 5:
        t.append(b.elapsed_time(e) * 1e3)
us = st.median(t)
print(json.dumps({"phase": "dma_time", "mib": a.mib, "median_us": round(us, 1), "min_us": round(min(t), 1),
                  "gbps": round(n / us / 1e3, 2)}), flush=True)
