#!/usr/bin/env bash
# On the GPU machine: an interleaved A/B of server builds or settings with the published-client
# bench, kernel backend. Each entry of BINS is BIN or BIN:CFG: the server binary BIN in this folder,
# started with `--config CFG.toml` (from this folder) when CFG is given; a leading `@` (`@BIN`)
# runs that entry while a helper holds /dev/cpu_dma_latency at 0 µs (no deep CPU idle states on
# the whole machine, client included; needs root). Each entry gets its own
# server start (16 GiB pool), then optionally the client floor (FLOOR=1), then pf_bench.py.
# Env: BINS (default "pegaflow-server-old pegaflow-server pegaflow-server-old pegaflow-server"),
# BATCH (Save RPC size, default 256), REPS (default 3), FLOOR (0), SRV_LOG (the server's --log-level: a level or filter directives such as
# "info,pegaflow_transport_cuda=debug"; default info).
# Prints one line per run (save and load GB/s per rep, byte-exactness, the server's mean Save
# phases in ms, its resident and transparent-huge-page bytes) and the medians per entry; appends the raw JSON lines to $OUT/ab.jsonl.
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
logs=/tmp/ab-logs; mkdir -p "$logs"   # per-run server logs stay on the machine
. "$d/client-env.sh"
# Our server pins its pool in the background after it serves (~6 s for 16 GiB here); a bench that
# starts before that measures copies from unpinned memory. Wait for its log line (PegaFlow's log has none).
wait_pinned() { grep -q "pegaflow-server starting" "$1" || return 0; for _ in $(seq 1 240); do grep -qE "landing tier pinned|cannot pin" "$1" && return 0; sleep 0.25; done; echo "warning: the pool was not pinned after 60 s" >&2; }
qos_pid=""
# The latency helper never outlives the script (a failed start, an interrupt, the end).
trap '[ -n "$qos_pid" ] && kill "$qos_pid" 2>/dev/null' EXIT
i=0
for entry in ${BINS:-pegaflow-server-old pegaflow-server pegaflow-server-old pegaflow-server}; do
  i=$((i+1))
  if [ -n "$qos_pid" ]; then stop_pid "$qos_pid"; qos_pid=""; fi
  if [ "${entry#@}" != "$entry" ]; then
    python3 "$d/hold_cpu_latency.py" 0 & qos_pid=$!
    sleep 0.5
    kill -0 "$qos_pid" 2>/dev/null || { echo "$entry: cannot hold /dev/cpu_dma_latency (root only); skipped"; qos_pid=""; continue; }
  fi
  spec=${entry#@}
  bin=${spec%%:*}; cfg=""; [ "$spec" != "$bin" ] && cfg="--config $d/${spec#*:}.toml"
  log="$logs/ab-$i.log"
  if port_taken; then echo "$entry: port 50055 or 9091 already taken (a server left running?); skipped"; continue; fi
  "$d/$bin" $cfg --log-level "${SRV_LOG:-info}" --addr 127.0.0.1:50055 --http-addr 127.0.0.1:9091 --pool-size 16gb --enable-prometheus > "$log" 2>&1 & pid=$!
  wait_health || { echo "$entry did not start"; tail -5 "$log"; stop_pid $pid; continue; }
  wait_pinned "$log"
  [ "${FLOOR:-0}" = 1 ] && python3 "$d/client_floor.py" --tag "$entry" --batch ${BATCH:-256} --rpcs 300 | tee -a "$out/ab.jsonl" | cut -c1-140
  timeout 200 python3 "$d/pf_bench.py" --tag "$entry#$i" --backend kernel --batch ${BATCH:-256} --reps ${REPS:-3} >> "$out/ab.jsonl" 2>&1
  curl -s 127.0.0.1:9091/metrics | grep -E '^pegaflow_rpc_phase_seconds_(sum|count)\{.*rpc="save"' > "$log.metrics"
  # Which pages back the server's memory (the pinned pool is most of it): huge or base.
  echo "$entry#$i: server memory $(grep -E '^(Rss|AnonHugePages):' /proc/$pid/smaps_rollup 2>/dev/null | tr -s ' ' | tr '\n' ' ')"
  python3 - "$out/ab.jsonl" "$entry#$i" "$log.metrics" <<'PY'
import json, re, sys, collections
tag = sys.argv[2]; save, load, exact = [], [], True
for l in open(sys.argv[1]):
    try: r = json.loads(l)
    except Exception: continue
    if r.get("tag") != tag: continue
    if r.get("phase") == "save": save.append(round(r["rpc_gbps"], 1))
    if r.get("phase") == "load": load.append(round(r["load_gbps"], 1)); exact &= bool(r.get("byte_exact"))
ph = collections.defaultdict(dict)
for l in open(sys.argv[3]):
    m = re.match(r'pegaflow_rpc_phase_seconds_(sum|count)\{(.*)\} (\S+)', l)
    if m: ph[dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))["phase"]][m.group(1)] = float(m.group(3))
phases = {p: round(v["sum"] / max(v["count"], 1) * 1e3, 3) for p, v in ph.items() if "sum" in v}
print(f"{tag}: save {save} load {load} byte-exact {exact} save phases ms {phases}")
PY
  stop_pid $pid
  if [ -n "$qos_pid" ]; then stop_pid "$qos_pid"; qos_pid=""; fi
done
python3 - "$out/ab.jsonl" <<'PY'
import json, sys, collections, statistics
by = collections.defaultdict(lambda: ([], []))
for l in open(sys.argv[1]):
    try: r = json.loads(l)
    except Exception: continue
    t = r.get("tag", "").split("#")[0]
    if r.get("phase") == "save": by[t][0].append(r["rpc_gbps"])
    if r.get("phase") == "load": by[t][1].append(r["load_gbps"])
for t, (s, l) in by.items():
    if s: print(f"median {t}: save {statistics.median(s):.1f} (n={len(s)}), load {statistics.median(l):.1f}")
PY
