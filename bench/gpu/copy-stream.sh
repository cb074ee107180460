#!/usr/bin/env bash
# On the GPU machine: the server-side copy of a Save stream against the bus, in one process per
# setting (`cuda_bench` of this folder, built here with
#   cargo build --release -p pegaflow-transport-cuda --example cuda_bench
# and stripped into this folder by prepare-gpu-run.sh).
#
# `bus`: the same 4 GiB as one large copy per layer (128 MiB each, contiguous both sides).
# `staged`: the transport's kernel path, Llama-8B layout, scattered GPU blocks, in Save batches of
# BATCH blocks (2 MiB each); `--inflight 1` awaits each batch before the next, `--inflight 2`
# keeps the next batch queued (a Save stream whose Saves are answered before their copy ends),
# `--overlap` starts it behind the previous one. Prints one JSON line per run.
# Env: REPS (default 5), BATCHES (default "32 256").
set -u
d=$(cd "$(dirname "$0")" && pwd)
b=$d/cuda_bench
[ -x "$b" ] || { echo "missing $b (see this script's header)"; exit 1; }
reps=${REPS:-5}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
"$b" --paths bus --reps "$reps" --staging-mb 64
for batch in ${BATCHES:-32 256}; do
  "$b" --paths staged --batch "$batch" --reps "$reps" --staging-mb 64 --inflight 1 | tail -1
  "$b" --paths staged --batch "$batch" --reps "$reps" --staging-mb 64 --inflight 2 | tail -1
  "$b" --paths staged --batch "$batch" --reps "$reps" --staging-mb 64 --inflight 2 --overlap | tail -1
done
"$b" --paths bus --reps "$reps" --staging-mb 64 | tail -1
