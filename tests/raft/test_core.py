"""The Raft core, driven through a small deterministic network.

`Cluster` holds the nodes and the messages in flight. Each node keeps an in-memory "disk"
(hard state, snapshot, entries) and a state machine (the list of (index, data) it applied),
and handles every Ready in the contract's order: persist, send, apply, advance. Messages are
delivered in FIFO order unless a test blocks a link, installs a drop rule, or shuffles.

Every Ready is checked as it is handled: entries are applied in index order, no two nodes lead
in the same term, and any two state machines agree on their common prefix.
"""

from __future__ import annotations

import random
from dataclasses import replace
from collections.abc import Callable, Iterable

import msgpack
import pytest

from mooncaked.raft.codec import decode_conf_change, decode_message, encode_message
from mooncaked.raft.core import TRANSFER_CONTEXT, RaftConfig, RaftCore
from mooncaked.raft.types import (
    ConfChange,
    ConfChangeKind,
    ConfState,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    NotLeader,
    ProposalDropped,
    Ready,
    ReadState,
    Role,
    Snapshot,
    SnapshotMeta,
)

MT = MessageType


class Node:
    def __init__(self, cluster: Cluster, node_id: int, config: RaftConfig, seed: int,
                 conf_state: ConfState | None, hard_state: HardState = HardState(),
                 entries: Iterable[Entry] = ()) -> None:
        self.cluster = cluster
        self.id = node_id
        self.config = config
        self.seed = seed
        self.boot_conf = conf_state
        self.hard = hard_state
        self.snapshot: Snapshot | None = None
        self.entries: list[Entry] = list(entries)
        self.state: list[tuple[int, bytes]] = []
        self.applied_index = 0
        self.read_states: list[ReadState] = []
        self.readies: list[Ready] = []
        self.core = RaftCore(config, random.Random(seed), hard_state=hard_state,
                             entries=self.entries, conf_state=conf_state)

    def restart(self) -> None:
        """Crash and recover from the disk: the state machine restarts from the snapshot."""
        self.core = RaftCore(self.config, random.Random(self.seed + 7919), hard_state=self.hard,
                             snapshot=self.snapshot, entries=list(self.entries),
                             conf_state=self.boot_conf)
        self.state = _unpack_state(self.snapshot.data) if self.snapshot else []
        self.applied_index = self.snapshot.meta.index if self.snapshot else 0

    def handle_ready(self) -> Ready:
        rd = self.core.ready()
        self.readies.append(rd)
        self.cluster.transcript.append((self.id, repr(rd)))
        # 1. persist
        if rd.hard_state is not None:
            self.hard = rd.hard_state
        if rd.snapshot is not None:
            self.snapshot = rd.snapshot
            self.entries = []  # a snapshot from the leader replaces the whole log
        if rd.entries:
            base = self.snapshot.meta.index if self.snapshot else 0
            del self.entries[rd.entries[0].index - base - 1:]
            self.entries.extend(rd.entries)
            indices = [e.index for e in self.entries]
            assert indices == list(range(base + 1, base + 1 + len(indices)))
        # 2. send
        self.cluster.in_flight.extend(rd.messages)
        # 3. apply
        if rd.snapshot is not None:
            self.state = _unpack_state(rd.snapshot.data)
            self.applied_index = rd.snapshot.meta.index
        for entry in rd.committed_entries:
            assert entry.index == self.applied_index + 1, (self.id, entry.index, self.applied_index)
            if entry.kind == EntryKind.CONF_CHANGE:
                self.core.apply_conf_change(decode_conf_change(entry.data))
            elif entry.data:
                self.state.append((entry.index, entry.data))
            self.applied_index = entry.index
        # 4. reads
        for read in rd.read_states:
            assert read.index <= self.core.commit_index
            floor = self.cluster.read_floors.get(read.context)
            assert floor is None or read.index >= floor, ("stale read", read, floor)
            self.cluster.reads_answered += 1
        self.read_states.extend(rd.read_states)
        # 5. advance
        self.core.advance(rd)
        self.cluster.check_invariants(self)
        return rd

    def term_at(self, index: int) -> int:
        if self.snapshot and index == self.snapshot.meta.index:
            return self.snapshot.meta.term
        base = self.snapshot.meta.index if self.snapshot else 0
        return self.entries[index - base - 1].term

    def compact(self) -> Snapshot:
        """Snapshot the state machine at the applied index and compact core and disk."""
        index = self.applied_index
        snapshot = Snapshot(SnapshotMeta(index, self.term_at(index), self.core.conf_state),
                            msgpack.packb(self.state, use_bin_type=True))
        base = self.snapshot.meta.index if self.snapshot else 0
        self.core.compact(snapshot)
        self.entries = self.entries[index - base:]
        self.snapshot = snapshot
        return snapshot

    def log_terms(self) -> list[int]:
        return [e.term for e in self.entries]


def _unpack_state(data: bytes) -> list[tuple[int, bytes]]:
    return [tuple(item) for item in msgpack.unpackb(data, raw=False)]


