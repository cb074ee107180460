#!/usr/bin/env bash
# On the GPU machine: our server under several cuda-transport staging configurations, each
# measured through the published client (pf_bench.py), with the server's per-phase means
# (pegaflow_rpc_phase_seconds) and the transport's own time per copy batch (its debug log).
# Run from a folder holding pegaflow-server, the wheel, pf_bench.py and staging_probe.py (what
# prepare-gpu-run.sh puts in .gpu/). Env: CONFIGS ("CHUNK:BUFFERS ...", default "64mb:2"),
# BATCHES (default "256 32"), BACKENDS (default kernel), REPS (default 3), PROBE=0 skips the
# torch bus probe, LOGS (the server's --log-level).
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
. "$d/client-env.sh"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
if [ "${PROBE:-1}" = 1 ]; then echo "=== bus (torch staging probe)"; timeout 120 python3 "$d/staging_probe.py" 2>&1 | tail -1; fi
for cfg in ${CONFIGS:-64mb:2}; do
  chunk=${cfg%%:*}; nbuf=${cfg##*:}
  cat > /tmp/p.toml <<T
[server]
addr = "127.0.0.1:50055"
http_addr = "127.0.0.1:9091"
enable_prometheus = true
[[tier]]
kind = "dram"
capacity = "16gb"
[[transport]]
kind = "cuda"
staging_chunk = "$chunk"
staging_buffers = $nbuf
[[transport]]
kind = "memcpy"
T
  for b in ${BATCHES:-256 32}; do
    for backend in ${BACKENDS:-kernel}; do
    tag="c$chunk-$nbuf-b$b-$backend"
    if port_taken; then echo "$tag: port 50055 or 9091 already taken (a server left running?); skipped"; continue; fi
    "$d/pegaflow-server" --config /tmp/p.toml --log-level "${LOGS:-info,pegaflow_transport_cuda=debug}" > "$out/server-$tag.log" 2>&1 & pid=$!
    wait_health || { echo "no health"; tail -5 "$out/server-$tag.log"; }
    echo "=== $tag"
    timeout 200 python3 "$d/pf_bench.py" --tag "$tag" --backend $backend --batch $b --reps ${REPS:-3} 2>&1 | tee -a "$out/bench.jsonl" | grep -E '"phase": "(save|load|query_latency)"' | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l); print(' ', r.get('phase'), r.get('rep', ''), r.get('rpc_gbps', r.get('load_gbps', (r.get('p50_us'), r.get('p99_us')))), r.get('byte_exact', ''))"
    python3 - <<'PY'
import re, urllib.request
t = urllib.request.urlopen("http://127.0.0.1:9091/metrics").read().decode()
vals = {}
for l in t.splitlines():
    m = re.match(r'(pegaflow_rpc_(?:phase|duration)_seconds)_(sum|count)\{([^}]*)\} (\S+)', l)
    if m: vals.setdefault((m[1], m[3]), {})[m[2]] = float(m[4])
for (name, labels), v in sorted(vals.items()):
    if v.get("count") and ("save" in labels.lower() or "load" in labels.lower()):
        print(f"  {name}{{{labels}}} mean {v['sum'] / v['count'] * 1e3:.3f} ms over {int(v['count'])}")
PY
    stop_pid $pid
    python3 - "$out/server-$tag.log" <<'PY'
import re, sys, collections
agg = collections.defaultdict(list)
for l in open(sys.argv[1], errors="replace"):
    if "copy batch" not in l: continue
    kv = dict(re.findall(r"(\w+)=([^\s]+)", l))
    try: b, tot, enq = int(kv["bytes"]), int(kv["total_us"]), int(kv["enqueue_us"])
    except Exception: continue
    if b < (32 << 20): continue
    agg[(kv.get("dir"), b)].append((tot, enq))
for (d, b), v in sorted(agg.items()):
    tot = sorted(t for t, _ in v)[len(v)//2]; enq = sorted(e for _, e in v)[len(v)//2]
    print(f"  transport {d} {b>>20} MiB: n={len(v)} median total {tot} us ({b/tot/1e3:.1f} GB/s), enqueue {enq} us")
PY
    done
  done
done
