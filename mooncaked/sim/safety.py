"""The properties a run of real daemons must keep, checked on the nodes' own objects (their
RaftNode, RaftCore and StateMachine are in this process) after every step and at the end.

Raft (the paper's figure 3):
- Election Safety: at most one leader per term, over the whole run;
- Log Matching: an (index, term) names one entry, whichever node holds it;
- Leader Completeness: a leader holds every entry any node has seen committed;
- State Machine Safety: a committed index holds one entry on every node, and state digests
  agree at equal applied indexes;
- a node's term and commit index never go back while it runs.
Store:
- the state machine's own invariants (no two live ranges overlap in a segment, ...);
- no node stops itself (fail-stop): nothing in this world makes that right;
- no error reaches the event loop unhandled (the runner's exception handler).
"""

from __future__ import annotations

import hashlib

from mooncaked.raft.types import Role


class Violation(Exception):
    def __init__(self, prop: str, detail: str) -> None:
        super().__init__(f"{prop}: {detail}")
        self.prop = prop
        self.detail = detail


class _NodeWatch:
    """What has been checked of one incarnation of a node."""

    __slots__ = ("incarnation", "checked_index", "term", "commit", "applied")

    def __init__(self, incarnation: int) -> None:
        self.incarnation = incarnation
        self.checked_index = 0  # entries up to here were committed when checked: immutable
        self.term = 0
        self.commit = 0
        self.applied = -1


def _entry_id(entry) -> bytes:
    return hashlib.blake2b(bytes([int(entry.kind)]) + entry.data, digest_size=16).digest()


class Safety:
    def __init__(self, trace) -> None:
        self.trace = trace
        self.leaders: dict[int, int] = {}  # term -> node id
        self.entries: dict[tuple[int, int], bytes] = {}  # (index, term) -> entry id
        # index -> (entry term, entry id, term of the first node seen to have it committed)
        self.committed: dict[int, tuple[int, bytes, int]] = {}
        self.max_committed = 0
        self.digests: dict[int, bytes] = {}  # applied index -> state digest
        self._watch: dict[int, _NodeWatch] = {}
        self.checks = 0
        self._announced: set[int] = set()

    def check(self, world) -> None:
        self.checks += 1
        if world.stopped:
            name, reason = world.stopped[0]
            raise Violation("fail-stop", f"{name} stopped itself: {reason}")
        running = [n for n in world.nodes.values() if n.running]
        for node in running:
            self._check_node(node)
        for node in running:  # after every node's committed entries are recorded
            self._leader_completeness(node)

    def _check_node(self, node) -> None:
        raft = node.daemon.cluster.raft
        core = raft.core
        watch = self._watch.get(node.node_id)
        if watch is None or watch.incarnation != node.incarnation:
            watch = self._watch[node.node_id] = _NodeWatch(node.incarnation)
        if core.term < watch.term:
            raise Violation("monotonic term", f"{node.name}'s term went back from "
                            f"{watch.term} to {core.term}")
        if core.commit_index < watch.commit:
            raise Violation("monotonic commit", f"{node.name}'s commit index went back from "
                            f"{watch.commit} to {core.commit_index}")
        watch.term, watch.commit = core.term, core.commit_index
        if core.role == Role.LEADER:
            leader = self.leaders.setdefault(core.term, node.node_id)
            if leader != node.node_id:
                raise Violation("Election Safety", f"node{leader} and {node.name} both lead "
                                f"term {core.term}")
            if core.term not in self._announced:
                self._announced.add(core.term)
                self.trace(f"{node.name} leads term {core.term}")
        log = core._log
        start = max(watch.checked_index + 1, log.first_index)
        for entry in log.entries_between(start, log.last_index + 1) if start <= \
                log.last_index else ():
            key = (entry.index, entry.term)
            entry_id = _entry_id(entry)
            known = self.entries.setdefault(key, entry_id)
            if known != entry_id:
                raise Violation("Log Matching", f"{node.name} holds another entry at index "
                                f"{entry.index}, term {entry.term} than another node did")
            if entry.index <= core.commit_index:
                committed = self.committed.setdefault(entry.index,
                                                      (entry.term, entry_id, core.term))
                if committed[:2] != (entry.term, entry_id):
                    raise Violation("State Machine Safety", f"{node.name} committed entry "
                                    f"{entry.index} of term {entry.term}; another node "
                                    f"committed term {committed[0]}'s there")
                self.max_committed = max(self.max_committed, entry.index)
        watch.checked_index = max(watch.checked_index, min(core.commit_index, log.last_index))
        applied = raft.applied_index
        if applied != watch.applied:
            watch.applied = applied
            state = node.daemon.master.state
            try:
                state.check_invariants()
            except AssertionError as exc:
                raise Violation("state machine invariants", f"{node.name} at applied index "
                                f"{applied}: {exc}") from None
            digest = state.digest()
            known = self.digests.setdefault(applied, digest)
            if known != digest:
                raise Violation("State Machine Safety", f"{node.name}'s state at applied "
                                f"index {applied} differs from another node's at that index")

    def _leader_completeness(self, node) -> None:
        """A leader of term T holds every entry committed in a term below T. An entry's commit
        term is bounded from above by the term of the first node seen to have it committed,
        so only entries seen committed below T are asked for (a sound, slightly weaker check:
        a paused old leader need not hold what a newer one committed)."""
        core = node.daemon.cluster.raft.core
        if core.role != Role.LEADER:
            return
        log = core._log
        for index in range(log.first_index, self.max_committed + 1):
            committed = self.committed.get(index)
            if committed is None or committed[2] >= core.term:
                continue
            if log.term_at(index) != committed[0]:
                raise Violation("Leader Completeness", f"{node.name} leads term {core.term} "
                                f"without entry {index} (term {committed[0]}), committed "
                                f"by term {committed[2]}")

    def digest_of(self, node) -> tuple[int, bytes]:
        raft = node.daemon.cluster.raft
        return raft.applied_index, node.daemon.master.state.digest()