class Cluster:
    def __init__(self, voters: Iterable[int] = (1, 2, 3), *, learners: Iterable[int] = (),
                 joiners: Iterable[int] = (), seed: int = 0, **config: object) -> None:
        self.transcript: list[tuple[int, str]] = []
        self.in_flight: list[Message] = []
        self.blocked: set[tuple[int, int]] = set()
        self.drop: Callable[[Message], bool] | None = None
        self.rewrite: Callable[[Message], Message] | None = None  # what the network delivers
        self.leaders_by_term: dict[int, int] = {}
        self.read_floors: dict[bytes, int] = {}  # read context -> least index that read may use
        self.reads_answered = 0
        self.nodes: dict[int, Node] = {}
        self.config = config
        self.seed = seed
        conf = ConfState(tuple(voters), tuple(learners))
        for node_id in (*conf.voters, *conf.learners):
            self.add_node(node_id, conf)
        for node_id in joiners:
            self.add_node(node_id, None)

    def add_node(self, node_id: int, conf_state: ConfState | None, **restore: object) -> Node:
        config = RaftConfig(node_id=node_id, **self.config)
        node = Node(self, node_id, config, self.seed * 1000 + node_id, conf_state, **restore)
        self.nodes[node_id] = node
        return node

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    # --- network ---

    def isolate(self, node_id: int) -> None:
        for other in self.nodes:
            if other != node_id:
                self.blocked.add((node_id, other))
                self.blocked.add((other, node_id))

    def heal(self) -> None:
        self.blocked.clear()
        self.drop = self.rewrite = None

    def deliver(self, msg: Message) -> None:
        if (
            (msg.from_, msg.to) in self.blocked
            or msg.to not in self.nodes
            or (self.drop is not None and self.drop(msg))
        ):
            self.lose(msg)
            return
        self.nodes[msg.to].core.step(msg if self.rewrite is None else self.rewrite(msg))
        if msg.type == MT.SNAPSHOT:
            self.nodes[msg.from_].core.report_snapshot(msg.to, True)

    def lose(self, msg: Message) -> None:
        if msg.type == MT.SNAPSHOT and msg.from_ in self.nodes:
            self.nodes[msg.from_].core.report_snapshot(msg.to, False)

    def deliver_all(self) -> None:
        batch, self.in_flight = self.in_flight, []
        for msg in batch:
            self.deliver(msg)

    def process_all(self) -> bool:
        busy = False
        for node in self.nodes.values():
            for _ in range(100):
                if not node.core.has_ready():
                    break
                node.handle_ready()
                busy = True
            else:
                raise AssertionError(f"node {node.id} is always ready")
        return busy

    def stabilize(self, limit: int = 1000) -> None:
        for _ in range(limit):
            busy = self.process_all()
            if self.in_flight:
                self.deliver_all()
                busy = True
            if not busy:
                return
        raise AssertionError("the cluster did not settle")

    def tick(self, count: int = 1, nodes: Iterable[int] | None = None) -> None:
        ids = list(nodes) if nodes is not None else list(self.nodes)
        for _ in range(count):
            for node_id in ids:
                self.nodes[node_id].core.tick()
            self.stabilize()

    # --- helpers ---

    def elect(self, node_id: int) -> Node:
        self.stabilize()
        self.nodes[node_id].core.campaign()
        self.stabilize()
        assert self.nodes[node_id].core.role == Role.LEADER
        return self.nodes[node_id]

    def leader(self) -> Node | None:
        leaders = [n for n in self.nodes.values() if n.core.role == Role.LEADER]
        return max(leaders, key=lambda n: n.core.term) if leaders else None

    def tick_until_leader(self, among: Iterable[int], limit: int = 200) -> Node:
        among = set(among)
        for _ in range(limit):
            self.tick()
            leader = self.leader()
            if leader is not None and leader.id in among:
                return leader
        raise AssertionError("no leader elected")

    def check_invariants(self, node: Node) -> None:
        core = node.core
        if core.role == Role.LEADER:
            leader = self.leaders_by_term.setdefault(core.term, node.id)
            assert leader == node.id, f"two leaders in term {core.term}"
        for other in self.nodes.values():
            common = min(len(other.state), len(node.state))
            assert other.state[:common] == node.state[:common], "state machines diverged"


def payloads(node: Node) -> list[bytes]:
    return [data for _, data in node.state]


def sent(rd: Ready, msg_type: MessageType, to: int | None = None) -> list[Message]:
    return [m for m in rd.messages if m.type == msg_type and (to is None or m.to == to)]


# ---------------------------------------------------------------------- basics


def test_single_node_commits_on_advance():
    cluster = Cluster((1,))
    node = cluster[1]
    first = node.handle_ready()
    assert first.hard_state == HardState(term=1, vote=0, commit=1)
    assert [e.kind for e in first.entries] == [EntryKind.CONF_CHANGE]
    assert first.committed_entries == first.entries  # the bootstrap membership
    node.core.campaign()
    rd = node.handle_ready()
    assert rd.soft_state.role == Role.LEADER and rd.hard_state.vote == 1
    assert rd.entries[-1].data == b"" and rd.committed_entries == []  # the no-op, not yet on disk
    rd = node.handle_ready()
    assert [e.index for e in rd.committed_entries] == [2]

    index = node.core.propose(b"x")
    rd = node.handle_ready()
    assert [e.index for e in rd.entries] == [index] and rd.committed_entries == []
    rd = node.handle_ready()
    assert [(e.index, e.data) for e in rd.committed_entries] == [(index, b"x")]
    assert rd.hard_state.commit == index
    assert not node.core.has_ready()


def test_three_nodes_elect_and_replicate():
    cluster = Cluster()
    leader = cluster.tick_until_leader((1, 2, 3))
    for i in range(5):
        leader.core.propose(b"v%d" % i)
    cluster.stabilize()
    expected = [b"v%d" % i for i in range(5)]
    for node in cluster.nodes.values():
        assert payloads(node) == expected
        assert node.core.term == leader.core.term
        assert node.core.leader_id == leader.id
        assert node.core.commit_index == leader.core.last_index


def test_vote_is_in_the_hard_state_of_the_ready_that_sends_the_grant():
    cluster = Cluster()
    cluster.stabilize()
    cluster[1].core.campaign()
    cluster.stabilize()  # pre-vote round, then the real vote round, all granted
    granted = [
        (node.id, rd) for node in cluster.nodes.values() if node.id != 1 for rd in node.readies
        if sent(rd, MT.VOTE_RESPONSE)
    ]
    assert len(granted) == 2
    for _, rd in granted:
        assert not sent(rd, MT.VOTE_RESPONSE)[0].reject
        assert rd.hard_state is not None and rd.hard_state.vote == 1
        assert rd.hard_state.term == sent(rd, MT.VOTE_RESPONSE)[0].term


def test_non_leaders_refuse_requests():
    cluster = Cluster()
    cluster.elect(1)
    follower = cluster[2].core
    with pytest.raises(NotLeader) as info:
        follower.propose(b"x")
    assert info.value.leader == 1
    for call in (lambda: follower.read_index(b"r"), lambda: follower.transfer_leader(3),
                 lambda: follower.propose_conf_change(ConfChange(ConfChangeKind.REMOVE, 3))):
        with pytest.raises(NotLeader):
            call()


