#!/usr/bin/env python3
"""Where a running server's DRAM pool lies, by NUMA node: the largest mapping of the process
(the pool), one page looked up per STEP bytes with move_pages(2) (query only: nothing moves).
Usage: python3 pool_numa.py PID [STEP_MIB=256]. Prints the node of every step as one line per
GiB ("0 GiB: 0000 0000 ...", one digit per step, '-' for a page not present) and the bytes per
node. Needs root or the server's user; Linux x86-64 (syscall 279)."""
import ctypes, sys

pid = int(sys.argv[1])
step = (int(sys.argv[2]) if len(sys.argv) > 2 else 256) << 20
best = (0, 0)
for line in open(f"/proc/{pid}/maps"):
    a, b = (int(x, 16) for x in line.split()[0].split("-"))
    if b - a > best[1] - best[0]:
        best = (a, b)
start, end = best
n = (end - start) // step
pages = (ctypes.c_void_p * n)(*[start + i * step for i in range(n)])
status = (ctypes.c_int * n)()
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.syscall(279, pid, n, pages, None, status, 0)
if rc != 0:
    sys.exit(f"move_pages failed: errno {ctypes.get_errno()}")
per_gib = (1 << 30) // step
counts = {}
for g in range(0, n, per_gib):
    row = status[g:g + per_gib]
    print(f"{g * step >> 30:3d} GiB: " + "".join(str(s) if s >= 0 else "-" for s in row))
    for s in row:
        counts[s] = counts.get(s, 0) + step
print(f"pool mapping {end - start} bytes at {start:#x}; per node (negative = not present): "
      + ", ".join(f"{k}: {v >> 20} MiB" for k, v in sorted(counts.items())))
