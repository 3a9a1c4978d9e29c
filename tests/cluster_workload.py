"""A recorded client workload against a cluster of real daemons, for tests/test_cluster_faults.py.

Client threads, each with its own BlockingClient over TCP to one node (reconnecting after an
error), issue put / upsert / get / remove / exists on a small set of keys. Every call is
recorded with `time.monotonic_ns()` read just before it is sent and just after its answer, and
its outcome is sorted as wire/PROTOCOL.md section 5.4 says:

- a result: the operation happened (a get that answered OBJECT_NOT_FOUND read "absent", a
  remove that answered OBJECT_NOT_FOUND removed nothing);
- a definite failure (NO_LEADER, TRANSFER_FAIL, ... `DEFINITE`): nothing was applied; left out
  of the checked history;
- anything else (OUTCOME_UNKNOWN, RPC_FAIL, RPC_TIMEOUT, a lost connection, a timeout): the
  outcome is unknown; recorded with no completion time.

Every written value is unique and describes itself (`Values`): a header with the value id, its
size and a CRC of the body, then a body derived from the id. A get whose bytes are not exactly
one written value of that key is a violation, reported at once with the details.

`LeaderMonitor` polls `cluster_status` on every node, for "one leader per term" and the time
without a leader.
"""

from __future__ import annotations

import random
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable

from mooncaked.checks.linearizability import CheckResult, Operation, check
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError, code_name

CLIENT_TIMEOUT_S = 4.0  # above the 3 s a node waits for a leader, so NO_LEADER can come back

# Failures that applied nothing (wire/PROTOCOL.md 5.4 and 6); every other failure is unknown.
DEFINITE = frozenset({
    ErrorCode.NO_LEADER,             # not applied; retry
    ErrorCode.TRANSFER_FAIL,         # put revoked / get could not read
    ErrorCode.NO_AVAILABLE_HANDLE,   # no space: nothing was placed
    ErrorCode.OBJECT_HAS_LEASE,      # remove refused
    ErrorCode.REPLICA_IS_NOT_READY,  # remove of an object being written: refused
    ErrorCode.BUSY,                  # a bound was reached before anything was done
    ErrorCode.NOT_A_MEMBER,          # a removed node refuses before doing anything
})
# Codes that only a bug produces: a test fails when it sees one.
BUG_CODES = frozenset({ErrorCode.INTERNAL_ERROR, ErrorCode.PROTOCOL_ERROR,
                       ErrorCode.INVALID_PARAMS, ErrorCode.UNKNOWN_METHOD,
                       ErrorCode.HANDSHAKE_REQUIRED})

WRITES = ("put", "upsert", "remove")
KINDS = ("put", "upsert", "get", "remove", "exists")
MIN_VALUE_BYTES = 1024
MAX_VALUE_BYTES = 256 * 1024


_running: list = []  # started Workloads, Probers and LeaderMonitors, for stop_all()


def stop_all() -> None:
    """Stop every client thread still running (test teardown, after a failure)."""
    while _running:
        try:
            _running.pop().stop()
        except AssertionError:
            pass


class Violation(AssertionError):
    """A get returned bytes that are not exactly one value written to that key."""


# -- values ---------------------------------------------------------------------------------------

