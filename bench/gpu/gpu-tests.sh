#!/usr/bin/env bash
# On the GPU machine: the opt-in GPU tests, each test binary with PEGAFLOW_GPU_TESTS=1
# --include-ignored --test-threads=1; `server_gpu` runs the server binary of this folder.
# Prints each binary's failures and its result line.
#
# The test binaries come from a build here, stripped into this folder as t-NAME:
#   cargo test --release -p pegaflow-transport-cuda -p pegaflow-tests --no-run
#   for t in gpu vmm_gpu server_gpu conformance native_v2_gpu; do
#     strip -o .gpu/t-$t $(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1); done
d=$(cd "$(dirname "$0")" && pwd)
export PEGAFLOW_GPU_TESTS=1 PEGAFLOW_SERVER_BIN=$d/pegaflow-server
rc=0
for t in gpu vmm_gpu server_gpu conformance native_v2_gpu; do
  echo "== $t"
  [ -x "$d/t-$t" ] || { echo "missing $d/t-$t (see this script's header)"; rc=1; continue; }
  timeout 300 "$d/t-$t" --include-ignored --test-threads=1 > "/tmp/gpu-test-$t.log" 2>&1 || rc=1
  grep -E "^test |test result|panicked" "/tmp/gpu-test-$t.log" | grep -vE '\.\.\. ok$'
done
exit $rc
