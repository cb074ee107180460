#!/usr/bin/env python3
"""The server-side copy rate of Save streams, from our server's debug log.

Reads logs written with `--log-level info,pegaflow_transport_cuda=debug` (ab.sh: SRV_LOG) and
takes the cuda copy worker's "copy batch" lines of device -> host batches of at least MIN_MIB
(default 32). Batches less than GAP_MS (default 20) apart form one stream (one bench rep). Per
log it prints: the bytes over the time the worker had a batch in flight (the union of each
batch's [at_us, at_us + total_us]: the server-side copy rate), the bytes over the streams'
whole spans, how many batches started behind the previous one (overlapped), and of the others
how many arrived after the previous batch's end (the worker had nothing queued: the client was
late) and the mean idle time between batches.
Usage: busy.py LOG... (or a directory: its ab-*.log files).
"""
import os
import re
import sys

MIN = int(os.environ.get("MIN_MIB", "32")) << 20
GAP = float(os.environ.get("GAP_MS", "20")) * 1000
KV = re.compile(r"(\w+)=([^\s]+)")


def batches(path):
    out = []
    for line in open(path, errors="replace"):
        if "copy batch" not in line:
            continue
        f = dict(KV.findall(line.split("copy batch", 1)[1]))
        if f.get("dir") != "ToHost" or "at_us" not in f or int(f.get("bytes", 0)) < MIN:
            continue
        at, total, queued = int(f["at_us"]), int(f["total_us"]), int(f["queued_us"])
        out.append((at, at + total, at - queued, int(f["bytes"]), f.get("overlapped") == "true"))
    return sorted(out)


def report(path):
    bs = batches(path)
    if not bs:
        print(f"{path}: no device->host batches with at_us")
        return
    busy = span = total = 0
    n_over = late = 0
    idle = []
    first = bs[0]
    cur_start, cur_end = first[0], first[1]
    stream_start = first[0]
    total = first[3]
    n_over += first[4]
    prev_end = first[1]
    for at, end, arrived, nbytes, over in bs[1:]:
        total += nbytes
        n_over += over
        if at - prev_end > GAP:
            busy += cur_end - cur_start
            span += prev_end - stream_start
            cur_start, cur_end, stream_start = at, end, at
        else:
            if not over:
                idle.append(max(0, at - prev_end))
                late += arrived > prev_end
            if at > cur_end:
                busy += cur_end - cur_start
                cur_start = at
            cur_end = max(cur_end, end)
        prev_end = max(prev_end, end)
    busy += cur_end - cur_start
    span += prev_end - stream_start
    mean_idle = sum(idle) / len(idle) if idle else 0.0
    print(
        f"{path}: {len(bs)} batches, {total / 2**30:.1f} GiB; busy-time rate {total / busy / 1e3:.1f} GB/s, "
        f"span rate {total / span / 1e3:.1f} GB/s; overlapped {n_over}; not overlapped {len(idle)} "
        f"(arrived after the previous end: {late}), mean gap {mean_idle:.0f} us"
    )


paths = []
for a in sys.argv[1:] or ["/tmp/ab-logs"]:
    if os.path.isdir(a):
        paths += sorted(os.path.join(a, f) for f in os.listdir(a) if f.startswith("ab-") and f.endswith(".log"))
    else:
        paths.append(a)
for p in paths:
    report(p)
