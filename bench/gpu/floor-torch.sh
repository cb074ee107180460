#!/usr/bin/env bash
# On the GPU machine: the client floor (client_floor.py) with and without torch and CUDA started
# in the client's process, alternating, at 256- and 32-block Saves, against one server start
# (BIN, default pegaflow-server in this folder).
d=$(cd "$(dirname "$0")" && pwd)
. "$d/client-env.sh"
"$d/${BIN:-pegaflow-server}" --addr 127.0.0.1:50055 --http-addr 127.0.0.1:9091 --pool-size 16gb > /tmp/ft.log 2>&1 & pid=$!
# Measured once the pool is pinned (the log says so), so that no floor waits on the pinning.
for _ in $(seq 1 240); do grep -q "landing tier pinned" /tmp/ft.log && break; sleep 0.25; done
grep -q "landing tier pinned" /tmp/ft.log || { echo "the server did not pin its pool within 60 s"; tail -5 /tmp/ft.log; kill $pid; exit 1; }
for b in 256 32; do for t in "" --torch "" --torch; do
  python3 "$d/client_floor.py" --batch $b --rpcs 300 $t | cut -c1-200
done; done
kill $pid; wait $pid