def test_leader_counts_its_own_entries_only_once_persisted():
    cluster = Cluster()
    leader = cluster.elect(1)
    cluster.isolate(3)
    index = leader.core.propose(b"p")
    rd = leader.core.ready()  # the driver has not written it yet
    for msg in rd.messages:
        cluster.deliver(msg)
    cluster[2].handle_ready()  # node 2 persists it and answers
    for msg in cluster.in_flight:
        leader.core.step(msg)
    assert leader.core.status()["progress"][2]["match"] == index
    assert leader.core.commit_index < index  # 2 of 3 hold it, but not on the leader's disk
    leader.core.advance(rd)
    assert leader.core.commit_index == index
    assert [e.index for e in leader.core.ready().committed_entries] == [index]


def test_a_single_voter_whose_writes_are_durable_commits_its_entry_in_the_same_ready():
    cluster = Cluster((1,), entries_durable_when_written=True)
    node = cluster[1]
    node.handle_ready()
    node.core.campaign()
    rd = node.handle_ready()
    assert rd.soft_state.role == Role.LEADER
    assert [e.index for e in rd.committed_entries] == [e.index for e in rd.entries] == [2]
    assert not node.core.has_ready()

    index = node.core.propose(b"x")
    rd = node.handle_ready()
    assert [e.index for e in rd.entries] == [index]
    assert [(e.index, e.data) for e in rd.committed_entries] == [(index, b"x")]
    assert rd.hard_state.commit == index  # written with the entry it commits
    assert not node.core.has_ready()  # one Ready per proposal, not two
    assert payloads(node) == [b"x"]


def test_a_leader_whose_writes_are_durable_still_needs_a_quorum():
    cluster = Cluster(entries_durable_when_written=True)
    leader = cluster.elect(1)
    cluster.isolate(2)
    cluster.isolate(3)
    index = leader.core.propose(b"p")
    rd = leader.handle_ready()  # written, so the leader's own copy counts: 1 of 3
    assert [e.index for e in rd.entries] == [index] and rd.committed_entries == []
    assert leader.core.commit_index < index
    cluster.heal()
    cluster.stabilize()
    assert leader.core.commit_index >= index
    assert all(payloads(node) == [b"p"] for node in cluster.nodes.values())


def test_max_uncommitted_entries_bounds_proposals():
    cluster = Cluster(max_uncommitted_entries=5)
    leader = cluster.elect(1)
    cluster.isolate(1)
    for i in range(5):
        leader.core.propose(b"%d" % i)
    with pytest.raises(ProposalDropped):
        leader.core.propose(b"too many")
    cluster.heal()
    cluster.tick()
    leader.core.propose(b"after commit")  # the backlog committed: room again


# ---------------------------------------------------------------------- elections


@pytest.mark.parametrize("pre_vote", [True, False])
def test_rejoining_partitioned_node_and_pre_vote(pre_vote):
    cluster = Cluster(pre_vote=pre_vote, check_quorum=pre_vote)
    leader = cluster.elect(1)
    term = leader.core.term
    cluster.isolate(3)
    cluster.tick(60)  # node 3 times out several times
    assert leader.core.role == Role.LEADER
    if pre_vote:
        assert cluster[3].core.term == term  # pre-candidates never bump their term
        assert cluster[3].core.role == Role.PRE_CANDIDATE
    else:
        assert cluster[3].core.term > term + 2
    cluster.heal()
    cluster.tick(5)
    if pre_vote:
        assert leader.core.role == Role.LEADER and leader.core.term == term
        assert cluster[3].core.leader_id == 1 and cluster[3].core.term == term
    else:
        # Without pre-vote the rejoining node's higher term deposes the healthy leader.
        assert cluster.leader() is None or cluster.leader().core.term > term


def test_check_quorum_leader_steps_down_when_cut_off():
    cluster = Cluster()
    old = cluster.elect(1)
    cluster.isolate(1)
    for _ in range(2 * old.config.election_ticks):
        cluster.tick()
        if old.core.role != Role.LEADER:
            break
    assert old.core.role == Role.FOLLOWER and old.core.leader_id == 0
    new = cluster.tick_until_leader((2, 3))
    assert new.core.term > old.core.term
    new.core.propose(b"while 1 was away")
    cluster.stabilize()
    cluster.heal()
    cluster.tick(3)
    assert old.core.leader_id == new.id and old.core.term == new.core.term
    assert payloads(old) == [b"while 1 was away"]


def test_stale_leader_steps_down_on_any_newer_reply():
    cluster = Cluster(check_quorum=False)
    old = cluster.elect(1)
    cluster.isolate(1)
    new = cluster.tick_until_leader((2, 3))
    assert old.core.role == Role.LEADER  # without check-quorum it never noticed
    with pytest.raises(ProposalDropped):
        for _ in range(old.config.max_uncommitted_entries + 1):
            old.core.propose(b"lost")
    cluster.heal()
    cluster.tick(3)
    assert old.core.role == Role.FOLLOWER and old.core.term == new.core.term
    assert b"lost" not in payloads(old)
    assert old.core.last_index == new.core.last_index


def test_follower_hearing_a_leader_ignores_vote_requests_but_not_transfers():
    cluster = Cluster()
    cluster.elect(1)
    follower = cluster[2].core
    term = follower.term
    request = Message(MT.VOTE, 2, 3, term + 1, log_term=100, index=100)
    follower.step(request)
    assert follower.term == term and not follower.has_ready()
    follower.step(replace(request, context=TRANSFER_CONTEXT))
    rd = follower.ready()
    assert follower.term == term + 1 and rd.hard_state.vote == 3
    assert sent(rd, MT.VOTE_RESPONSE, 3)[0].reject is False


def test_node_restart_keeps_term_vote_and_log():
    cluster = Cluster()
    leader = cluster.elect(1)
    leader.core.propose(b"a")
    cluster.stabilize()
    node = cluster[2]
    before = (node.core.term, node.core.vote, node.core.last_index)
    node.restart()
    assert (node.core.term, node.core.vote, node.core.last_index) == before
    cluster.stabilize()  # replays the committed log into the fresh state machine
    assert payloads(node) == [b"a"]
    leader.core.propose(b"b")
    cluster.stabilize()
    assert payloads(node) == [b"a", b"b"]


