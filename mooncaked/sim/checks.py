"""The properties a run must keep, checked as it goes (cheap ones, after every event on a node)
and at its end.

Raft (the paper's figure 3, plus durability):
- Election Safety: at most one leader per term, over the whole run;
- Log Matching: an (index, term) names one entry, with one predecessor term; checked on every
  batch a node writes and on every log a node recovers, which by induction covers prefixes;
- Leader Completeness: a new leader of term T holds every entry some node saw committed while
  in a term below T;
- State Machine Safety: every node applies the same entry at each index, in order, and state
  digests agree at equal applied indexes;
- a node's term and commit index never go back while it runs, and a restarted node recovers at
  least the term and commit index its disk had reported synced.

Store:
- the state machine's own invariants (no two live ranges overlap in a segment, ...);
- a read is only ever given a version whose PutEnd the serving leader had applied;
- a replica read returns exactly the bytes (tag and value) of the version it was given;
- an acknowledged put stays readable, with its value, unless a later command on its key, or a
  NodeUp/NodeDown of every node holding a replica, explains why not (end of run);
- the client history is linearizable (end of run).
"""

from __future__ import annotations

from mooncaked.errors import MooncakedError
from mooncaked.meta import commands as c
from mooncaked.raft.types import Role

DIGEST_EVERY = 8  # compare state digests at every 8th applied index (they cost a dump)
INVARIANTS_EVERY = 32  # applied entries between two state machine invariant checks per node


class Violation(Exception):
    def __init__(self, prop: str, detail: str) -> None:
        super().__init__(f"{prop}: {detail}")
        self.prop = prop
        self.detail = detail


