"""How long a 64 MiB device -> pinned host copy takes, whole and in the pieces our cuda
transport issues (its staging ramp of 2, 4, 8, 16, 32 and 2 MiB chunks, on one stream and on two
alternating, as the transport's two staging buffers use them), plus 8 x 8 and 32 x 2 MiB on two
streams. torch, CUDA events around all the pieces; medians of 45 after 5 warm-up runs, in µs.

    python3 dma_chunks.py
"""
import torch, statistics as st
MB = 1 << 20
src = torch.empty(64 * MB, dtype=torch.uint8, device="cuda")
dst = torch.empty(64 * MB, dtype=torch.uint8, pin_memory=True)
s = [torch.cuda.Stream(), torch.cuda.Stream()]
def run(sizes, nstreams):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s[0])
    for k in range(1, nstreams): s[k].wait_event(a)
    off = 0
    for i, z in enumerate(sizes):
        with torch.cuda.stream(s[i % nstreams]):
            dst[off:off + z * MB].copy_(src[off:off + z * MB], non_blocking=True)
        off += z * MB
    for k in range(1, nstreams):
        e = torch.cuda.Event(); e.record(s[k]); s[0].wait_event(e)
    b.record(s[0]); b.synchronize()
    return a.elapsed_time(b) * 1e3
for name, sizes, ns in [("one 64 MiB", [64], 1), ("ramp 2..32+2, 1 stream", [2, 4, 8, 16, 32, 2], 1),
                        ("ramp, 2 streams", [2, 4, 8, 16, 32, 2], 2), ("8 x 8 MiB, 2 streams", [8] * 8, 2),
                        ("32 x 2 MiB, 2 streams", [2] * 32, 2), ("one 64 MiB, again after the others", [64], 1)]:
    t = [run(sizes, ns) for _ in range(50)][5:]
    print(f"{name:45s} median {st.median(t):7.1f} us  min {min(t):7.1f}  -> {64 * MB / st.median(t) / 1e3:5.1f} GB/s")