# ---------------------------------------------------------------------- replication


def restored_cluster(logs: dict[int, list[int]], terms: dict[int, int], **config) -> Cluster:
    """A cluster whose nodes restart with the given logs (as lists of entry terms)."""
    cluster = Cluster((), **config)
    conf = ConfState(tuple(sorted(logs)))
    for node_id, log in logs.items():
        entries = [Entry(term, index) for index, term in enumerate(log, start=1)]
        cluster.add_node(node_id, conf, hard_state=HardState(term=terms[node_id]), entries=entries)
    return cluster


def test_conflicting_follower_suffixes_are_replaced_raft_figure_7():
    leader_log = [1, 1, 1, 4, 4, 5, 5, 6, 6, 6]
    logs = {
        1: leader_log,
        2: [1, 1, 1, 4, 4, 5, 5, 6, 6],  # (a) missing an entry
        3: [1, 1, 1, 4],  # (b) missing many
        4: [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 6],  # (c) one extra uncommitted entry
        5: [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 7, 7],  # (d) extra entries of a later term
        6: [1, 1, 1, 4, 4, 4, 4],  # (e) missing, plus a conflicting term
        7: [1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3],  # (f) long conflicting run from an old leader
    }
    terms = {node_id: max(log) for node_id, log in logs.items()} | {1: 7}  # 1 saw term 7 (d's)
    cluster = restored_cluster(logs, terms)
    leader = cluster.elect(1)
    assert leader.core.term == 8
    expected = leader_log + [8]
    for node in cluster.nodes.values():
        assert node.log_terms() == expected, node.id
        assert node.core.commit_index == len(expected)
    # Fast back-off: the reject hint lets each follower catch up after one refusal.
    for node in cluster.nodes.values():
        refusals = [m for rd in node.readies for m in sent(rd, MT.APPEND_RESPONSE) if m.reject]
        assert len(refusals) <= 1, (node.id, refusals)


def test_follower_truncates_only_on_conflict():
    follower = RaftCore(RaftConfig(2), random.Random(1), hard_state=HardState(term=2),
                        entries=[Entry(1, 1), Entry(1, 2), Entry(2, 3), Entry(2, 4)],
                        conf_state=ConfState((1, 2, 3)))
    # A duplicate of an older, shorter append must not cut entries 3 and 4.
    follower.step(Message(MT.APPEND, 2, 1, 2, log_term=1, index=1, entries=(Entry(1, 2),)))
    assert follower.last_index == 4
    assert sent(follower.ready(), MT.APPEND_RESPONSE)[0].index == 2
    # A new leader at term 3 replaces the term-2 suffix from index 3.
    follower.step(Message(MT.APPEND, 2, 3, 3, log_term=1, index=2, entries=(Entry(3, 3),)))
    rd = follower.ready()
    assert follower.last_index == 3
    assert rd.entries == [Entry(3, 3)]  # the replacement goes to disk
    assert sent(rd, MT.APPEND_RESPONSE)[0].index == 3
    # An append whose previous entry we lack is refused with a hint.
    follower.step(Message(MT.APPEND, 2, 3, 3, log_term=3, index=7, entries=(Entry(3, 8),)))
    reply = sent(follower.ready(), MT.APPEND_RESPONSE)[0]
    assert reply.reject and reply.reject_hint == 3 and reply.log_term == 3


def test_commit_only_by_counting_current_term_entries_raft_figure_8():
    # S1 led term 2 and got entry 2 onto S2 only; S5 led term 3 and wrote its own entry 2.
    logs = {1: [1, 2], 2: [1, 2], 3: [1], 4: [1], 5: [1, 3]}
    terms = {1: 3, 2: 2, 3: 1, 4: 1, 5: 3}
    cluster = restored_cluster(logs, terms, max_entries_per_append=1)
    # S1 wins term 4 (S5's log is newer, so it refuses). Then S4 and S5 stay unreachable, and
    # only the term-2 entry, not the term-4 no-op, reaches S3.
    cluster.drop = lambda m: m.to in (4, 5) and m.type in (MT.APPEND, MT.HEARTBEAT)

    def without_new_entries(msg: Message) -> Message:
        if msg.to == 3 and msg.type == MT.APPEND:
            return replace(msg, entries=tuple(e for e in msg.entries if e.index < 3))
        return msg

    cluster.rewrite = without_new_entries
    leader = cluster.elect(1)
    assert leader.core.term == 4
    assert cluster[3].log_terms() == [1, 2]
    progress = leader.core.status()["progress"]
    assert [progress[n]["match"] for n in (1, 2, 3)] == [3, 3, 2]
    # Entry 2 is on a majority (S1, S2, S3) but is of term 2: it must not commit yet, as S5
    # could still be elected and overwrite it.
    assert leader.core.commit_index == 0  # restored with nothing known committed
    cluster.rewrite = None
    cluster.tick(2)
    assert cluster[3].log_terms() == [1, 2, 4]
    assert leader.core.commit_index == 3


def test_pipelining_sends_several_appends_before_an_answer():
    cluster = Cluster(max_inflight_appends=3)
    leader = cluster.elect(1)
    appends = []
    first = leader.core.last_index + 1
    for i in range(5):
        leader.core.propose(b"p%d" % i)
        rd = leader.handle_ready()
        appends += sent(rd, MT.APPEND, to=2)
    cluster.in_flight.clear()  # nothing delivered yet: hold them back
    # Three in flight (the window), each starting where the previous one ended.
    assert [m.index for m in appends] == [first - 1, first, first + 1]
    assert [len(m.entries) for m in appends] == [1, 1, 1]
    assert leader.core.status()["progress"][2]["inflight"] == 3
    assert leader.core.status()["progress"][2]["state"] == "REPLICATE"
    for msg in appends:
        cluster.deliver(msg)
    cluster.stabilize()  # the answers open the window for the rest
    assert payloads(cluster[2]) == [b"p%d" % i for i in range(5)]


