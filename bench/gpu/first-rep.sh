#!/usr/bin/env bash
# On the GPU machine: why the first rep of every pf_bench.py run saves slowest. One server start
# (BIN, default pegaflow-server; 16 GiB pool; the Save handler's debug line on), then three bench
# processes against it, BACKEND (default kernel), BATCH blocks per Save (default 256):
#   A: plain;  B: right after A (a new process and instance, the same server);
#   C: PF_WARM_BUS=256 (a 256 MiB device -> pinned host copy by the client before each rep).
# Prints per run and rep the Save GB/s, each Save call's ms and the server's handler ms for it,
# then the transport's first D2H batches (its debug line: queue wait, enqueue and total µs).
# Env: RUNS (default "A B C"), WAIT_AFTER_PIN (seconds between the pool's pinning and the first
# bench, default 0), BACKEND, BATCH, REPS.
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
. "$d/client-env.sh"
log=/tmp/first-rep.log
"$d/${BIN:-pegaflow-server}" --log-level "info,pegaflow_runtime::service=debug,pegaflow_transport_cuda=debug" --addr 127.0.0.1:50055 --http-addr 127.0.0.1:9091 --pool-size 16gb > "$log" 2>&1 & pid=$!
for _ in $(seq 1 120); do curl -sf 127.0.0.1:9091/health >/dev/null && break; sleep 0.5; done
for _ in $(seq 1 240); do grep -qE "landing tier pinned|cannot pin" "$log" && break; sleep 0.25; done
sleep ${WAIT_AFTER_PIN:-0}
nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.width.current,clocks.sm,pstate --format=csv,noheader | sed 's/^/idle: /'
rm -f "$out/first-rep.jsonl"
for run in ${RUNS:-A B C}; do
  env=""; [ $run = C ] && env="PF_WARM_BUS=256"
  env PF_SAVE_TIMES=1 $env timeout 200 python3 "$d/pf_bench.py" --tag "$run" --backend ${BACKEND:-kernel} --batch ${BATCH:-256} --reps ${REPS:-3} >> "$out/first-rep.jsonl" 2>&1
done
kill $pid; wait $pid
echo "the transport's first D2H batches:"
sed 's/\x1b\[[0-9;]*m//g' "$log" | grep "copy batch" | grep ToHost | head -${FIRST:-10} | grep -oE "(path|bytes|queued_us|enqueue_us|total_us)=[A-Za-z0-9]*" | paste -sd' ' | sed 's/ path=/\npath=/g'
grep "save answered" "$log" | sed 's/\x1b\[[0-9;]*m//g' | grep -o "handler_us=[0-9]*" | cut -d= -f2 > "$out/first-rep.handler.txt"
python3 - "$out/first-rep.jsonl" "$out/first-rep.handler.txt" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
handler = [int(x) / 1e3 for x in open(sys.argv[2])]
# The server answers the bench's Saves in order; each rep's query_until and Loads send no Save.
k = 0
for r in rows:
    if r.get("phase") == "save_calls":
        calls = r["s"]; hs = handler[k:k + len(calls)]; k += len(calls)
        gb = next((x["rpc_gbps"] for x in rows if x.get("phase") == "save" and x["tag"] == r["tag"] and x["rep"] == r["rep"]), 0)
        print(f"{r['tag']} rep {r['rep']}: {gb:5.1f} GB/s  calls ms {' '.join(f'{c*1e3:.2f}' for c in calls[:10])}")
        print(f"{'':10s}      handler ms {' '.join(f'{h:.2f}' for h in hs[:10])}")
    if r.get("phase") == "load":
        print(f"{r['tag']} rep {r['rep']}: load {r.get('load_gbps', 0):.1f} GB/s exact={r.get('byte_exact')}")
PY
