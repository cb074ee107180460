#!/usr/bin/env bash
# On the GPU machine, from the folder bench/gpu/prepare-gpu-run.sh fills (.gpu/): the end-to-end
# time-to-first-token run (bench/e2e/README.md). Installs the published client from the wheel
# beside it, then runs `python3 -m pfe2e.run` (extra arguments go to it, e.g. --quick,
# --lengths 1024,4096, --stages ours,trace, --budget-s 300). Results land in $OUT (the device
# tool's folder; default .gpu/e2e-out): results.jsonl, results.json, report.md, ttft.svg,
# console.log, logs-tail.txt. A run that ends abnormally (the watchdog, a crash) is resumed
# with the stages it had not finished, twice at most, within the same time budget.
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$d/e2e-out}
mkdir -p "$out"
. "$d/client-env.sh"
export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
export E2E_T0=${E2E_T0:-$(date +%s.%N)}
# Keep multicast off as this machine's notes ask (nothing here uses NCCL; harmless).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/[e2e] gpu: /'
echo "[e2e] folder $d, results in $out, python $(python3 -c 'import sys; print(sys.version.split()[0])')"
python3 -m pfe2e.run --out "$out" "$@" 2>&1 | tee "$out/console.log"
rc=${PIPESTATUS[0]}
for _ in 1 2; do
  case "$rc" in 0|2) break ;; esac
  echo "[e2e] the run ended with code $rc; resuming the stages it had not finished"
  python3 -m pfe2e.run --out "$out" --resume "$@" 2>&1 | tee -a "$out/console.log"
  rc=${PIPESTATUS[0]}
done
if [ "$rc" != 0 ]; then
  # The last run did not print the report: make it from what was recorded.
  python3 -m pfe2e.report "$out" | tee -a "$out/console.log"
fi
exit "$rc"