def test_batching_many_proposals_in_one_ready_and_few_appends():
    cluster = Cluster(max_entries_per_append=40)
    leader = cluster.elect(1)
    indices = [leader.core.propose(b"b%03d" % i) for i in range(100)]
    assert indices == list(range(indices[0], indices[0] + 100))
    rd = leader.handle_ready()
    assert len(rd.entries) == 100
    appends = sent(rd, MT.APPEND, to=2)
    assert [len(m.entries) for m in appends] == [40, 40, 20]
    cluster.stabilize()
    assert len(payloads(cluster[3])) == 100


def test_max_bytes_per_append_splits_large_entries():
    cluster = Cluster(max_bytes_per_append=2000)
    leader = cluster.elect(1)
    for _ in range(4):
        leader.core.propose(b"x" * 900)
    appends = sent(leader.handle_ready(), MT.APPEND, to=2)
    assert [len(m.entries) for m in appends] == [2, 2]
    cluster.stabilize()
    assert len(payloads(cluster[2])) == 4


def test_duplicated_and_reordered_messages_are_harmless():
    cluster = Cluster()
    leader = cluster.elect(1)
    for i in range(3):
        leader.core.propose(b"d%d" % i)
        leader.handle_ready()
    messages = list(cluster.in_flight)
    cluster.in_flight.clear()
    # Deliver everything backwards, then twice more in order.
    for msg in [*reversed(messages), *messages, *messages]:
        cluster.deliver(msg)
    cluster.stabilize()
    cluster.tick(2)
    for node in cluster.nodes.values():
        assert payloads(node) == [b"d0", b"d1", b"d2"]
    # Replay every message ever seen by node 2: nothing changes.
    old = [m for node in cluster.nodes.values() for rd in node.readies for m in rd.messages]
    def log_state(node: Node) -> tuple:
        return node.core.last_index, node.core.commit_index, node.log_terms()

    before = log_state(cluster[2])
    for msg in old:
        cluster.deliver(msg)
    cluster.stabilize()
    assert log_state(cluster[2]) == before


def test_unknown_and_misaddressed_senders_are_tolerated():
    cluster = Cluster()
    leader = cluster.elect(1)
    core = leader.core
    core.step(Message(MT.APPEND_RESPONSE, 1, 99, core.term, index=5))
    core.step(Message(MT.HEARTBEAT_RESPONSE, 1, 99, core.term, context=b"junk"))
    core.step(Message(MT.APPEND, 7, 2, core.term))  # not for us
    core.step(Message(MT.APPEND_RESPONSE, 1, 2, core.term, index=10_000))  # beyond our log
    assert core.role == Role.LEADER and 99 not in core.status()["progress"]
    cluster.stabilize()
    leader.core.propose(b"fine")
    cluster.stabilize()
    assert payloads(cluster[3]) == [b"fine"]


def test_a_term_at_the_end_of_the_u64_range_is_dropped():
    """A peer's message with a term near 2**64 would leave no term to campaign at: the next
    election's messages would not encode. Such a term is a lie; the message is dropped."""
    cluster = Cluster()
    cluster.elect(1)
    follower = cluster[2]
    term = follower.core.term
    for lie in ((1 << 64) - 1, 1 << 63):
        follower.core.step(Message(MT.HEARTBEAT, 2, 4, lie))
        follower.core.step(Message(MT.APPEND, 2, 4, lie, index=follower.core.last_index))
        assert follower.core.term == term
    follower.core.campaign()
    for msg in follower.core.ready().messages:
        assert decode_message(encode_message(msg)) == msg


def _follower_log(node: Node) -> list[tuple[int, int]]:
    return [(e.index, e.term) for e in node.core._log._entries]


@pytest.mark.parametrize("lie", [
    "gap",  # the entries do not start right after index
    "shuffled",  # they are not in index order
    "future_term",  # an entry of a term later than the message's
    "term_going_back",  # terms decrease along the entries
])
def test_append_with_entries_that_cannot_follow_index_is_dropped(lie):
    """A leader's entries follow (index, log_term) one by one, in terms that never decrease
    and never pass its own. Entries that do not are a lie, dropped without touching the log
    (it would otherwise hold entries at the wrong positions, or break on a committed one)."""
    cluster = Cluster()
    leader = cluster.elect(1)
    leader.core.propose(b"a")
    cluster.stabilize()
    follower = cluster[2]
    core = follower.core
    last, term = core.last_index, core.term
    entries = {
        "gap": (Entry(term, last + 5),),
        "shuffled": (Entry(term, last + 2), Entry(term, last + 1)),
        "future_term": (Entry(term + 3, last + 1),),
        "term_going_back": (Entry(term, last + 1), Entry(term - 1, last + 2)),
    }[lie]
    before = _follower_log(follower), core.commit_index
    core.step(Message(MT.APPEND, 2, 1, term, log_term=term, index=last, entries=entries,
                      commit=last + 2))
    assert (_follower_log(follower), core.commit_index) == before
    cluster.stabilize()
    leader.core.propose(b"b")
    cluster.stabilize()
    assert payloads(follower) == [b"a", b"b"]


@pytest.mark.parametrize("lie", ["future_term", "index_past_2_63"])
def test_snapshot_that_no_leader_can_hold_is_dropped(lie):
    """A snapshot of a term later than its message's, or at an index no log reaches, would
    leave the log's terms going back or no index to append at: dropped."""
    cluster = Cluster()
    cluster.elect(1)
    follower = cluster[2]
    core = follower.core
    term = core.term
    meta = {"future_term": SnapshotMeta(core.last_index + 5, term + 1, ConfState((1, 2, 3))),
            "index_past_2_63": SnapshotMeta(1 << 63, term, ConfState((1, 2, 3)))}[lie]
    before = _follower_log(follower), core.commit_index, core._log.snapshot_index
    core.step(Message(MT.SNAPSHOT, 2, 1, term, snapshot=Snapshot(meta, b"")))
    assert (_follower_log(follower), core.commit_index, core._log.snapshot_index) == before


def test_append_rewriting_a_committed_entry_is_dropped():
    """A 'leader' whose entries would replace a committed one is lying: drop the message
    rather than fail on the committed entry."""
    cluster = Cluster()
    leader = cluster.elect(1)
    leader.core.propose(b"a")
    cluster.stabilize()
    follower = cluster[2]
    core = follower.core
    commit, term = core.commit_index, core.term
    before = _follower_log(follower)
    core.step(Message(MT.APPEND, 2, 3, term + 1, log_term=core._log.term_at(commit),
                      index=commit, entries=(Entry(term + 1, commit),), commit=commit))
    assert _follower_log(follower) == before and core.commit_index == commit


