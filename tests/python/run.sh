#!/usr/bin/env bash
# Runs the published-client conformance suite (tests/python) with the repo's .venv.
#
#   scripts/python-venv.sh                  # once: creates .venv with pegaflow-llm-cu13==0.25.1
#   cargo build --bin pegaflow-server       # the suite builds nothing
#   tests/python/run.sh [pytest args...]    # e.g. -k session, -m "not slow", -x
#
# PEGAFLOW_SERVER_BIN overrides the server binary (default target/debug/pegaflow-server).
# The exit code is pytest's.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"

if [[ ! -x "$PY" ]]; then
    echo "run.sh: no virtual environment at ${VENV:-$ROOT/.venv}; run scripts/python-venv.sh first" >&2
    exit 2
fi
BIN="${PEGAFLOW_SERVER_BIN:-$ROOT/target/debug/pegaflow-server}"
if [[ ! -x "$BIN" ]]; then
    echo "run.sh: no server binary at $BIN; run 'cargo build --bin pegaflow-server' (or set PEGAFLOW_SERVER_BIN)" >&2
    exit 2
fi
export PEGAFLOW_SERVER_BIN="$BIN"
export PYTHONDONTWRITEBYTECODE=1

cd "$HERE"
set +e
"$PY" -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
exit $rc
