"""The published client's wake-up after a held Save: against `pegaflow-wake-probe --hold-us H
[--lead-us L]`, which answers every Save after H µs (headers L µs early), time each call and
print the p50 and p90 of (call - H) in µs: what the client adds after a wait of that length.

    python3 wake_probe.py --hold-us 10000 [--endpoint URL] [--rpcs 300] [--gap-us 1500]

`--gap-us` spins that long between calls (the client's own work between Saves in the bench).
"""
import argparse, json, time

from pegaflow.pegaflow import EngineRpcClient

p = argparse.ArgumentParser()
p.add_argument("--endpoint", default="http://127.0.0.1:50055")
p.add_argument("--hold-us", type=int, required=True)
p.add_argument("--rpcs", type=int, default=300)
p.add_argument("--gap-us", type=int, default=1500)
p.add_argument("--tag", default="")
a = p.parse_args()
client = EngineRpcClient(a.endpoint)
extra = []
for r in range(a.rpcs + 10):
    t0 = time.perf_counter()
    ok, msg = client.save("probe", 0, 0, 0, [("layer", [1], [bytes(32)])])
    dt = time.perf_counter() - t0
    if not ok:
        raise SystemExit(f"probe refused: {msg}")
    if r >= 10:
        extra.append(dt * 1e6 - a.hold_us)
    g = time.perf_counter() + a.gap_us / 1e6
    while time.perf_counter() < g:
        pass
extra.sort()
q = lambda f: round(extra[int(len(extra) * f)], 1)
print(json.dumps({"tag": a.tag, "hold_us": a.hold_us, "rpcs": len(extra), "p10_us": q(0.1),
                  "p50_us": q(0.5), "p90_us": q(0.9)}), flush=True)