class Values:
    """Unique, self-checking values.

    Layout: magic "MCKV", value id (u64), size (u64), CRC-32 of the body (u32), then the body:
    `size - 24` pseudo-random bytes seeded by the id, so every offset of every value differs.
    """

    HEADER = struct.Struct("<4sQQI")
    MAGIC = b"MCKV"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self.written: dict[int, tuple[str, int]] = {}  # value id -> (key, size)

    def new(self, key: str, size: int) -> tuple[int, bytes]:
        size = max(size, self.HEADER.size + 1)
        with self._lock:
            self._next += 1
            value_id = self._next
            self.written[value_id] = (key, size)  # before it is sent: a get may see it at once
        return value_id, self.encode(value_id, size)

    @classmethod
    def body(cls, value_id: int, size: int) -> bytes:
        return random.Random(value_id).randbytes(size - cls.HEADER.size)

    @classmethod
    def encode(cls, value_id: int, size: int) -> bytes:
        body = cls.body(value_id, size)
        return cls.HEADER.pack(cls.MAGIC, value_id, size, zlib.crc32(body)) + body

    def decode(self, key: str, data) -> int:
        """The value id of `data` read from `key`; Violation unless it is exactly that value."""
        data = bytes(data)
        if len(data) < self.HEADER.size:
            raise Violation(f"get({key!r}) returned {len(data)} bytes: shorter than a header "
                            f"({data[:32]!r})")
        magic, value_id, size, crc = self.HEADER.unpack_from(data)
        with self._lock:
            origin = self.written.get(value_id)
        zeros = data.count(0)
        summary = (f"{len(data)} bytes, header magic={magic!r} id={value_id} size={size} "
                   f"crc={crc:#x}, {zeros} zero bytes, head {data[:40].hex()}")
        if magic != self.MAGIC or origin is None:
            raise Violation(f"get({key!r}) returned bytes that are no written value: {summary}")
        if origin[0] != key:
            raise Violation(f"get({key!r}) returned value {value_id}, which was written to key "
                            f"{origin[0]!r}: {summary}")
        if size != origin[1] or len(data) != size:
            raise Violation(f"get({key!r}) returned value {value_id} with {len(data)} bytes; it "
                            f"was written with {origin[1]}: {summary}")
        expected = self.encode(value_id, size)
        if data != expected:
            first = next(i for i in range(size) if data[i] != expected[i])
            raise Violation(
                f"get({key!r}) returned value {value_id} ({size} bytes) with wrong bytes from "
                f"offset {first} (crc of the body {zlib.crc32(data[self.HEADER.size:]):#x}, "
                f"written {crc:#x}; bytes from there {data[first:first + 16].hex()}, expected "
                f"{expected[first:first + 16].hex()}): {summary}")
        return value_id


# -- records --------------------------------------------------------------------------------------

@dataclass
class Record:
    client: int
    node: int
    kind: str
    key: str
    value: int | None      # put/upsert: the value id written
    invoke_ns: int
    complete_ns: int = 0   # when the answer (or the error) came back
    outcome: str = ""      # "ok", "fail" (definite: nothing applied) or "unknown"
    result: object = None  # ok: the model's result (see Recorder.run)
    code: int = 0          # the error code of a failure

    def describe(self) -> str:
        what = f"{self.kind}({self.key!r}{', v%d' % self.value if self.value else ''})"
        if self.outcome == "ok":
            answer = repr(self.result)
        elif not self.outcome:
            answer = "(no answer yet)"
        else:
            answer = f"{self.outcome} {code_name(self.code)}"
        return (f"client {self.client} via node {self.node}: {what} -> {answer} "
                f"[{self.invoke_ns} .. {self.complete_ns}]")


