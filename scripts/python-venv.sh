#!/usr/bin/env bash
# Creates (if missing) the repo-root virtual environment `.venv` used by the Python
# conformance suite (tests/python), and installs the published PegaFlow client plus the test
# tools into it. Idempotent: re-running only installs what is missing.
#
#   scripts/python-venv.sh          # create/update .venv
#   PYTHON=python3.12 scripts/python-venv.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

# The published client the server must stay compatible with, and the test tools (numpy: the
# end-to-end harness's layout conversion is tested over numpy arrays, tests/python/test_e2e_*;
# msgspec and pyzmq: the KV-events subscriber of tests/python/test_kv_events.py, written as
# vLLM's is).
PEGAFLOW_PKG="pegaflow-llm-cu13==0.25.1"
REQS=("$PEGAFLOW_PKG" "pytest" "grpcio" "numpy" "msgspec" "pyzmq")

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "python-venv: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Install only when something is missing (or at the wrong version), so repeated runs are fast
# and work offline once the venv exists.
if "$PY" - "${REQS[@]}" <<'PYEOF'
import sys
from importlib import metadata
want = {"pegaflow-llm-cu13": "0.25.1", "pytest": None, "grpcio": None, "numpy": None,
        "msgspec": None, "pyzmq": None}
for name, ver in want.items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if ver is not None and have != ver:
        sys.exit(1)
sys.exit(0)
PYEOF
then
    echo "python-venv: requirements already installed"
else
    echo "python-venv: installing ${REQS[*]}"
    "$PY" -m pip install --disable-pip-version-check -q --upgrade pip
    "$PY" -m pip install --disable-pip-version-check -q "${REQS[@]}"
fi

# The wheel must import without a GPU.
"$PY" - <<'PYEOF'
from pegaflow.pegaflow import EngineRpcClient, PyLoadState, QueryReady, QueryLoading  # noqa: F401
from pegaflow import PegaFlowError, PegaflowInternal  # noqa: F401
import grpc  # noqa: F401
import numpy  # noqa: F401
import msgspec  # noqa: F401
import pytest  # noqa: F401
import zmq  # noqa: F401
import pegaflow
print("python-venv: ok (pegaflow", getattr(pegaflow, "__version__", "?") + ")")
PYEOF
