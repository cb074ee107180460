# Sourced by this folder's GPU scripts, with `d` set to the folder: installs the published
# client from the wheel next to them into /tmp/pf-site (no network needed), puts it on
# PYTHONPATH and makes Python's output unbuffered. Exits the script when the wheel is missing.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pf-site "$d"/pegaflow_llm_cu13-*.whl >/dev/null 2>&1 || { echo "wheel install failed (is pegaflow_llm_cu13-*.whl in $d?)"; exit 1; }
export PYTHONPATH=/tmp/pf-site
