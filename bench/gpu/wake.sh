#!/usr/bin/env bash
# On the GPU machine: the published client's wake-up after a held Save, per response-header lead.
# For each hold (HOLDS, µs, default "10000 1300": a 256- and a 32-block Save's copy) and lead (LEADS,
# µs, default "0 50 100 200 300 500"), twice: starts `pegaflow-wake-probe --hold-us H --lead-us L`
# from this folder and runs wake_probe.py against it (RPCS calls, default 300). Prints one JSON line
# per run: the p10/p50/p90 of (the client's call - H) in µs.
# The probe binary: `cargo build --release -p pegaflow-bench --bin pegaflow-wake-probe`, stripped
# into this folder (prepare-gpu-run.sh does it when the binary is there).
set -u
d=$(cd "$(dirname "$0")" && pwd)
. "$d/client-env.sh"
for hold in ${HOLDS:-10000 1300}; do
  for rep in 1 2; do
    for lead in ${LEADS:-0 50 100 200 300 500}; do
      "$d/pegaflow-wake-probe" --hold-us "$hold" --lead-us "$lead" 2>/dev/null & pid=$!
      sleep 0.4
      python3 "$d/wake_probe.py" --hold-us "$hold" --rpcs "${RPCS:-300}" --tag "lead$lead"
      kill "$pid"; wait "$pid" 2>/dev/null
    done
  done
done
