#!/usr/bin/env bash
# On the GPU machine: the client floor (client_floor.py, 300 refused 256-block Saves) right
# after a server start, while the cuda transport pins the 16 GiB pool in the background, and
# again once the log says "landing tier pinned"; per entry of BINS (server binaries in this
# folder, default old, new, old, new). Prints the tag, mean and p50 ms of each floor: RPCs that
# stall behind the pinning show in the mean.
d=$(cd "$(dirname "$0")" && pwd)
. "$d/client-env.sh"
for bin in ${BINS:-pegaflow-server-old pegaflow-server pegaflow-server-old pegaflow-server}; do
  "$d/$bin" --addr 127.0.0.1:50055 --http-addr 127.0.0.1:9091 --pool-size 16gb > /tmp/pf.log 2>&1 & pid=$!
  up=0; for _ in $(seq 1 120); do curl -sf 127.0.0.1:9091/health >/dev/null && { up=1; break; }; sleep 0.25; done
  [ $up = 1 ] || { echo "$bin did not start"; tail -5 /tmp/pf.log; kill $pid; wait $pid; continue; }
  echo "== $bin"
  python3 "$d/client_floor.py" --tag "$bin-pinning" --batch 256 --rpcs 300 | cut -c1-130
  grep -q "landing tier pinned" /tmp/pf.log && echo "(pinned before the first floor ended)"
  for _ in $(seq 1 240); do grep -q "landing tier pinned" /tmp/pf.log && break; sleep 0.25; done
  grep -o "landing tier pinned.*" /tmp/pf.log | cut -c1-120 | grep . || echo "warning: the pool was not pinned after 60 s; the second floor is not an after-pinning figure"
  python3 "$d/client_floor.py" --tag "$bin-pinned" --batch 256 --rpcs 300 | cut -c1-130
  kill $pid; wait $pid
done
