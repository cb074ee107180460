#!/usr/bin/env bash
# The whole test suite: every Rust test of the workspace (unit, integration, end-to-end over
# real gRPC and a real Unix socket, the directory tests against a real redis-server and
# PegaFlow's own MetaServer), then the published Python client's conformance suite against
# the real server binary. GPU tests are ignored unless run with PEGAFLOW_GPU_TESTS=1 and
# `-- --include-ignored`. Ends with the tests skipped at run time (a tool or binary missing
# here), then one line of totals over Rust and Python.
#
# A Rust test that cannot run here reports itself with `pegaflow_test_skip::skip!`, which
# writes `SKIPPED: crate::test: reason` past cargo's capture; cargo counts it as passed, so
# this script subtracts those from cargo's passed count and reports them as skipped.
# `SKIPPED PART:` lines (a test that ran but left a part out) are listed and counted apart.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG="$(mktemp -d)"
trap 'rm -rf "$LOG"' EXIT
# The venv first: it holds the published client and PegaFlow's pegaflow-metaserver, which the
# Rust differential and conformance tests run against (they report themselves skipped without
# it).
scripts/python-venv.sh
cargo build --workspace --all-targets
cargo test --workspace 2>&1 | tee "$LOG/rust.txt"
PEGAFLOW_SERVER_BIN="$PWD/target/debug/pegaflow-server" tests/python/run.sh -rs 2>&1 | tee "$LOG/python.txt"
# `test result: ok. P passed; F failed; I ignored; ...` per Rust test binary; pytest's last
# line `N passed, M skipped in ...`.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d %d %d\n", p, f, i }' \
    "$LOG/rust.txt" >"$LOG/rust.sum"
read -r rp rf ri <"$LOG/rust.sum"
# The skip lines may land in the middle of a line of cargo's own output: match anywhere.
grep -oE 'SKIPPED: .*' "$LOG/rust.txt" >"$LOG/skipped.txt" || true
grep -oE 'SKIPPED PART: .*' "$LOG/rust.txt" >"$LOG/parts.txt" || true
rs="$(wc -l <"$LOG/skipped.txt")"
rparts="$(wc -l <"$LOG/parts.txt")"
py_line="$(grep -E '^=+ .*(passed|failed).* in [0-9.]+s' "$LOG/python.txt" | tail -1 || true)"
pp="$(grep -oE '[0-9]+ passed' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
pf="$(grep -oE '[0-9]+ failed' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
ps="$(grep -oE '[0-9]+ skipped' <<<"$py_line" | grep -oE '[0-9]+' || echo 0)"
echo
echo "skipped at run time (Rust $rs, Python $ps; parts of tests that ran: $rparts):"
sed 's/^/  /' "$LOG/skipped.txt" "$LOG/parts.txt"
grep -E '^SKIPPED \[' "$LOG/python.txt" | sed 's/^/  python: /' || true
rpass=$((rp - rs))
echo "totals: $((rpass + pp)) passed, $((rf + pf)) failed, $((rs + ps)) skipped, $ri ignored (Rust $rpass passed, $rf failed, $rs skipped at run time, $ri ignored, $rparts passed with a part skipped; Python $pp passed, $pf failed, $ps skipped)"
