#!/usr/bin/env bash
# Prepare a git-ignored folder .gpu/ in the project checkout for one run on the H200 GPU machine:
# the published client wheel (which also holds PegaFlow's own server), the bench, our release binary,
# and gpu-run.sh. Then run `bash .gpu/gpu-run.sh` there with `.gpu` carried along.
# Usage (from the project root): bench/gpu/prepare-gpu-run.sh [path/to/pegaflow-server]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
if ! ls .gpu/pegaflow_llm_cu13-0.25.1-cp312-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 -d .gpu pegaflow-llm-cu13==0.25.1
fi
cp "$here/pf_bench.py" "$here/client_floor.py" "$here/hold_cpu_latency.py" "$here/staging_probe.py" "$here/gpu-run.sh" "$here/staging-sweep.sh" \
  "$here/ab.sh" "$here/save-trace.sh" "$here/first-rep.sh" "$here/save_trace.py" "$here/save_trace_report.py" "$here/pool_numa.py" "$here/floor-torch.sh" "$here/pin-floor.sh" "$here/gpu-tests.sh" \
  "$here/wake.sh" "$here/wake_probe.py" "$here/client-env.sh" "$here/ideal.sh" "$here/ideal_save.py" "$here/dma_time.py" "$here/dma_chunks.py" "$here/copy-stream.sh" "$here/busy.py" .gpu/
bin=${1:-target/release/pegaflow-server}
if [ -x "$bin" ]; then strip -o .gpu/pegaflow-server "$bin" 2>/dev/null || cp "$bin" .gpu/pegaflow-server; else echo "note: no server binary at $bin; only PegaFlow will be measured" >&2; rm -f .gpu/pegaflow-server; fi
probe=target/release/pegaflow-wake-probe
[ -x "$probe" ] && strip -o .gpu/pegaflow-wake-probe "$probe"
# copy-stream.sh's transport bench, if built (cargo build --release -p pegaflow-transport-cuda --example cuda_bench).
cb=target/release/examples/cuda_bench
[ -x "$cb" ] && strip -o .gpu/cuda_bench "$cb"
du -sh .gpu
echo "ready: run 'bash .gpu/gpu-run.sh' on the GPU machine, carrying .gpu"
