#!/usr/bin/env bash
# Stop the nodes tools/cluster/start.sh started (SIGTERM by PID; the Raft logs are kept).
set -uo pipefail
for pidfile in /tmp/mooncaked-cluster/node*/pid; do
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
done
