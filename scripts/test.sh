#!/usr/bin/env bash
# The whole test suite: every Rust test of the workspace (unit, integration, end-to-end over
# real gRPC and a real Unix socket), then the published Python client's conformance suite
# against the real server binary. GPU tests skip unless PEGAFLOW_GPU_TESTS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
cargo test --workspace
if [ -x tests/python/run.sh ]; then
  scripts/python-venv.sh
  PEGAFLOW_SERVER_BIN="$PWD/target/debug/pegaflow-server" tests/python/run.sh
fi
