#!/usr/bin/env bash
# The whole test suite: every Rust test of the workspace (unit, integration, end-to-end over
# real gRPC and a real Unix socket, the directory tests against a real redis-server and
# PegaFlow's own MetaServer), then the published Python client's conformance suite against
# the real server binary. GPU tests skip unless PEGAFLOW_GPU_TESTS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
# The venv first: it holds the published client and PegaFlow's pegaflow-metaserver, which the
# Rust differential and conformance tests run against (they print SKIP without it).
scripts/python-venv.sh
cargo build --workspace --all-targets
cargo test --workspace
PEGAFLOW_SERVER_BIN="$PWD/target/debug/pegaflow-server" tests/python/run.sh
