"""Worker roles of the cluster section (cluster.py), dispatched by workers.py:

    cross_writer  puts `sizes` objects for the cross-node get: mooncaked through node B with
                  the replica on node A's segment (preferred_segments), or Mooncake's client A
                  into its own segment; times each put; READY, then waits for DONE (Mooncake's
                  A must stay alive: the bytes live in its segment) and exits without removing
                  anything
    cross_reader  gets every object once, one op in flight, timed: mooncaked through a node
                  that does not hold the replica (over its Unix socket, a local client maps the
                  node's get staging area; over TCP the bytes pass the client socket), or
                  Mooncake's client B (no segment of its
                  own: every byte comes over Mooncake's TCP transport from A)
    put_loop      puts 4 KiB values in a loop through one node until STOP, recording the
                  start/end time and outcome of every put; EVENT t marks a kill or a leader
                  transfer; the summary is computed against it (first successful put, gap)
    cluster_ctl   a long-lived control connection to every node: waits for a settled
                  cluster, watches for a new leader, asks for a leader transfer

mooncaked roles run under the project's Python, Mooncake's under the bench venv; this module
imports only the standard library at load time. Times compared across processes are
time.monotonic() (CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from common import check_value, emit, latency_summary, pattern, stamped, wait_line

pc = time.perf_counter_ns


def _mooncaked(address: str, timeout_s: float = 30.0):
    from mooncaked.client.blocking import BlockingClient
    return BlockingClient.connect(address, namespace="bench", timeout_s=timeout_s)


def _keys(tag: str, size: int, n: int) -> list[str]:
    return [f"{tag}-x{size}-{i}" for i in range(n)]


# -- cross-node get ------------------------------------------------------------------------------

def role_cross_writer(a: dict) -> None:
    tag, system = a["tag"], a["system"]
    out = {"put": {}, "placement": {}}
    if system == "mooncaked":
        from mooncaked.client.calls import ReplicateConfig
        client = _mooncaked(a["address"])
        config = ReplicateConfig(preferred_segments=[a["segment"]])
        put = lambda key, value: client.put(key, value, config) is True  # noqa: E731
        holder = _mooncaked(a["holder_address"])
        holder_ids = {s["id"] for s in holder.segment_report()}
        holder.close()
    else:
        from workers import connect
        store = connect(a)  # its own segment: every put lands in this process's memory
        put = store.put
    nonce = a["nonce"]
    for size, n in a["sizes"]:
        base = pattern(size, size)
        ns, errors = [], 0
        for i, key in enumerate(_keys(tag, size, n)):
            value = bytes(stamped(base, size, i, nonce))  # carries its index (untimed)
            t0 = pc(); ok = put(key, value); ns.append(pc() - t0)
            errors += not ok
        out["put"][str(size)] = dict(latency_summary(ns, size), errors=errors)
        if system == "mooncaked":  # where the replicas went (the bytes must cross nodes)
            ids = []
            for _ in range(100):  # the node answers from its applied log, which may lag
                try:
                    ids = [r["segment_id"] for r in
                           client.object_stat(_keys(tag, size, 1)[0])["replicas"]]
                    break
                except Exception:  # noqa: BLE001 (OBJECT_NOT_FOUND until applied)
                    time.sleep(0.01)
            out["placement"][str(size)] = {"replica_segments": ids,
                                           "on_holder": bool(ids) and set(ids) <= holder_ids}
    emit("READY", out)
    wait_line("DONE")
    # No clean-up: the objects go with the servers, which are stopped next (Mooncake's
    # client takes ~2 s to close, and a forced remove_all on the cluster ~4 s).
    emit("RESULT", {"ok": True})
    sys.stdout.flush()
    os._exit(0)


def role_cross_reader(a: dict) -> None:
    tag, system = a["tag"], a["system"]
    staging = None
    if system == "mooncaked":
        client = _mooncaked(a["address"])
        get, close = client.get, client.close
        # Whether the node offered its get staging area (a local client maps it).
        staging = client.get_staging is not None if hasattr(client, "get_staging") else False
    else:
        from workers import connect
        store = connect(a)  # segment_bytes 0: a pure reader
        get, close = store.get, store.close
    for size, n in a["sizes"]:  # warm-up: connections, the transfer path, buffers
        for key in _keys(tag, size, min(n, 3)):
            get(key)
    out = {"get": {}, "verified": True, "get_staging": staging}
    for size, n in a["sizes"]:
        base = pattern(size, size)
        ns, errors = [], 0
        for key in _keys(tag, size, n):
            t0 = pc(); value = get(key); ns.append(pc() - t0)
            errors += value is None or len(value) != size
        # every key again, checked against the value it was given (untimed)
        bad = sum(not check_value(get(key), base, size, i, a["nonce"])
                  for i, key in enumerate(_keys(tag, size, n)))
        out["verified"] &= bad == 0
        out["get"][str(size)] = dict(latency_summary(ns, size), errors=errors, checked=n,
                                     bad=bad)
    close()
    emit("RESULT", out)


# -- failover: puts in a loop through one node ---------------------------------------------------

def role_put_loop(a: dict) -> None:
    from mooncaked.client.calls import ReplicateConfig
    from mooncaked.errors import MooncakedError
    tag, address = a["tag"], a["address"]
    config = ReplicateConfig(preferred_segments=[a["segment"]]) if a.get("segment") else None
    value = b"f" * 4096
    client = _mooncaked(address, timeout_s=a.get("op_timeout_s", 30.0))
    for i in range(20):
        client.put(f"{tag}-warm-{i}", value, config)
    control = {"event": None, "stop": None}

    def read_control() -> None:
        for line in sys.stdin:
            word, _, rest = line.strip().partition(" ")
            if word == "EVENT":
                control["event"] = float(rest)
            elif word == "STOP":
                control["stop"] = True
                return
        control["stop"] = True

    emit("READY")
    wait_line("GO")
    threading.Thread(target=read_control, daemon=True).start()
    starts, ends, codes = [], [], []  # code 0 = stored
    signalled = False
    n = 0
    while not control["stop"]:
        t0 = time.monotonic()
        try:
            if client is None:
                client = _mooncaked(address, timeout_s=a.get("op_timeout_s", 30.0))
            client.put(f"{tag}-p{n}", value, config)
            code = 0
        except MooncakedError as exc:
            code = int(exc.code)
            if client is not None and client._sock is None:  # the connection is gone
                client = None
        except OSError:
            code, client = -1, None
        t1 = time.monotonic()
        starts.append(t0); ends.append(t1); codes.append(code)
        n += 1
        event = control["event"]
        if code == 0 and not signalled and event is not None and t0 >= event:
            emit("RECOVERED")
            signalled = True
        if code != 0:
            time.sleep(0.001)  # a failing node answers at once: do not spin on it
    event = control["event"]
    out = {"ops": n, "failed": sum(1 for c in codes if c), "event": event}
    if event is not None:
        before = [i for i in range(n) if ends[i] < event and ends[i] >= event - 1.0]
        out["rate_before"] = (len(before) / (ends[before[-1]] - starts[before[0]])
                              if len(before) > 1 else None)
        first = next((i for i in range(n) if starts[i] >= event and codes[i] == 0), None)
        out["first_ok_s"] = None if first is None else ends[first] - event
        inflight = [i for i in range(n) if starts[i] < event <= ends[i]]
        out["in_flight_at_event"] = ({"s": ends[inflight[0]] - starts[inflight[0]],
                                      "code": codes[inflight[0]]} if inflight else None)
        after = [codes[i] for i in range(n) if starts[i] >= event or ends[i] >= event]
        histogram: dict = {}
        for c in after:
            if c:
                histogram[str(c)] = histogram.get(str(c), 0) + 1
        out["errors_after"] = histogram
        oks = [ends[i] for i in range(n) if codes[i] == 0 and ends[i] >= event - 0.5]
        out["max_gap_s"] = max((b - x for x, b in zip(oks, oks[1:])), default=None)
    emit("RESULT", out)
    if client is not None:
        client.close()


# -- cluster control -----------------------------------------------------------------------------

class Nodes:
    """One control connection per node, reopened after any error; status() never raises."""

    def __init__(self, addresses: dict) -> None:
        self.addresses = {int(k): v for k, v in addresses.items()}
        self.clients: dict = {}

    def call(self, node: int, method: str, *params):
        from mooncaked.errors import MooncakedError
        client = self.clients.get(node)
        try:
            if client is None:
                client = self.clients[node] = _mooncaked(self.addresses[node], timeout_s=2.0)
            return client.call(method, *params), None
        except (MooncakedError, OSError) as exc:
            if client is not None:
                client.close()
            self.clients.pop(node, None)
            return None, f"{type(exc).__name__}: {exc}"

    def status(self, node: int) -> dict:
        cluster, error = self.call(node, "cluster_status")
        return cluster if cluster is not None else {"error": error}


def _settled(nodes: Nodes, expect: list[int]) -> tuple[bool, dict]:
    """A leader that every node that answers agrees on, every expected node registered and up
    in the leader's membership, followers applied up to their commit index."""
    views = {n: nodes.status(n) for n in expect}
    leaders = {v.get("leader") for v in views.values() if "error" not in v}
    answered = [v for v in views.values() if "error" not in v]
    if not answered or len(leaders) != 1 or not next(iter(leaders)):
        return False, views
    leader = next(iter(leaders))
    for node, view in views.items():
        if "error" in view:
            if node != leader:
                return False, views
            continue  # see cluster.py: the leader's own status may not decode
        if not view.get("registered") or view.get("applied", 0) < view.get("commit", 0):
            return False, views
        up = {m["node_id"] for m in view.get("nodes", []) if m.get("up")}
        if not set(expect) <= up:
            return False, views
    return True, views