def test_report_unreachable_goes_back_to_probing():
    cluster = Cluster()
    leader = cluster.elect(1)
    assert leader.core.status()["progress"][2]["state"] == "REPLICATE"
    leader.core.report_unreachable(2)
    assert leader.core.status()["progress"][2]["state"] == "PROBE"
    leader.core.propose(b"again")
    cluster.stabilize()
    assert leader.core.status()["progress"][2]["state"] == "REPLICATE"
    assert payloads(cluster[2]) == [b"again"]


# ---------------------------------------------------------------------- snapshots


def test_lagging_follower_gets_the_snapshot_after_compaction():
    cluster = Cluster()
    leader = cluster.elect(1)
    cluster.isolate(3)
    for i in range(20):
        leader.core.propose(b"s%d" % i)
    cluster.stabilize()
    snapshot = leader.compact()
    assert leader.core.status()["first_index"] == snapshot.meta.index + 1
    leader.core.propose(b"after")
    cluster.stabilize()
    cluster.heal()
    cluster.tick(2)
    lagging = cluster[3]
    installed = [rd.snapshot for rd in lagging.readies if rd.snapshot is not None]
    assert installed == [snapshot]
    assert lagging.core.conf_state == ConfState((1, 2, 3))
    assert payloads(lagging) == [b"s%d" % i for i in range(20)] + [b"after"]
    assert lagging.core.status()["first_index"] == snapshot.meta.index + 1
    assert leader.core.status()["progress"][3]["state"] == "REPLICATE"
    # It restarts from its new disk (snapshot + entries) and keeps up.
    lagging.restart()
    leader.core.propose(b"later")
    cluster.stabilize()
    assert payloads(lagging)[-2:] == [b"after", b"later"]


def test_recovery_drops_a_stale_suffix_after_an_installed_snapshot():
    # The node installed a snapshot at 3 (term 4) and crashed before its old, conflicting
    # entries 4..5 (term 2) were dropped from the store.
    snapshot = Snapshot(SnapshotMeta(3, 4, ConfState((1, 2, 3))), b"")
    core = RaftCore(RaftConfig(2), random.Random(1), hard_state=HardState(4, 0, 3),
                    snapshot=snapshot, entries=[Entry(2, 4), Entry(2, 5)])
    assert core.last_index == 3 and core.commit_index == 3
    with pytest.raises(ValueError):  # a gap is damage, not staleness
        RaftCore(RaftConfig(2), random.Random(1), snapshot=snapshot, entries=[Entry(4, 5)])


def test_failed_snapshot_is_resent():
    cluster = Cluster()
    leader = cluster.elect(1)
    cluster.isolate(3)
    for i in range(5):
        leader.core.propose(b"%d" % i)
    cluster.stabilize()
    leader.compact()
    cluster.heal()
    cluster.drop = lambda m: m.type == MT.SNAPSHOT  # the first transfer fails
    cluster.tick(1)
    assert leader.core.status()["progress"][3]["state"] == "PROBE"
    cluster.drop = None
    cluster.tick(2)
    assert payloads(cluster[3]) == [b"%d" % i for i in range(5)]


def test_compact_checks_its_input():
    cluster = Cluster()
    leader = cluster.elect(1)
    applied, conf = leader.applied_index, leader.core.conf_state
    term = leader.term_at(applied)
    with pytest.raises(ValueError):
        leader.core.compact(Snapshot(SnapshotMeta(applied + 1, term, conf)))  # not applied yet
    with pytest.raises(ValueError):
        leader.core.compact(Snapshot(SnapshotMeta(applied, term + 1, conf)))  # wrong term


# ---------------------------------------------------------------------- membership


def test_learner_joins_catches_up_is_promoted_and_members_are_removed():
    cluster = Cluster(joiners=(4,))
    cluster.tick(40, nodes=[4])  # a node that is no voter never campaigns
    assert cluster[4].core.term == 0 and not cluster[4].readies
    leader = cluster.elect(1)
    leader.core.propose(b"before 4")
    cluster.stabilize()
    leader.core.propose_conf_change(ConfChange(ConfChangeKind.ADD_LEARNER, 4, b"addr-4"))
    with pytest.raises(ProposalDropped):  # one change at a time
        leader.core.propose_conf_change(ConfChange(ConfChangeKind.ADD_LEARNER, 5))
    cluster.stabilize()
    learner = cluster[4]
    # It learned the bootstrap membership and its own addition from the log.
    assert learner.core.conf_state == ConfState((1, 2, 3), (4,))
    assert learner.core.role == Role.LEARNER
    assert payloads(learner) == [b"before 4"]

    # A learner does not count toward the quorum...
    cluster.isolate(2)
    cluster.isolate(3)
    cluster.blocked -= {(1, 4), (4, 1)}
    index = leader.core.propose(b"needs a voter")
    cluster.stabilize()
    assert learner.core.last_index >= index and leader.core.commit_index < index
    # ...and never campaigns, even when the leader goes away.
    cluster.isolate(1)
    term = learner.core.term
    cluster.tick(40, nodes=[4])
    learner.core.step(Message(MT.TIMEOUT_NOW, 4, 1, term))
    learner.core.campaign()
    assert learner.core.term == term and learner.core.role == Role.LEARNER
    assert not learner.core.has_ready()
    cluster.heal()
    cluster.stabilize()

    for bad in (ConfChange(ConfChangeKind.PROMOTE, 2), ConfChange(ConfChangeKind.ADD_LEARNER, 4),
                ConfChange(ConfChangeKind.REMOVE, 9), ConfChange(ConfChangeKind.ADD_VOTER, 9)):
        with pytest.raises(ProposalDropped):
            leader.core.propose_conf_change(bad)
    leader.core.propose_conf_change(ConfChange(ConfChangeKind.PROMOTE, 4))
    cluster.stabilize()
    for node in cluster.nodes.values():
        assert node.core.conf_state == ConfState((1, 2, 3, 4))
    assert learner.core.role == Role.FOLLOWER

    leader.core.propose_conf_change(ConfChange(ConfChangeKind.REMOVE, 3))
    cluster.stabilize()
    assert leader.core.conf_state == ConfState((1, 2, 4))
    assert 3 not in leader.core.status()["progress"]
    cluster.isolate(3)
    term = cluster[3].core.term
    cluster.tick(40, nodes=[3])  # removed: never campaigns again
    assert cluster[3].core.term == term
    cluster.heal()

    # The leader removes itself: it steps down and the others elect among themselves.
    leader.core.propose_conf_change(ConfChange(ConfChangeKind.REMOVE, 1))
    cluster.stabilize()
    assert leader.core.role == Role.FOLLOWER
    assert leader.core.conf_state == ConfState((2, 4))
    new = cluster.tick_until_leader((2, 4))
    new.core.propose(b"two voters")
    cluster.stabilize()
    assert payloads(cluster[2])[-1] == payloads(cluster[4])[-1] == b"two voters"
    assert cluster[1].core.term < new.core.term or cluster[1].core.leader_id == new.id