class Recorder:
    """Runs one operation on a client and records it (thread-safe)."""

    def __init__(self, values: Values | None = None) -> None:
        self.values = values or Values()
        self.records: list[Record] = []
        self.violations: list[str] = []
        self.violation_keys: list[str] = []
        self._client_ids = iter(range(1, 1 << 30))
        self._lock = threading.Lock()

    def client_id(self) -> int:
        with self._lock:
            return next(self._client_ids)

    def run(self, client: BlockingClient, client_id: int, node: int, kind: str, key: str,
            size: int = 0, config: ReplicateConfig | None = None) -> Record:
        """One call. Results in the model's terms: put True/False, upsert True, get a value
        id or None, remove True (removed) / False (absent), exists True/False."""
        value_id, value = (None, None)
        if kind in ("put", "upsert"):
            value_id, value = self.values.new(key, size or MIN_VALUE_BYTES)
        record = Record(client_id, node, kind, key, value_id, time.monotonic_ns())
        self.records.append(record)
        try:
            if kind == "put":
                result = client.put(key, value, config)
            elif kind == "upsert":
                client.upsert(key, value, config)
                result = True
            elif kind == "get":
                data = client.get(key)
                record.complete_ns = time.monotonic_ns()
                try:
                    result = self.values.decode(key, data)
                except Violation as exc:
                    message = f"node {node}, client {client_id}: {exc}"
                    self.violations.append(message)
                    self.violation_keys.append(key)
                    record.outcome, record.code = "unknown", 0
                    raise Violation(message) from None
            elif kind == "remove":
                client.remove(key, force=True)
                result = True
            elif kind == "exists":
                result = client.exists(key)
            else:
                raise ValueError(kind)
        except MooncakedError as exc:
            record.complete_ns = time.monotonic_ns()
            record.code = exc.code
            if exc.code == ErrorCode.OBJECT_NOT_FOUND and kind in ("get", "remove"):
                record.outcome = "ok"
                record.result = None if kind == "get" else False
            elif exc.code in DEFINITE:
                record.outcome = "fail"
            else:
                record.outcome = "unknown"
            return record
        if not record.complete_ns:
            record.complete_ns = time.monotonic_ns()
        record.outcome, record.result = "ok", result
        return record

    # -- views of the records ---------------------------------------------------------------

    def assert_no_violation(self) -> None:
        if self.violations:
            raise Violation("wrong bytes read:\n" + "\n".join(self.violations[:10]))

    def bug_codes(self) -> list[Record]:
        return [r for r in self.records if r.outcome != "ok" and r.code in BUG_CODES]

    def successes(self, kinds: Iterable[str] = WRITES, nodes: Iterable[int] | None = None,
                  since_ns: int = 0, until_ns: int | None = None) -> list[Record]:
        """Operations that succeeded, invoked at or after since_ns and completed before
        until_ns."""
        kinds, nodes = set(kinds), None if nodes is None else set(nodes)
        return [r for r in list(self.records)
                if r.outcome == "ok" and r.kind in kinds and r.invoke_ns >= since_ns
                and (until_ns is None or r.complete_ns < until_ns)
                and (nodes is None or r.node in nodes)]

    def longest_gap_s(self, start_ns: int, end_ns: int, kinds: Iterable[str] = WRITES) -> float:
        """The longest time in [start_ns, end_ns] in which no operation of `kinds` succeeded.

        Every operation needs the leader (a get or exists takes its lease there), so with all
        kinds this is the longest time the clients saw no leader."""
        kinds = set(kinds)
        points = sorted(r.complete_ns for r in list(self.records)
                        if r.outcome == "ok" and r.kind in kinds
                        and start_ns < r.complete_ns <= end_ns)
        marks = [start_ns, *points, end_ns]
        return max(b - a for a, b in zip(marks, marks[1:])) / 1e9

    def gap_report(self, start_ns: int, end_ns: int, kinds: Iterable[str] = KINDS) -> str:
        """Where the longest gap lies, and what the clients got meanwhile (for a failure)."""
        kinds = set(kinds)
        points = sorted(r.complete_ns for r in list(self.records)
                        if r.outcome == "ok" and r.kind in kinds
                        and start_ns < r.complete_ns <= end_ns)
        marks = [start_ns, *points, end_ns]
        a, b = max(zip(marks, marks[1:]), key=lambda pair: pair[1] - pair[0])
        during = [r.describe() for r in list(self.records)
                  if r.invoke_ns < b and (not r.complete_ns or r.complete_ns > a)]
        return (f"no success from {(a - start_ns) / 1e9:.2f} s to {(b - start_ns) / 1e9:.2f} s "
                f"after the fault; calls in flight then:\n" + "\n".join(during[-40:]))

    def counts(self) -> str:
        table: dict[tuple[str, str], int] = {}
        for r in list(self.records):
            name = (r.outcome if r.outcome == "ok" else "in flight" if not r.outcome
                    else f"{r.outcome}:{code_name(r.code)}")
            table[(r.kind, name)] = table.get((r.kind, name), 0) + 1
        return ", ".join(f"{kind} {name} {n}" for (kind, name), n in sorted(table.items()))

    def history(self, keys: Iterable[str] | None = None, *,
                hold_ns: int = 5_000_000_000,
                unknown_hold_ns: int = 20_000_000_000) -> list[Operation]:
        """The checker's history (of `keys`, default all).

        A put that answered False is left out when another write of the key may have been in
        progress at the time: write-once `put` answers False for a key that is being written
        (wire/PROTOCOL.md 5.1), a state the checker's model does not have (there the key is
        still absent). A write was in progress from its invocation until its answer; one that
        failed or has an unknown outcome may have left its PutStart behind, holding the key for
        `put_start_discard_timeout_ms`: until `hold_ns` after its answer, or `unknown_hold_ns`
        after its invocation when no answer came.
        """
        wanted = None if keys is None else set(keys)
        records = [r for r in list(self.records)
                   if r.complete_ns and (wanted is None or r.key in wanted)]
        writing: dict[str, list[tuple[int, int, Record]]] = {}
        for r in records:
            if r.kind in ("put", "upsert"):
                if r.outcome == "ok":
                    end = r.complete_ns
                elif r.outcome == "fail":
                    end = r.complete_ns + hold_ns
                else:
                    end = r.invoke_ns + unknown_hold_ns
                writing.setdefault(r.key, []).append((r.invoke_ns, end, r))
        history = []
        for r in records:
            if r.outcome == "fail":
                continue
            if r.outcome == "unknown":
                if r.kind in WRITES:
                    history.append(Operation(r.client, r.kind, r.key, r.value, None,
                                             r.invoke_ns, None))
                continue
            if r.kind == "put" and r.result is False and any(
                    w is not r and start < r.complete_ns and end > r.invoke_ns
                    for start, end, w in writing.get(r.key, ())):
                continue
            history.append(Operation(r.client, r.kind, r.key, r.value, r.result,
                                     r.invoke_ns, r.complete_ns))
        return history

    def key_story(self, key: str, last: int = 40) -> str:
        lines = [r.describe() for r in list(self.records) if r.key == key]
        skipped = len(lines) - last
        return "\n".join(([f"... {skipped} earlier"] if skipped > 0 else []) + lines[-last:])


