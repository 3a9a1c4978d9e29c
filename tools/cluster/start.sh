#!/usr/bin/env bash
# Start a 3-node mooncaked cluster on loopback, one daemon per config in this directory:
# clients on TCP 50051-50053, peers on 50151-50153, metrics on 9781-9783, logs and Raft data
# under /tmp/mooncaked-cluster/nodeN. Stop it with `tools/cluster/stop.sh`.
#
#   bash tools/cluster/start.sh           # start (keeps the Raft logs of an earlier run)
#   bash tools/cluster/start.sh --fresh   # wipe the Raft logs first: a brand-new cluster
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="$repo/.venv/bin/python"
base=/tmp/mooncaked-cluster
if [ "${1:-}" = "--fresh" ]; then
    rm -rf "$base"
fi
for i in 1 2 3; do
    dir="$base/node$i"
    mkdir -p "$dir"
    if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
        echo "node$i already runs (pid $(cat "$dir/pid"))"
        continue
    fi
    "$python" -m mooncaked --config "$here/node$i.toml" >>"$dir/mooncaked.log" 2>&1 &
    echo $! >"$dir/pid"
    echo "node$i: pid $!, client 127.0.0.1:5005$i, log $dir/mooncaked.log"
done
# Wait for an elected leader that every node knows.
for _ in $(seq 100); do
    if "$repo/.venv/bin/mooncakectl" -a 127.0.0.1:50051 -o json cluster status 2>/dev/null \
            | "$python" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["leader"] and s["registered"] else 1)' 2>/dev/null; then
        "$repo/.venv/bin/mooncakectl" -a 127.0.0.1:50051 cluster members
        exit 0
    fi
    sleep 0.2
done
echo "no leader after 20 s; see $base/node*/mooncaked.log" >&2
exit 1
