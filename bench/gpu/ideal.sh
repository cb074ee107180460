#!/usr/bin/env bash
# On the GPU machine (or any machine the wheel installs on; a GPU only for TORCH=1 or DMA=1): the Save GB/s that an ideal server gives
# through the published client, measured rather than computed. For each batch (BATCHES, default
# "256 32") it starts `pegaflow-wake-probe` from this folder twice and runs ideal_save.py against it:
# with --hold-us 0 (the probe decodes each Save and answers at once: the client's floor, in the
# bench's own call pattern) and with --hold-us set to the batch's bytes at BUS_GBPS (default 55.2),
# headers LEAD_US (default 300, our server's near-end lead) early: a server whose only cost is the
# copy. With DMA=1 (needs torch and a GPU) a third run holds each Save for what one device-to-host
# copy of the batch's bytes takes on this GPU (dma_time.py): a smaller copy runs below the bus's
# large-copy rate. Prints ideal_save.py's JSON lines, then per batch the computed ceiling (bytes /
# (floor p50 + bus time)) next to the ideal servers' rep GB/s.
# The probe binary: `cargo build --release -p pegaflow-bench --bin pegaflow-wake-probe`, stripped
# into this folder (prepare-gpu-run.sh does it when the binary is there). TORCH=1 starts CUDA in
# the client's process first, as pf_bench.py's has.
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$d/out}; mkdir -p "$out"
. "$d/client-env.sh"
[ -x "$d/pegaflow-wake-probe" ] || { echo "no pegaflow-wake-probe in $d: skipping the ideal server"; exit 0; }
bus=${BUS_GBPS:-55.2}
torch=""; [ "${TORCH:-0}" = 1 ] && torch="--torch"
for b in ${BATCHES:-256 32}; do
  hold=$(python3 -c "print(round($b * (2 << 20) / ($bus * 1e3)))")
  holds="0 $hold"
  if [ "${DMA:-0}" = 1 ]; then
    dma=$(python3 "$d/dma_time.py" --mib $((b * 2)) | tee -a "$out/ideal.jsonl" | python3 -c "import json,sys; print(round(json.load(sys.stdin)['median_us']))")
    holds="$holds $dma"
  fi
  for h in $holds; do
    lead=0; [ "$h" -gt 0 ] && lead=${LEAD_US:-300}
    "${SERVER_PIN[@]}" "$d/pegaflow-wake-probe" --hold-us "$h" --lead-us "$lead" 2>/dev/null & pid=$!
    sleep 0.4
    timeout 120 python3 "$d/ideal_save.py" --hold-us "$h" --batch "$b" --reps "${REPS:-3}" --tag "ideal-b$b" $torch | tee -a "$out/ideal.jsonl"
    kill "$pid"; wait "$pid" 2>/dev/null
  done
done
python3 - "$out/ideal.jsonl" "$bus" <<'PY'
import json, sys
rows = [r for r in map(json.loads, (l for l in open(sys.argv[1]) if l.startswith("{"))) if r.get("phase") == "ideal_save"]
bus = float(sys.argv[2])
for b in sorted({r["batch"] for r in rows}, reverse=True):
    floor = [r for r in rows if r["batch"] == b and r["hold_us"] == 0]
    held = [r for r in rows if r["batch"] == b and r["hold_us"] > 0]
    if not floor or not held:
        continue
    f = floor[-1]
    ceiling = b * (2 << 20) / (f["p50_ms"] / 1e3 + b * (2 << 20) / (bus * 1e9)) / 1e9
    print(f"{b}-block Saves: floor p50 {f['p50_ms']} ms -> computed ceiling {ceiling:.1f} GB/s")
    for h in {r["hold_us"]: r for r in held}.values():
        print(f"  ideal server, hold {h['hold_us']} us: {h['rep_gbps']} GB/s, "
              f"{min(h['rep_gbps']) / ceiling:.2f}-{max(h['rep_gbps']) / ceiling:.2f} of the ceiling")
PY
