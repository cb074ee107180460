#!/usr/bin/env bash
# The whole test suite: every Rust test of the workspace (unit, integration, end-to-end over
# real gRPC and a real Unix socket, the directory tests against a real redis-server and
# PegaFlow's own MetaServer), then the published Python client's conformance suite against
# the real server binary. GPU tests are ignored unless run with PEGAFLOW_GPU_TESTS=1 and
# `-- --include-ignored`. Ends with one line of totals over Rust and Python.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG="$(mktemp -d)"
trap 'rm -rf "$LOG"' EXIT
# The venv first: it holds the published client and PegaFlow's pegaflow-metaserver, which the
# Rust differential and conformance tests run against (they print SKIP without it).
scripts/python-venv.sh
cargo build --workspace --all-targets
cargo test --workspace 2>&1 | tee "$LOG/rust.txt"
PEGAFLOW_SERVER_BIN="$PWD/target/debug/pegaflow-server" tests/python/run.sh 2>&1 | tee "$LOG/python.txt"
# `test result: ok. P passed; F failed; I ignored; ...` per Rust test binary; pytest's last
# line `N passed, M skipped in ...`.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d %d %d\n", p, f, i }' \
    "$LOG/rust.txt" >"$LOG/rust.sum"
read -r rp rf ri <"$LOG/rust.sum"
py_line="$(grep -E '^=+ .*(passed|failed).* in [0-9.]+s' "$LOG/python.txt" | tail -1 || true)"
pp="$(grep -oE '[0-9]+ passed' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
pf="$(grep -oE '[0-9]+ failed' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
ps="$(grep -oE '[0-9]+ skipped' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
echo "totals: $((rp + pp)) passed, $((rf + pf)) failed, $((ri + ps)) skipped or ignored (Rust $rp passed, $rf failed, $ri ignored; Python $pp passed, $pf failed, $ps skipped)"
