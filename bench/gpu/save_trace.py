"""Per-Save client timestamps for the pf_bench layout (32 layers, 2 MiB blocks), to line up with
the server's debug log ("save received" / "save answered" / the transport's "copy batch").

    python3 save_trace.py [--endpoint URL] [--batch 256] [--saves 40]

Registers, then sends `--saves` Saves of `--batch` blocks one after another and prints one JSON
line per Save: `build_start` (before the request list is built), `call_start`, `call_end`, in
wall-clock nanoseconds (the server's log uses the same clock). save-trace.sh runs it and
save_trace_report.py lines both up."""
import argparse, hashlib, json, pickle, sys, time, uuid
import torch
from pegaflow.pegaflow import EngineRpcClient
from pegaflow.ipc_wrapper import CudaIPCWrapper
p = argparse.ArgumentParser()
p.add_argument("--endpoint", default="http://127.0.0.1:50055")
p.add_argument("--batch", type=int, default=256)
p.add_argument("--saves", type=int, default=40)
a = p.parse_args()
L, NB = 32, 4096
kv = [torch.randn((2, NB, 16, 8, 128), dtype=torch.bfloat16, device="cuda:0") for _ in range(L)]
names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
es = kv[0].element_size(); bpb, kvs = kv[0].stride(1) * es, kv[0].stride(0) * es
c = EngineRpcClient(a.endpoint)
inst = f"tr-{uuid.uuid4().hex[:8]}"
ok, msg = c.register_context_batch(inst, "ns", 0, 0, 1, 1, 0, names, [pickle.dumps(CudaIPCWrapper(t)) for t in kv],
    [NB] * L, [bpb] * L, [kvs] * L, [2] * L, "kernel", False, layer_group_ids=[0] * L)
assert ok, msg
torch.cuda.synchronize()
rows = []
for s in range(a.saves):
    b0 = (s * a.batch) % 2048
    ids = list(range(b0, b0 + a.batch))
    hs = [hashlib.sha256(f"{inst}-{s}-{i}".encode()).digest() for i in range(a.batch)]
    t0 = time.time_ns()
    req = [(nm, ids, hs) for nm in names]
    t1 = time.time_ns()
    ok, msg = c.save(inst, 0, 0, 0, req)
    t2 = time.time_ns()
    assert ok, msg
    rows.append((t0, t1, t2))
for r in rows:
    print(json.dumps({"build_start": r[0], "call_start": r[1], "call_end": r[2]}))