# -- the workload ---------------------------------------------------------------------------------

DEFAULT_WEIGHTS = {"put": 3, "upsert": 2, "get": 4, "remove": 1, "exists": 1}


class Workload:
    """Client threads against chosen nodes of a Cluster, recording into a Recorder.

    `nodes`: one entry per client thread, the node it talks to. `config_for(key)`: the
    ReplicateConfig of writes of that key (None: the default, one replica).
    """

    def __init__(self, cluster, keys: list[str], nodes: list[int], *, seed: int = 1,
                 recorder: Recorder | None = None,
                 config_for: Callable[[str], ReplicateConfig | None] = lambda key: None,
                 weights: dict[str, int] | None = None, think_s: float = 0.01,
                 max_bytes: int = MAX_VALUE_BYTES) -> None:
        self.cluster = cluster
        self.keys = keys
        self.recorder = recorder or Recorder()
        self.config_for = config_for
        weights = weights or DEFAULT_WEIGHTS
        self.kinds, self.weights = list(weights), list(weights.values())
        self.think_s = think_s
        self.max_bytes = max_bytes
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(node, seed * 1000 + i),
                                          name=f"client-{i}-node{node}", daemon=True)
                         for i, node in enumerate(nodes)]

    def start(self) -> "Workload":
        _running.append(self)
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        if self in _running:
            _running.remove(self)
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S * 3 + 5)
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"client threads did not stop: {stuck}"

    def sleep(self, seconds: float) -> None:
        """Wait while the clients run; fail at once if one read wrong bytes."""
        deadline = time.monotonic() + seconds
        while True:
            self.recorder.assert_no_violation()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _client(self, node: int, seed: int) -> None:
        rng = random.Random(seed)
        recorder = self.recorder
        client_id = recorder.client_id()
        client = None
        while not self._stop.is_set():
            if client is None or client._sock is None:
                client = connect(self.cluster, node)
                if client is None:
                    self._stop.wait(0.1)
                    continue
            kind = rng.choices(self.kinds, self.weights)[0]
            key = rng.choice(self.keys)
            size = int(MIN_VALUE_BYTES * (self.max_bytes / MIN_VALUE_BYTES) ** rng.random())
            try:
                record = recorder.run(client, client_id, node, kind, key, size,
                                      self.config_for(key))
            except Violation:
                return
            if record.outcome != "ok":
                self._stop.wait(0.05)
            elif self.think_s:
                self._stop.wait(self.think_s)
        if client is not None:
            client.close()


