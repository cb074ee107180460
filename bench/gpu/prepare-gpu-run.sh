#!/usr/bin/env bash
# Prepare a git-ignored folder .gpu/ in the project checkout for one run on the H200 GPU machine:
# the published client wheel (which also holds PegaFlow's own server), the bench, our release binary,
# and gpu-run.sh. Then run `bash .gpu/gpu-run.sh` there with `.gpu` carried along. The same folder
# holds the end-to-end TTFT harness (bench/e2e: `bash .gpu/e2e-run.sh`), with our release
# pegaflow-metaserver when built and the Mooncake trace.
# Usage (from the project root): bench/gpu/prepare-gpu-run.sh [path/to/pegaflow-server]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")" && echo '/.gpu/' >> "$exclude"; }
mkdir -p .gpu
if ! ls .gpu/pegaflow_llm_cu13-0.25.1-cp312-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 -d .gpu pegaflow-llm-cu13==0.25.1
fi
cp "$here/pf_bench.py" "$here/client_floor.py" "$here/hold_cpu_latency.py" "$here/staging_probe.py" "$here/gpu-run.sh" "$here/staging-sweep.sh" \
  "$here/ab.sh" "$here/save-trace.sh" "$here/first-rep.sh" "$here/save_trace.py" "$here/save_trace_report.py" "$here/pool_numa.py" "$here/floor-torch.sh" "$here/pin-floor.sh" "$here/gpu-tests.sh" \
  "$here/wake.sh" "$here/wake_probe.py" "$here/client-env.sh" "$here/ideal.sh" "$here/ideal_save.py" "$here/dma_time.py" "$here/dma_chunks.py" "$here/copy-stream.sh" "$here/busy.py" .gpu/
# The end-to-end harness (bench/e2e/README.md): its package, its entry, the trace it replays.
rm -rf .gpu/pfe2e
mkdir -p .gpu/pfe2e
cp "$root"/bench/e2e/pfe2e/*.py .gpu/pfe2e/
cp "$root/bench/e2e/e2e-run.sh" .gpu/
cp "$root/bench/data/mooncake_conversation_trace.jsonl" .gpu/
bin=${1:-target/release/pegaflow-server}
if [ -x "$bin" ]; then strip -o .gpu/pegaflow-server "$bin" 2>/dev/null || cp "$bin" .gpu/pegaflow-server; else echo "note: no server binary at $bin; only PegaFlow will be measured" >&2; rm -f .gpu/pegaflow-server; fi
meta=target/release/pegaflow-metaserver
if [ -x "$meta" ]; then strip -o .gpu/pegaflow-metaserver "$meta" 2>/dev/null || cp "$meta" .gpu/pegaflow-metaserver
else echo "note: no $meta; e2e-run.sh's peer tier will use the wheel's MetaServer" >&2; rm -f .gpu/pegaflow-metaserver; fi
probe=target/release/pegaflow-wake-probe
[ -x "$probe" ] && strip -o .gpu/pegaflow-wake-probe "$probe"
# copy-stream.sh's transport bench, if built (cargo build --release -p pegaflow-transport-cuda --example cuda_bench).
cb=target/release/examples/cuda_bench
[ -x "$cb" ] && strip -o .gpu/cuda_bench "$cb"
du -sh .gpu
echo "ready: run 'bash .gpu/gpu-run.sh' (copy rates) or 'bash .gpu/e2e-run.sh' (end-to-end TTFT) on the GPU machine, carrying .gpu"