def role_cluster_ctl(a: dict) -> None:
    nodes = Nodes(a["nodes"])
    poll_s = a.get("poll_s", 0.005)
    emit("READY")
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "stop":
            break
        if what == "status":
            out = {}
            for node in nodes.addresses:
                daemon, error = nodes.call(node, "status")
                out[str(node)] = {"cluster": nodes.status(node), "status": daemon,
                                  "error": error}
            emit("RESULT", out)
        elif what == "wait_settled":
            started = time.monotonic()
            while True:
                ok, views = _settled(nodes, cmd["expect"])
                if ok or time.monotonic() - started > cmd.get("limit_s", 60):
                    break
                time.sleep(0.05)
            leader = next((v["leader"] for v in views.values() if "error" not in v), None)
            emit("RESULT", {"settled": ok, "leader": leader, "waited_s":
                            time.monotonic() - started,
                            "views": {str(k): v for k, v in views.items()}})
        elif what == "watch":  # until a node reports a leader other than `old`
            emit("WATCHING")
            started, polls, seen = time.monotonic(), 0, None
            while seen is None and time.monotonic() - started < cmd.get("limit_s", 30):
                for node in cmd["nodes"]:
                    view = nodes.status(node)
                    polls += 1
                    if view.get("leader") not in (None, 0, cmd["old"]):
                        seen = {"t": time.monotonic(), "leader": view["leader"],
                                "term": view.get("term"), "reported_by": node}
                        break
                time.sleep(poll_s)
            emit("RESULT", {"seen": seen, "polls": polls})
        elif what == "transfer":  # ask `via` to hand leadership to `to`; until `to` leads
            t0 = time.monotonic()
            answer, error = nodes.call(cmd["via"], "cluster_transfer_leader", cmd["to"])
            t_return = time.monotonic()
            seen = None
            while error is None and seen is None and \
                    time.monotonic() - t0 < cmd.get("limit_s", 30):
                for node in cmd["nodes"]:
                    view = nodes.status(node)
                    if view.get("leader") == cmd["to"]:
                        seen = {"t": time.monotonic(), "term": view.get("term"),
                                "reported_by": node}
                        break
                time.sleep(poll_s)
            emit("RESULT", {"t0": t0, "t_return": t_return, "answer": answer, "error": error,
                            "seen": seen})
        else:
            emit("RESULT", {"error": f"unknown command {what!r}"})
    for client in nodes.clients.values():
        client.close()


ROLES = {"cross_writer": role_cross_writer, "cross_reader": role_cross_reader,
         "put_loop": role_put_loop, "cluster_ctl": role_cluster_ctl}