def test_cannot_remove_the_last_voter():
    cluster = Cluster((1,))
    leader = cluster.elect(1)
    with pytest.raises(ProposalDropped):
        leader.core.propose_conf_change(ConfChange(ConfChangeKind.REMOVE, 1))


def test_joiner_after_compaction_learns_membership_from_the_snapshot():
    cluster = Cluster((1,), joiners=(2,))
    leader = cluster.elect(1)
    for i in range(5):
        leader.core.propose(b"%d" % i)
    cluster.stabilize()
    snapshot = leader.compact()
    leader.core.propose_conf_change(ConfChange(ConfChangeKind.ADD_LEARNER, 2))
    cluster.stabilize()
    joiner = cluster[2]
    assert [rd.snapshot for rd in joiner.readies if rd.snapshot] == [snapshot]
    assert joiner.core.conf_state == ConfState((1,), (2,))
    leader.core.propose_conf_change(ConfChange(ConfChangeKind.PROMOTE, 2))
    cluster.stabilize()
    assert joiner.core.conf_state == ConfState((1, 2)) and joiner.core.role == Role.FOLLOWER
    assert payloads(joiner) == [b"%d" % i for i in range(5)]


# ---------------------------------------------------------------------- leadership transfer


def test_transfer_leadership_to_a_lagging_follower():
    cluster = Cluster()
    old = cluster.elect(1)
    cluster.isolate(3)
    old.core.propose(b"3 misses this")
    cluster.stabilize()
    cluster.heal()
    term = old.core.term
    old.core.transfer_leader(3)
    assert old.core.status()["transferring_to"] == 3
    with pytest.raises(ProposalDropped):
        old.core.propose(b"refused during the transfer")
    cluster.stabilize()  # catch up, TIMEOUT_NOW, a vote that check-quorum followers accept
    new = cluster[3]
    assert new.core.role == Role.LEADER and new.core.term == term + 1
    assert old.core.role == Role.FOLLOWER and old.core.leader_id == 3
    timeouts = [m for rd in old.readies for m in sent(rd, MT.TIMEOUT_NOW)]
    assert len(timeouts) == 1 and timeouts[0].to == 3
    votes = [m for rd in new.readies for m in sent(rd, MT.VOTE)]
    assert votes and all(m.context == TRANSFER_CONTEXT for m in votes)
    assert not any(sent(rd, MT.PRE_VOTE) for rd in new.readies)  # skipped pre-vote
    new.core.propose(b"after")
    cluster.stabilize()
    assert payloads(cluster[2]) == [b"3 misses this", b"after"]


def test_transfer_is_aborted_after_an_election_timeout():
    cluster = Cluster()
    leader = cluster.elect(1)
    cluster.isolate(3)
    leader.core.propose(b"x")
    cluster.stabilize()
    leader.core.transfer_leader(3)
    cluster.tick(leader.config.election_ticks)
    assert leader.core.status()["transferring_to"] == 0
    assert leader.core.role == Role.LEADER
    leader.core.propose(b"accepted again")


# ---------------------------------------------------------------------- linearizable reads


def test_read_index_safe_is_confirmed_by_a_heartbeat_round():
    cluster = Cluster()
    leader = cluster.elect(1)
    leader.core.propose(b"w")
    cluster.stabilize()
    commit = leader.core.commit_index
    leader.core.read_index(b"r1")
    leader.core.read_index(b"r2")
    rd = leader.handle_ready()
    assert rd.read_states == []
    assert len(sent(rd, MT.HEARTBEAT)) == 2  # one round for both reads
    cluster.stabilize()
    assert leader.read_states == [ReadState(commit, b"r1"), ReadState(commit, b"r2")]


def test_read_index_is_not_answered_by_a_partitioned_old_leader():
    cluster = Cluster()
    old = cluster.elect(1)
    cluster.isolate(1)
    new = cluster.tick_until_leader((2, 3))
    new.core.propose(b"newer write")
    cluster.stabilize()
    if old.core.role == Role.LEADER:  # it may not have noticed yet
        old.core.read_index(b"stale")
    cluster.tick(3 * old.config.election_ticks, nodes=[1])
    assert old.read_states == []
    assert old.core.role != Role.LEADER
    new.core.read_index(b"fresh")
    cluster.stabilize()
    assert new.read_states == [ReadState(new.core.commit_index, b"fresh")]


def test_new_leader_answers_reads_only_after_committing_in_its_term():
    cluster = Cluster()
    cluster.stabilize()
    cluster.drop = lambda m: m.type == MT.APPEND_RESPONSE  # the no-op cannot commit
    leader = cluster.elect(1)
    leader.core.read_index(b"early")
    cluster.tick(2)
    assert leader.read_states == [] and leader.core.commit_index < leader.core.last_index
    cluster.drop = None
    cluster.tick(1)
    assert leader.read_states == [ReadState(leader.core.last_index, b"early")]


