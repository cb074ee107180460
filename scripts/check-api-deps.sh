#!/usr/bin/env bash
# The client SDK links no server: pegaflow-api, built alone (default features, then all
# features), must resolve no tonic server side ("server", "router", "transport", "default"),
# no axum, no hyper / hyper-util server and no pegaflow-proto "server". Exits 1 naming what
# pulled one in; `cargo tree -p pegaflow-api -e normal,features -i <crate>` shows the path.
set -euo pipefail
cd "$(dirname "$0")/.."
forbidden='^(tonic feature "(server|router|transport|default)"|axum |hyper feature "server"|hyper-util feature "server|pegaflow-proto feature "server")'
status=0
for features in "" "--all-features"; do
  # shellcheck disable=SC2086 # $features is one flag or none
  tree=$(cargo tree -p pegaflow-api $features -e normal,features --prefix none)
  if found=$(grep -E "$forbidden" <<<"$tree" | sort -u) && [ -n "$found" ]; then
    echo "pegaflow-api ${features:-(default features)} pulls server code:" >&2
    echo "$found" >&2
    status=1
  fi
done
if [ "$status" -eq 0 ]; then
  echo "pegaflow-api: no tonic, axum or hyper server in its dependencies"
fi
exit "$status"
