#!/usr/bin/env bash
# Start a 3-node mooncaked cluster on loopback, one daemon per config in this directory:
# clients on TCP 50051-50053, peers on 50151-50153, metrics on 9781-9783, logs and Raft data
# under /tmp/mooncaked-cluster/nodeN. Stop it with `tools/cluster/stop.sh`.
#
#   bash tools/cluster/start.sh           # start (keeps the Raft logs of an earlier run)
#   bash tools/cluster/start.sh --fresh   # wipe the Raft logs first: a brand-new cluster
#
# Node 1 uses the quick-start daemon's ports (50051, 9781): stop that daemon first. The script
# checks every port before it starts anything and refuses at once if one is taken. If a node
# exits or no leader is elected within 30 s, it stops the nodes it started (by PID) and exits 1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="$repo/.venv/bin/python"
base=/tmp/mooncaked-cluster
leader_wait_s=30

running() { [ -f "$base/node$1/pid" ] && kill -0 "$(cat "$base/node$1/pid")" 2>/dev/null; }

# The nodes to start: those not already running from an earlier start.sh.
to_start=()
for i in 1 2 3; do
    if running "$i"; then
        echo "node$i already runs (pid $(cat "$base/node$i/pid"))"
    else
        to_start+=("$i")
    fi
done
if [ "${1:-}" = "--fresh" ]; then
    if [ "${#to_start[@]}" -lt 3 ]; then
        echo "start.sh: --fresh with nodes running: stop them first (tools/cluster/stop.sh)" >&2
        exit 1
    fi
    rm -rf "$base"
fi

# Every port of every node to start must be free: a node that cannot bind exits, and the
# others would wait for a leader that never comes. Bound as the daemon binds (SO_REUSEADDR).
if [ "${#to_start[@]}" -gt 0 ]; then
    "$python" - "$here" "${to_start[@]}" <<'PY'
import socket, sys
from mooncaked import config
here, nodes = sys.argv[1], sys.argv[2:]
taken = []
for i in nodes:
    c = config.load(f"{here}/node{i}.toml")
    for what, host, port in (("client", c.server.tcp_host, c.server.tcp_port),
                             ("peer", c.cluster.peer_host, c.cluster.peer_port),
                             ("metrics", c.metrics.host, c.metrics.port)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                taken.append(f"  {host}:{port} (node{i}'s {what} port): {exc.strerror}")
if taken:
    print("start.sh: ports in use, nothing started:\n" + "\n".join(taken) + "\n"
          "A daemon started from the README's first command (mooncaked --config "
          "mooncaked.toml) holds 50051 and 9781: stop it (kill -TERM PID), or see who holds "
          "a port with `ss -ltnp 'sport = :PORT'`.", file=sys.stderr)
    sys.exit(1)
PY
fi

started=()  # "i:pid" of the nodes this run started
stop_started() {
    for entry in "${started[@]}"; do
        i="${entry%%:*}" pid="${entry#*:}"
        if kill -TERM "$pid" 2>/dev/null; then
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
            echo "stopped node$i (pid $pid)" >&2
        fi
        wait "$pid" 2>/dev/null || true
        rm -f "$base/node$i/pid"
    done
}
fail() {
    echo "start.sh: $1" >&2
    stop_started
    exit 1
}
trap 'fail "interrupted"' INT TERM

for i in "${to_start[@]}"; do
    dir="$base/node$i"
    mkdir -p "$dir"
    "$python" -m mooncaked --config "$here/node$i.toml" >>"$dir/mooncaked.log" 2>&1 &
    echo $! >"$dir/pid"
    started+=("$i:$!")
    echo "node$i: pid $!, client 127.0.0.1:5005$i, log $dir/mooncaked.log"
done

# Wait for an elected leader and all three nodes up; give up at once if a node exits.
deadline=$((SECONDS + leader_wait_s))
while [ "$SECONDS" -lt "$deadline" ]; do
    for entry in "${started[@]}"; do
        i="${entry%%:*}" pid="${entry#*:}"
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 5 "$base/node$i/mooncaked.log" >&2 || true
            fail "node$i (pid $pid) exited during start-up; its log: $base/node$i/mooncaked.log"
        fi
    done
    if "$repo/.venv/bin/mooncakectl" -a 127.0.0.1:50051 -o json cluster status 2>/dev/null \
            | "$python" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["leader"] and s["registered"] and sum(n["up"] for n in s["nodes"]) == 3 else 1)' 2>/dev/null; then
        "$repo/.venv/bin/mooncakectl" -a 127.0.0.1:50051 cluster members
        exit 0
    fi
    sleep 0.2
done
fail "no leader after $leader_wait_s s; see $base/node*/mooncaked.log"