class Checker:
    def __init__(self, trace=None) -> None:
        self.trace = trace or (lambda text: None)
        self.leaders: dict[int, int] = {}  # term -> leader
        self.entries: dict[tuple[int, int], tuple] = {}  # (index, term) -> (prev term, kind, data)
        self.committed: dict[int, tuple] = {}  # index -> (term, kind, data)
        self.max_commit = 0  # highest commit index any node reported
        self.commit_by_term: dict[int, int] = {}  # term -> highest commit seen by a node in it
        self.digests: dict[int, bytes] = {}
        self.node_term: dict[int, int] = {}
        self.node_commit: dict[int, int] = {}
        self.synced_state: dict[int, tuple[int, int]] = {}  # node -> highest synced (term, commit)
        # Store bookkeeping, from the first node to apply each index.
        self.recorded_index = 0
        self.put_starts: dict[tuple, int] = {}  # (key, tag) -> index of its PutStart
        self.completed: dict[tuple, int] = {}  # (key, tag) -> index of its PutEnd
        self.key_events: dict[tuple, list[int]] = {}  # key -> indexes of commands ending a version
        self.node_events: dict[int, list[int]] = {}  # node -> indexes of its NodeUp/NodeDown
        self.values: dict[tuple, int] = {}  # (key, tag) -> value the writer writes
        self.acknowledged: list[tuple] = []  # (key, tag, value, replicas)
        self.elections = 0

    # -- Raft ---------------------------------------------------------------------------------

    def persisted(self, node, entries) -> None:
        """Log Matching, on each batch as the node writes it."""
        image = node.disk.written
        for entry in entries:
            record = (image.term_at(entry.index - 1), entry.kind, entry.data)
            known = self.entries.setdefault((entry.index, entry.term), record)
            if known != record:
                raise Violation("Log Matching", f"node {node.node_id} wrote entry "
                                f"{entry.index} of term {entry.term} after term {record[0]} "
                                f"({_describe(record)}); another log has it after term "
                                f"{known[0]} ({_describe(known)})")

    def node_started(self, node) -> None:
        image = node.disk.written
        previous = image.snapshot.meta.term if image.snapshot is not None else 0
        for entry in image.entries:
            record = (previous, entry.kind, entry.data)
            known = self.entries.get((entry.index, entry.term))
            if known is not None and known != record:
                raise Violation("Log Matching", f"node {node.node_id} recovered entry "
                                f"{entry.index} of term {entry.term} after term {previous}; "
                                f"it was written after term {known[0]}")
            previous = entry.term
        core, node_id = node.core, node.node_id
        term, commit = self.synced_state.get(node_id, (0, 0))
        if core.term < term or core.commit_index < commit:
            raise Violation("durability", f"node {node_id} restarted at term {core.term}, "
                            f"commit {core.commit_index}, but had synced term {term}, "
                            f"commit {commit} before it crashed")
        self.node_term[node_id] = core.term
        self.node_commit[node_id] = core.commit_index

    def synced(self, node, hard_state) -> None:
        """The node's disk said this hard state is durable (it acts on that next)."""
        term, commit = self.synced_state.get(node.node_id, (0, 0))
        self.synced_state[node.node_id] = (max(term, hard_state.term),
                                           max(commit, hard_state.commit))

    def _monotonic(self, node) -> None:
        core, node_id = node.core, node.node_id
        if core.term < self.node_term.get(node_id, 0):
            raise Violation("monotonic term", f"node {node_id}'s term went back from "
                            f"{self.node_term[node_id]} to {core.term}")
        if core.commit_index < self.node_commit.get(node_id, 0):
            raise Violation("monotonic commit", f"node {node_id}'s commit index went back "
                            f"from {self.node_commit[node_id]} to {core.commit_index}")
        self.node_term[node_id] = core.term
        self.node_commit[node_id] = core.commit_index

    def after_event(self, node) -> None:
        core = node.core
        self._monotonic(node)
        term, commit = core.term, core.commit_index
        if commit > self.max_commit:
            image = node.disk.written
            for index in range(max(self.max_commit, image.snapshot_index) + 1, commit + 1):
                entry = image.entry(index)
                if entry is not None:
                    self._committed(node, index, (entry.term, entry.kind, entry.data))
            self.max_commit = commit
        if commit > self.commit_by_term.get(term, 0):
            self.commit_by_term[term] = commit
        if core.role == Role.LEADER:
            self.became_leader(node)

    def became_leader(self, node) -> None:
        """Election Safety and Leader Completeness, as soon as a node leads (its Ready says so,
        before it writes anything) and again after every event while it leads."""
        term = node.core.term
        leader = self.leaders.setdefault(term, node.node_id)
        if leader != node.node_id:
            raise Violation("Election Safety", f"nodes {leader} and {node.node_id} both lead "
                            f"term {term}")
        if node.checked_term != term:
            node.checked_term = term
            self.elections += 1
            self._leader_complete(node, term)

    def _leader_complete(self, node, term: int) -> None:
        needed = max((commit for t, commit in self.commit_by_term.items() if t < term),
                     default=0)
        image = node.disk.written
        for index in range(image.snapshot_index + 1, needed + 1):
            known = self.committed.get(index)
            if known is None:
                continue
            entry = image.entry(index)
            if entry is None or (entry.term, entry.kind, entry.data) != known:
                raise Violation("Leader Completeness", f"node {node.node_id} leads term {term}"
                                f" but its log lacks entry {index} (term {known[0]}), committed"
                                f" before; it holds {entry}")

    def _committed(self, node, index: int, record: tuple) -> None:
        known = self.committed.setdefault(index, record)
        if known != record:
            raise Violation("State Machine Safety", f"node {node.node_id} has entry {index} "
                            f"as {_describe(record)} (term {record[0]}); it was committed as "
                            f"{_describe(known)} (term {known[0]})")

    def applying(self, node, entry) -> None:
        if entry.index != node.applied_index + 1:
            raise Violation("State Machine Safety", f"node {node.node_id} applies entry "
                            f"{entry.index} after {node.applied_index}")
        self._committed(node, entry.index, (entry.term, entry.kind, entry.data))

    def applied(self, node, index: int) -> None:
        if index % DIGEST_EVERY == 0:
            self._digest(node, index)
        if node.since_check >= INVARIANTS_EVERY:
            node.since_check = 0
            self.invariants(node)

    def _digest(self, node, index: int) -> None:
        digest = node.state.digest()
        known = self.digests.setdefault(index, digest)
        if known != digest:
            raise Violation("State Machine Safety", f"node {node.node_id}'s state digest at "
                            f"applied index {index} differs from another node's")

    def invariants(self, node) -> None:
        try:
            node.state.check_invariants()
        except AssertionError as exc:
            raise Violation("store invariants", f"node {node.node_id} at applied index "
                            f"{node.applied_index}: {exc}") from None

    def snapshot_installed(self, node, snapshot) -> None:
        index = snapshot.meta.index
        if index > self.max_commit:
            raise Violation("State Machine Safety", f"node {node.node_id} installed a "
                            f"snapshot at {index}, past every commit index seen "
                            f"({self.max_commit})")
        known = self.committed.get(index)
        if known is not None and known[0] != snapshot.meta.term:
            raise Violation("State Machine Safety", f"snapshot at {index} has term "
                            f"{snapshot.meta.term}; the committed entry has {known[0]}")
        self._digest(node, index)

    # -- the store ----------------------------------------------------------------------------

    def applied_command(self, node, index: int, command, result, before) -> None:
        """Bookkeeping from the first node to apply each index (all apply the same)."""
        if index <= self.recorded_index:
            return
        self.recorded_index = index
        failed = isinstance(result, MooncakedError)
        self.trace(f"log {index}: {_short(command)} -> "
                   f"{f'error {result.code}' if failed else _short(result)}")
        kind = type(command)
        if kind is c.PutStart and not failed:
            tag = (command.writer_id, command.now_ms, command.size_bytes)
            self.put_starts[(command.object_key, tag)] = index
        elif kind is c.PutEnd and not failed and before[0] == "superseded":
            # A preempted upsert that a later one completed over: done just before that one
            # (after its own start), never readable.
            tag = before[1]
            self.completed[(command.object_key, tag)] = self.put_starts[(command.object_key, tag)]
        elif kind is c.PutEnd and not failed:
            self.completed[(command.object_key, before)] = index
            self.key_events.setdefault(command.object_key, []).append(index)
        elif kind is c.Remove and not failed:
            self.key_events.setdefault(command.object_key, []).append(index)
        elif kind is c.Evict:
            for key in command.object_keys:
                self.key_events.setdefault(key, []).append(index)
        elif kind in (c.NodeUp, c.NodeDown):
            self.node_events.setdefault(command.node_id, []).append(index)

    def read_served(self, node, key, version) -> None:
        if version is None:
            return
        tag = (version.writer_id, version.started_ms, version.size_bytes)
        index = self.completed.get((key, tag))
        if index is None or index > node.applied_index:
            raise Violation("nothing in progress readable", f"leader {node.node_id} (applied "
                            f"{node.applied_index}) served {key} version {tag}, whose PutEnd "
                            f"{'was never applied' if index is None else f'is at {index}'}")

    def value_written(self, key, tag: tuple, value: int) -> None:
        self.values[(key, tag)] = value

    def replica_read(self, key, tag: tuple, held, node_id: int, segment_id: int,
                     offset: int) -> None:
        expected = (tag, self.values.get((key, tag)))
        if held != expected:
            raise Violation("exact bytes", f"a get of {key} was given version {tag} (value "
                            f"{expected[1]}) but node {node_id} segment {segment_id} offset "
                            f"{offset} holds {held}")

    def put_acknowledged(self, key, tag: tuple, value: int, replicas) -> None:
        self.acknowledged.append((key, tag, value, tuple(replicas)))

    def durability(self, state, final_applied: int) -> None:
        """Every acknowledged put is still the key's version unless something explains it."""
        for key, tag, value, replicas in self.acknowledged:
            end = self.completed.get((key, tag))
            start = self.put_starts.get((key, tag))
            if end is None or start is None:
                raise Violation("acknowledged put", f"put of {key} {tag} was acknowledged "
                                "but its PutStart/PutEnd is not in the log")
            if any(i > end for i in self.key_events.get(key, ())):
                continue  # replaced, removed or evicted later
            holders = {c.node_of_segment(segment_id) for segment_id, _, _ in replicas}
            kept = [n for n in holders
                    if not any(start < i for i in self.node_events.get(n, ()))]
            if not kept:
                continue  # every node holding it restarted or was declared down
            version = state.readable(key)
            found = None if version is None else (version.writer_id, version.started_ms,
                                                  version.size_bytes)
            if found != tag:
                raise Violation("acknowledged put lost", f"put of {key} (value {value}, "
                                f"version {tag}, PutEnd at {end}) is acknowledged, nodes "
                                f"{kept} hold replicas and never went down, but at applied "
                                f"index {final_applied} the key's version is {found}")


def _short(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{r.segment_id}@{r.offset}" if hasattr(r, "offset") else repr(r)
                               for r in value) + "]"
    if hasattr(value, "replicas"):
        return f"version({value.writer_id}, {value.started_ms}, {value.size_bytes})"
    return repr(value)


def _describe(record: tuple) -> str:
    _, kind, data = record
    if kind:
        return "conf change"
    if not data:
        return "no-op"
    try:
        from mooncaked.meta import codec
        return repr(codec.decode(data))
    except ValueError:
        return f"{len(data)} bytes"