def connect(cluster, node: int, timeout_s: float = CLIENT_TIMEOUT_S) -> BlockingClient | None:
    daemon = cluster.nodes[node]
    if daemon.process is None or daemon.process.poll() is not None:
        return None
    try:
        return BlockingClient.connect(daemon.tcp_address, client_name="faults",
                                      timeout_s=timeout_s)
    except (OSError, MooncakedError):
        return None


def read_all(cluster, recorder: Recorder, nodes: Iterable[int], keys: Iterable[str],
             timeout_s: float = 30.0) -> None:
    """The final phase: get every key through every node until each answers (a value or
    OBJECT_NOT_FOUND), recording every attempt."""
    keys = list(keys)
    for node in nodes:
        client_id = recorder.client_id()
        deadline = time.monotonic() + timeout_s
        pending = list(keys)
        client = None
        while pending:
            if client is None or client._sock is None:
                client = connect(cluster, node)
            if client is not None:
                record = recorder.run(client, client_id, node, "get", pending[0])
                if record.outcome == "ok":
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"node {node} did not answer gets of {pending} within {timeout_s} s; "
                    f"last: {recorder.records[-1].describe() if recorder.records else '-'}")
            time.sleep(0.1)
        if client is not None:
            client.close()


def check_history(recorder: Recorder, keys: Iterable[str], *, allow_spontaneous_loss: bool,
                  time_budget_s: float = 20.0) -> tuple[CheckResult, str]:
    """Check the keys' history; returns the result and a failure message (empty when ok)."""
    keys = list(keys)
    result = check(recorder.history(keys), allow_spontaneous_loss=allow_spontaneous_loss,
                   time_budget_s=time_budget_s)
    if result.ok:
        return result, ""
    return result, (f"history of {len(keys)} keys is not linearizable "
                    f"(allow_spontaneous_loss={allow_spontaneous_loss}):\n{result.explanation}"
                    f"\n\nall calls on {result.failed_key!r}:\n"
                    f"{recorder.key_story(result.failed_key)}")


# -- availability ---------------------------------------------------------------------------------

