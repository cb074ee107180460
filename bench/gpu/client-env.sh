# Sourced by this folder's GPU scripts, with `d` set to the folder: installs the published
# client from the wheel next to them into /tmp/pf-site (no network needed), puts it on
# PYTHONPATH and makes Python's output unbuffered. Exits the script when the wheel is missing.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pf-site "$d"/pegaflow_llm_cu13-*.whl >/dev/null 2>&1 || { echo "wheel install failed (is pegaflow_llm_cu13-*.whl in $d?)"; exit 1; }
export PYTHONPATH=/tmp/pf-site
# IDLE_SPIN=1 (or a CPU list such as 8-15): while the script runs, a busy loop at SCHED_IDLE
# priority on every CPU (or on those listed), so that those CPUs never halt when their threads
# wait (as under a kernel booted with idle=poll): any thread that wakes preempts the loop at
# once. It tells the client's and the server's wake-up from a CPU's exit from idle in the
# figures (on the GPU machine, a KVM guest, a halted vCPU goes back to the host). A measurement
# aid, not a production setting: it keeps those cores busy. Started once per run; nested scripts
# see PF_IDLE_SPIN_PIDS and leave it alone. PIN_SERVER=CPU-LIST (gpu-run.sh, ideal.sh) runs the
# server under test on those CPUs only; run the script itself under `taskset -c` to pin the client.
if [ -n "${IDLE_SPIN:-}" ] && [ "${IDLE_SPIN}" != 0 ] && [ -z "${PF_IDLE_SPIN_PIDS:-}" ]; then
  spin_cpus=$(python3 -c 'import os, sys
a = sys.argv[1]
if a == "1":
    c = sorted(os.sched_getaffinity(0))
else:
    c = [n for part in a.split(",") for lo, _, hi in [part.partition("-")] for n in range(int(lo), int(hi or lo) + 1)]
print(" ".join(map(str, c)))' "$IDLE_SPIN")
  PF_IDLE_SPIN_PIDS=""
  for c in $spin_cpus; do
    chrt -i 0 taskset -c "$c" sh -c 'while :; do :; done' & PF_IDLE_SPIN_PIDS="$PF_IDLE_SPIN_PIDS $!"
  done
  export PF_IDLE_SPIN_PIDS
  trap 'kill $PF_IDLE_SPIN_PIDS 2>/dev/null' EXIT
  echo "idle spin: a SCHED_IDLE busy loop on CPUs $spin_cpus"
fi
SERVER_PIN=(); [ -n "${PIN_SERVER:-}" ] && SERVER_PIN=(taskset -c "$PIN_SERVER")
# The servers under test listen on 127.0.0.1:50055 (gRPC) and :9091 (HTTP).
wait_health() { for _ in $(seq 1 120); do python3 -c "from pegaflow.pegaflow import EngineRpcClient as C; import sys; sys.exit(0 if C('http://127.0.0.1:50055').health()[0] else 1)" 2>/dev/null && return 0; sleep 0.5; done; return 1; }
# port_taken: whether something already listens on 50055 or 9091 (a server left running would
# answer a bench meant for the one about to start). The scripts refuse to start then.
port_taken() { local p; for p in 50055 9091; do (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && return 0; done; return 1; }
# stop_pid PID: stops a server started in the background and every process below it (PegaFlow's
# `python3 -m pegaflow._server` serves from a child process, which outlived a kill of its parent
# and kept the port): SIGTERM to all, up to 10 s, then SIGKILL to what is left.
tree_pids() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; tree_pids "$c"; done; }
stop_pid() {
  local pids="$1 $(tree_pids "$1" | tr '\n' ' ')" p left
  kill $pids 2>/dev/null
  for _ in $(seq 1 40); do
    left=""; for p in $pids; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.25
  done
  kill -9 $left 2>/dev/null; wait "$1" 2>/dev/null
}
