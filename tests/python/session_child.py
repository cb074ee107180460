"""A scheduler-like child process for the session tests.

Usage: session_child.py ENDPOINT GRPC_TARGET FD_SOCKET INSTANCE_ID NAMESPACE

Opens a Session with the published client, registers a host memfd KV cache natively on the
same instance id, prints READY and sleeps until it is killed.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pftest  # noqa: E402
from pegaflow.pegaflow import EngineRpcClient  # noqa: E402


def main() -> None:
    endpoint, grpc_target, fd_socket, instance_id, namespace = sys.argv[1:6]
    client = EngineRpcClient(endpoint)
    client.start_session_watcher(instance_id, namespace, 1, 1)

    class _S:  # the parts of pftest.Server that HostKv.register needs
        pass

    srv = _S()
    srv.fd_socket = fd_socket
    srv.grpc_target = grpc_target
    kv = pftest.HostKv(num_layers=1, num_blocks=4)
    ok, msg = kv.register(srv, instance_id, namespace)
    if not ok:
        print(f"REGISTER FAILED {msg}", flush=True)
        sys.exit(3)
    print("READY", flush=True)
    while True:
        time.sleep(3600)
        client.health()  # keep `client` (and its session stream) alive


if __name__ == "__main__":
    main()
