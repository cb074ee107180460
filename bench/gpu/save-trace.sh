#!/usr/bin/env bash
# On the GPU machine: where one Save's time goes, client and server side. For each entry of BINS
# (BIN or BIN:CFG as in ab.sh) it starts the server with the Save path's debug lines on, runs
# save_trace.py (40 Saves of BATCH blocks, default 256) and prints save_trace_report.py's table.
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
. "$d/client-env.sh"
for entry in ${BINS:-pegaflow-server}; do
  bin=${entry%%:*}; cfg=""; [ "$entry" != "$bin" ] && cfg="--config $d/${entry#*:}.toml"
  tag=${entry//:/-}
  "$d/$bin" $cfg --log-level "info,pegaflow_runtime::service=debug,pegaflow_runtime::engine::save=debug,pegaflow_transport_cuda=debug" --addr 127.0.0.1:50055 --http-addr 127.0.0.1:9091 --pool-size 16gb > "/tmp/trace-$tag.log" 2>&1 & pid=$!
  for _ in $(seq 1 120); do curl -sf 127.0.0.1:9091/health >/dev/null && break; sleep 0.5; done
  sleep 7  # let the pool finish pinning
  timeout 100 python3 "$d/save_trace.py" --batch ${BATCH:-256} > "$out/trace-$tag.client.jsonl"
  kill $pid; wait $pid
  grep -E "save received|save started|save copy starting|save answered|copy batch.*ToHost" "/tmp/trace-$tag.log" > "$out/trace-$tag.server.txt"
  echo "=== $entry"
  python3 "$d/save_trace_report.py" "$out/trace-$tag.server.txt" "$out/trace-$tag.client.jsonl"
done
