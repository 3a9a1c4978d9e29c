"""Simulated clients: each runs one operation at a time on a small key set and records it in the
history the linearizability checker reads.

A client talks to the node it believes leads (a follower answers NO_LEADER with a hint; the
daemon would forward instead, which changes nothing the checks see), writes and reads replica
bytes on the replica nodes itself, and records each operation by what it can know:
- a result, when the store answered;
- unknown (no completion time), when a request that may change the key timed out or its
  leader changed before it applied;
- nothing at all, when the operation cannot have changed anything (refused before the log,
  a put whose PutEnd was never proposed, a read that failed).
Values are unique ints; what a replica holds is (version tag, value), the tag being the version's
(writer_id, started_ms, size_bytes) as the log shows it.
"""

from __future__ import annotations

from mooncaked.checks.linearizability import Operation
from mooncaked.errors import ErrorCode
from mooncaked.meta import commands as c
from mooncaked.sim.events import MS
from mooncaked.sim.node import RpcClient

NAMESPACE = "sim"
KINDS = ("put", "upsert", "get", "remove", "exists")
PUT_ATTEMPTS = 3  # as daemon/cluster_handlers.py
WEIGHTS = (3, 3, 4, 1, 1)


class Op:
    __slots__ = ("kind", "key", "value", "invoke_ns", "deadline_ns", "maybe_applied", "size",
                 "tag", "replicas", "probe", "answered", "writer", "attempts")

    def __init__(self, kind: str, key: str, value: int | None, invoke_ns: int, deadline_ns: int,
                 size: int, probe: bool) -> None:
        self.kind = kind
        self.key = key
        self.value = value
        self.invoke_ns = invoke_ns
        self.deadline_ns = deadline_ns
        self.maybe_applied = False  # a request that may change the key has been sent
        self.size = size
        self.tag = None
        self.replicas: list = []
        self.probe = probe
        self.answered = False
        self.writer = 0
        self.attempts = 0