class Prober:
    """Measures the time without a leader as a client that retries quickly sees it.

    One thread per node removes a key that never exists, every `interval_s`, with a short
    socket timeout: a remove is a metadata write (it goes through the leader and the Raft log
    and answers OBJECT_NOT_FOUND once applied), and moves no value bytes, so a slow or stopped
    replica node cannot hold it up. The workload's clients measure something else: a request
    in flight when the leader hangs waits for the forwarding RPC timeout.
    """

    def __init__(self, cluster, nodes: Iterable[int], interval_s: float = 0.05,
                 timeout_s: float = 1.0) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.successes: list[tuple[int, int, int]] = []  # (node, invoked, completed)
        self.failures: list[tuple[int, int, int]] = []   # (node, invoked, error code)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._probe, args=(node,), daemon=True,
                                          name=f"prober-node{node}") for node in nodes]

    def start(self) -> "Prober":
        _running.append(self)
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        if self in _running:
            _running.remove(self)
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s * 3 + 5)

    def _probe(self, node: int) -> None:
        client = None
        while not self._stop.wait(self.interval_s):
            if client is None or client._sock is None:
                client = connect(self.cluster, node, timeout_s=self.timeout_s)
                if client is None:
                    continue
            invoked = time.monotonic_ns()
            try:
                client.remove(f"prober-{node}-never-written", force=True)
            except MooncakedError as exc:
                if exc.code != ErrorCode.OBJECT_NOT_FOUND:
                    self.failures.append((node, invoked, exc.code))
                    continue
            self.successes.append((node, invoked, time.monotonic_ns()))
        if client is not None:
            client.close()

    def count(self, nodes: Iterable[int], since_ns: int, until_ns: int) -> int:
        """Successes through `nodes` invoked at or after since_ns, completed before until_ns."""
        nodes = set(nodes)
        return sum(1 for node, invoked, completed in list(self.successes)
                   if node in nodes and invoked >= since_ns and completed < until_ns)

    def failed(self, nodes: Iterable[int], since_ns: int, until_ns: int) -> dict[str, int]:
        """Failures through `nodes` of calls invoked in [since_ns, until_ns), by error."""
        nodes, table = set(nodes), {}
        for node, invoked, code in list(self.failures):
            if node in nodes and since_ns <= invoked < until_ns:
                table[code_name(code)] = table.get(code_name(code), 0) + 1
        return table

    def longest_gap_s(self, start_ns: int, end_ns: int) -> tuple[float, float]:
        """(the longest time in [start_ns, end_ns] with no success, when it began (seconds
        after start_ns))."""
        points = sorted(t for _, _, t in list(self.successes) if start_ns < t <= end_ns)
        marks = [start_ns, *points, end_ns]
        a, b = max(zip(marks, marks[1:]), key=lambda pair: pair[1] - pair[0])
        return (b - a) / 1e9, (a - start_ns) / 1e9


# -- leadership -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    t_ns: int
    node: int
    term: int
    leader: int
    role: str


class LeaderMonitor:
    """Polls cluster_status on each node (one thread per node) every `interval_s`."""

    def __init__(self, cluster, interval_s: float = 0.1) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, args=(node,), daemon=True,
                                          name=f"monitor-node{node}")
                         for node in list(cluster.nodes)]

    def start(self) -> "LeaderMonitor":
        _running.append(self)
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        if self in _running:
            _running.remove(self)
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _poll(self, node: int) -> None:
        client = None
        while not self._stop.wait(self.interval_s):
            if client is None or client._sock is None:
                client = connect(self.cluster, node, timeout_s=1.0)
                if client is None:
                    continue
            try:
                status = client.call("cluster_status")
            except MooncakedError:
                client.close()
                continue
            if status:
                self.samples.append(Sample(time.monotonic_ns(), node, status["term"],
                                           status["leader"], status["role"]))
        if client is not None:
            client.close()

    def leaders_per_term(self) -> dict[int, set[int]]:
        """Term -> the nodes that said they led in it (from their own status)."""
        terms: dict[int, set[int]] = {}
        for s in list(self.samples):
            if s.role == "leader":
                terms.setdefault(s.term, set()).add(s.node)
        return terms

    def first_leader_after(self, t_ns: int, among: Iterable[int], not_leader: int = 0) -> int | None:
        """When a node of `among` first reported itself leader after t_ns (other than
        not_leader)."""
        among = set(among)
        times = [s.t_ns for s in list(self.samples) if s.t_ns > t_ns and s.node in among
                 and s.role == "leader" and s.node != not_leader]
        return min(times) if times else None

    def describe(self, since_ns: int = 0) -> str:
        changes, last = [], {}
        for s in sorted(self.samples, key=lambda s: s.t_ns):
            if s.t_ns >= since_ns and last.get(s.node) != (s.term, s.leader, s.role):
                last[s.node] = (s.term, s.leader, s.role)
                changes.append(f"{s.t_ns}: node {s.node} term {s.term} leader {s.leader} "
                               f"{s.role}")
        return "\n".join(changes[-60:])


def logs_tail(cluster, lines: int = 60) -> str:
    parts = []
    for node_id, node in cluster.nodes.items():
        try:
            text = node.log().splitlines()[-lines:]
        except OSError as exc:
            text = [f"(no log: {exc})"]
        parts.append(f"---- node {node_id} log (last {lines} lines) ----\n" + "\n".join(text))
    return "\n".join(parts)