def test_read_index_lease_answers_at_once_and_expires_before_a_new_leader():
    cluster = Cluster(read_only="lease")
    leader = cluster.elect(1)
    cluster.tick(1)  # a heartbeat round: the lease starts
    leader.core.read_index(b"lease")
    rd = leader.handle_ready()
    assert rd.read_states == [ReadState(leader.core.commit_index, b"lease")]
    assert rd.messages == []  # no heartbeat needed

    cluster.isolate(1)
    lease_reads_ticks, new_leader_tick = [], None
    for tick in range(1, 40):
        cluster.tick(1)
        if leader.core.role == Role.LEADER:
            leader.core.read_index(b"t%d" % tick)
            if leader.handle_ready().read_states:
                lease_reads_ticks.append(tick)
        if new_leader_tick is None and cluster.leader() not in (None, leader):
            new_leader_tick = tick
    assert lease_reads_ticks, "the lease should hold for a while after the partition"
    assert new_leader_tick is not None
    assert max(lease_reads_ticks) < new_leader_tick


def test_restarted_followers_do_not_vote_while_a_lease_may_hold():
    cluster = Cluster(read_only="lease")
    leader = cluster.elect(1)
    cluster.tick(1)
    cluster.isolate(1)
    # Both followers crash and forget they just heard from node 1.
    cluster[2].restart()
    cluster[3].restart()
    cluster.stabilize()
    cluster[2].core.campaign()
    cluster.stabilize()
    assert cluster[2].core.role != Role.LEADER  # node 3 still keeps quiet
    lease_reads_ticks, new_leader_tick = [], None
    for tick in range(1, 40):
        cluster.tick(1)
        if leader.core.role == Role.LEADER:
            leader.core.read_index(b"t%d" % tick)
            if leader.handle_ready().read_states:
                lease_reads_ticks.append(tick)
        if new_leader_tick is None and cluster.leader() not in (None, leader):
            new_leader_tick = tick
    assert lease_reads_ticks and new_leader_tick is not None
    assert max(lease_reads_ticks) < new_leader_tick


def test_lease_is_given_up_once_a_transfer_starts():
    cluster = Cluster(read_only="lease")
    leader = cluster.elect(1)
    cluster.tick(1)
    cluster.isolate(2)
    leader.core.transfer_leader(3)  # up to date: TIMEOUT_NOW goes at once
    cluster.drop = lambda m: m.type == MT.TIMEOUT_NOW and m.to == 3
    cluster.stabilize()
    leader.core.read_index(b"no lease")
    assert leader.handle_ready().read_states == []


# ---------------------------------------------------------------------- chaos and determinism


CHAOS_MEMBERSHIP = [
    ConfChange(ConfChangeKind.ADD_LEARNER, 4),
    ConfChange(ConfChangeKind.PROMOTE, 4),
    ConfChange(ConfChangeKind.REMOVE, 2),
]


def run_chaos(seed: int, steps: int = 1500, read_only: str = "safe") -> Cluster:
    """Random ticks, proposals, reads, restarts, compactions, transfers and membership changes
    over a network that drops, duplicates, delays and reorders messages.

    Reads are checked for linearizability as they are answered: a read's index must cover
    everything any node knew to be committed when the read was asked."""
    cluster = Cluster(joiners=(4,), seed=seed, max_inflight_appends=4, read_only=read_only)
    rng = random.Random(seed)
    cluster.stabilize()
    proposals = reads = 0
    membership = list(CHAOS_MEMBERSHIP)
    for _ in range(steps):
        action = rng.random()
        leader = cluster.leader()
        if action < 0.25:
            for node in cluster.nodes.values():
                node.core.tick()
        elif action < 0.4:
            if leader is not None:
                try:
                    leader.core.propose(b"c%d" % proposals)
                    proposals += 1
                except ProposalDropped:
                    pass
        elif action < 0.47:
            # Any node that believes it leads, stale or not.
            node = cluster[rng.choice(sorted(cluster.nodes))]
            if node.core.role == Role.LEADER:
                context = b"r%d" % reads
                reads += 1
                known = max(n.core.commit_index for n in cluster.nodes.values())
                cluster.read_floors[context] = known
                try:
                    node.core.read_index(context)
                except ProposalDropped:
                    pass
        elif action < 0.49:
            cluster[rng.choice(sorted(cluster.nodes))].restart()  # unpersisted work is lost
        elif action < 0.51:
            node = cluster[rng.choice(sorted(cluster.nodes))]
            if node.applied_index > (node.snapshot.meta.index if node.snapshot else 0):
                node.compact()
        elif action < 0.52:
            if leader is not None and membership:
                try:
                    leader.core.propose_conf_change(membership[0])
                    membership.pop(0)
                except ProposalDropped:
                    pass
        elif action < 0.53:
            if leader is not None:
                target = rng.choice(sorted(leader.core.conf_state.voters))
                leader.core.transfer_leader(target)
        else:
            batch, cluster.in_flight = cluster.in_flight, []
            rng.shuffle(batch)
            for msg in batch:
                fate = rng.random()
                if fate < 0.1:
                    cluster.lose(msg)
                elif fate < 0.25:
                    cluster.deliver(msg)
                    cluster.deliver(msg)
                elif fate < 0.4:
                    cluster.in_flight.append(msg)  # delayed
                else:
                    cluster.deliver(msg)
        cluster.process_all()
    # Heal: ordinary delivery, and time for a leader to settle everything.
    for _ in range(60):
        cluster.tick()
    cluster.membership_left = membership
    return cluster


@pytest.mark.parametrize("read_only", ["safe", "lease"])
@pytest.mark.parametrize("seed", range(5))
def test_chaos_network_stays_safe_and_converges(seed, read_only):
    cluster = run_chaos(seed, read_only=read_only)
    leader = cluster.leader()
    assert leader is not None
    members = leader.core.conf_state.voters + leader.core.conf_state.learners
    states = [payloads(cluster[node]) for node in members]
    assert all(state == states[0] for state in states)
    assert leader.core.commit_index == leader.core.last_index
    assert len(set(states[0])) == len(states[0])  # nothing applied twice
    assert len(states[0]) > 50
    assert cluster.reads_answered > 5


def test_same_seed_same_readies():
    first = run_chaos(11, steps=400).transcript
    second = run_chaos(11, steps=400).transcript
    assert len(first) > 100
    assert first == second
    assert run_chaos(12, steps=400).transcript != first