class Client:
    def __init__(self, sim, index: int) -> None:
        self.sim = sim
        self.params = sim.params
        self.client_id = 1000 + index
        self.writer_id = self.client_id  # the daemon's: one per client connection
        self._writer_seq = 0
        self.rng = sim.derive_rng()
        self.rpc = RpcClient(self.client_id, sim)
        self.leader_hint = 0
        self.op: Op | None = None
        self._op_seq = 0  # guards callbacks of an abandoned operation
        self.completed = 0
        self.probe_done = False

    # -- plumbing -----------------------------------------------------------------------------

    def receive(self, src: int, payload) -> None:
        if payload[0] == "rep":
            self.rpc.on_reply(payload[1], payload[2])

    def _guard(self, fn):
        """Wrap a callback so that it does nothing once its operation is over."""
        seq = self._op_seq

        def guarded(*args):
            if self._op_seq == seq and self.op is not None:
                fn(*args)
        return guarded

    def _pick_node(self) -> int:
        if self.leader_hint and self.leader_hint in self.sim.nodes:
            return self.leader_hint
        return self.rng.choice(self.sim.started_node_ids())

    def _call_leader(self, method: str, args: tuple, done, retry_on_timeout: bool) -> None:
        """Call the leader, following NO_LEADER hints until the operation's deadline."""
        op = self.op
        node = self._pick_node()

        def answered(result: tuple) -> None:
            if result[0] == "timeout":
                self.leader_hint = 0
                if retry_on_timeout and self.sim.scheduler.now < op.deadline_ns:
                    self._call_leader(method, args, done, retry_on_timeout)
                    return
            elif result[0] == "redirect":
                hint = result[1]
                self.leader_hint = hint if hint and hint != node else 0
                if self.sim.scheduler.now < op.deadline_ns:
                    self.sim.scheduler.after(self.params.tick_ms * MS // 2 if not hint else 0,
                                             self._guard(self._call_leader), method, args, done,
                                             retry_on_timeout)
                    return
                result = ("err", ErrorCode.NO_LEADER, None)
            else:
                self.leader_hint = node
            done(result)

        self.rpc.call(node, method, args, self._guard(answered), self.params.rpc_timeout_ms)

    # -- operations ---------------------------------------------------------------------------

    def next_op(self) -> None:
        sim = self.sim
        if self.op is not None:
            return  # the liveness phase started one already
        if sim.phase == "safety":
            if sim.ops_left <= 0:
                return
            sim.ops_left -= 1
            kind = self.rng.choices(KINDS, WEIGHTS)[0]
            probe = False
        elif sim.phase == "liveness" and not self.probe_done:
            kind, probe = "upsert", True
        else:
            return
        key = f"k{self.rng.randrange(self.params.keys)}"
        value = sim.new_value() if kind in ("put", "upsert") else None
        now = sim.scheduler.now
        size = self.rng.randint(1, self.params.max_value_bytes)
        self._op_seq += 1
        self.op = Op(kind, key, value, now, now + 4 * self.params.rpc_timeout_ms * MS, size,
                     probe)
        sim.trace(f"c{self.client_id} invoke {kind} {key}" + (f" v{value}" if value else ""))
        if kind in ("put", "upsert"):
            self._put_start()
        elif kind in ("get", "exists"):
            self._read()
        else:
            self._remove()

    def read_key(self, key: str) -> None:
        """The final read of one key after healing (a plain get in the history)."""
        now = self.sim.scheduler.now
        self._op_seq += 1
        self.op = Op("get", key, None, now, now + 4 * self.params.rpc_timeout_ms * MS, 0, True)
        self.sim.trace(f"c{self.client_id} invoke final get {key}")
        self._read()

    def _finish(self, result=None, *, record: bool = True, unknown: bool = False,
                answered: bool = True) -> None:
        op, sim = self.op, self.sim
        self.op = None
        self._op_seq += 1
        now = sim.scheduler.now
        if unknown:
            record, answered = op.maybe_applied, False
        if record:
            sim.history.append(Operation(self.client_id, op.kind, op.key, op.value,
                                         None if unknown else result, op.invoke_ns,
                                         None if unknown else now))
        outcome = "?" if unknown else (repr(result) if record else "no effect")
        sim.trace(f"c{self.client_id} complete {op.kind} {op.key} -> {outcome}")
        self.completed += 1
        if op.probe and answered:
            self.probe_done = True
        sim.op_finished(self, op, answered)
        think = self.rng.randrange(0, 3 * MS)
        sim.scheduler.after(think, self.next_op)

    def abandon(self) -> None:
        """The safety phase is over: give up the operation in flight."""
        if self.op is not None:
            self._finish(unknown=True)

    # -- put / upsert -------------------------------------------------------------------------

    def _put_start(self) -> None:
        """cluster_handlers._store_value: PutStart, the bytes to every replica, PutEnd; when a
        replica write fails, PutRevoke and place again, PUT_ATTEMPTS times at most."""
        op = self.op
        if "writer_per_put" in self.params.fixes:
            # Proposed fix: a writer id per put attempt, so that a PutEnd or PutRevoke of an
            # earlier attempt (one that timed out, still in the log) cannot take this one's
            # version. With the daemon's id per connection it can: it frees or publishes a
            # version whose bytes are still being written.
            self._writer_seq += 1
            op.writer = self.client_id * 1_000_000 + self._writer_seq
        else:
            op.writer = self.writer_id
        args = ((NAMESPACE, op.key), op.size, self.params.replicas, op.kind == "upsert",
                op.writer)
        self._call_leader("put_start", args, self._put_started, retry_on_timeout=False)

    def _put_started(self, result: tuple) -> None:
        op = self.op
        if result[0] == "ok":
            started_ms, replicas = result[1]
            op.tag = (op.writer, started_ms, op.size)
            op.replicas = replicas
            self.sim.checker.value_written((NAMESPACE, op.key), op.tag, op.value)
            self._write_replicas(list(replicas))
        elif result[0] == "err" and result[1] == ErrorCode.OBJECT_ALREADY_EXISTS \
                and op.kind == "put" and result[2] is True:
            self._finish(False)
        else:
            # Refused, or no answer: no PutEnd will follow, so nothing can become visible.
            self._finish(record=False, answered=result[0] != "timeout")

    def _write_replicas(self, remaining: list) -> None:
        op = self.op
        if not remaining:
            self._put_end()
            return
        segment_id, offset, generation = remaining[0]

        def written(result: tuple) -> None:
            if result[0] == "ok":
                self._write_replicas(remaining[1:])
                return
            self._call_leader("put_revoke", ((NAMESPACE, op.key), op.writer), revoked,
                              retry_on_timeout=False)

        def revoked(result: tuple) -> None:
            op.attempts += 1
            if result[0] == "ok" and op.attempts < PUT_ATTEMPTS:
                self._put_start()  # placed anew
            else:
                self._finish(record=False)  # TRANSFER_FAIL; the put changed nothing

        self.rpc.call(c.node_of_segment(segment_id), "write_replica",
                      (segment_id, offset, generation, op.tag, op.value), self._guard(written),
                      self.params.rpc_timeout_ms)

    def _put_end(self) -> None:
        op = self.op
        op.maybe_applied = True

        def ended(result: tuple) -> None:
            if result[0] == "ok":
                self.sim.checker.put_acknowledged((NAMESPACE, op.key), op.tag, op.value,
                                                  op.replicas)
                self._finish(True)
            elif result[0] == "timeout" or result[1] == ErrorCode.OUTCOME_UNKNOWN:
                self._finish(unknown=True)
            else:
                self._finish(record=False)  # refused, or its entry was overwritten

        self._call_leader("put_end", ((NAMESPACE, op.key), op.writer), self._guard(ended),
                          retry_on_timeout=False)

    # -- get / exists -------------------------------------------------------------------------

    def _read(self) -> None:
        self._call_leader("read", ((NAMESPACE, self.op.key),), self._version,
                          retry_on_timeout=True)

    def _version(self, result: tuple) -> None:
        op = self.op
        if result[0] != "ok":
            self._finish(record=False, answered=result[0] != "timeout")
            return
        version = result[1]
        if op.kind == "exists":
            self._finish(version is not None)
        elif version is None:
            self._finish(None)
        else:
            tag, replicas = version
            self._read_replicas(tuple(tag), list(replicas))

    def _read_replicas(self, tag: tuple, remaining: list) -> None:
        op = self.op
        if not remaining:
            self._finish(record=False)  # TRANSFER_FAIL: no replica could be read
            return
        segment_id, offset, generation = remaining[0]
        node = c.node_of_segment(segment_id)

        def read(result: tuple) -> None:
            if result[0] != "ok":
                self._read_replicas(tag, remaining[1:])
                return
            self.sim.checker.replica_read((NAMESPACE, op.key), tag, result[1], node,
                                          segment_id, offset)
            self._finish(result[1][1])

        self.rpc.call(node, "read_replica", (segment_id, offset, generation), self._guard(read),
                      self.params.rpc_timeout_ms)

    # -- remove -------------------------------------------------------------------------------

    def _remove(self) -> None:
        op = self.op
        op.maybe_applied = True

        def removed(result: tuple) -> None:
            if result[0] == "ok":
                self._finish(True)
            elif result[0] == "timeout" or result[1] == ErrorCode.OUTCOME_UNKNOWN:
                self._finish(unknown=True)
            elif result[1] in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.REPLICA_IS_NOT_READY):
                self._finish(False)
            else:
                self._finish(record=False)

        self._call_leader("remove", ((NAMESPACE, op.key),), removed, retry_on_timeout=False)
