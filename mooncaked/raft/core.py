"""The Raft consensus core: a deterministic state machine with no I/O, no clock, no threads.

Inputs are ticks (abstract time), messages from peers and requests from the driver; outputs
come out in `Ready` batches. Randomness (the election timeout) comes only from the `rng` the
driver passes, so the same inputs always produce the same Readies.

The driver's loop (see `Ready` in types.py for the ordering duties):

    core = RaftCore(RaftConfig(node_id=1), random.Random(seed), hard_state=..., snapshot=...,
                    entries=..., conf_state=...)
    on a timer:           core.tick()
    on a peer's message:  core.step(msg)
    on a client request:  core.propose(data) / core.read_index(context)   (leader only)
    while core.has_ready():
        rd = core.ready()
        1. persist rd.hard_state, rd.snapshot, rd.entries
        2. send rd.messages (losing some is fine: Raft retries)
        3. restore rd.snapshot, then apply rd.committed_entries in order; for each CONF_CHANGE
           entry call core.apply_conf_change(codec.decode_conf_change(entry.data))
        4. answer rd.read_states once the applied index reaches theirs
        5. core.advance(rd)
    for every SNAPSHOT message sent: core.report_snapshot(to, ok) once the transfer ends
    when a send fails: core.report_unreachable(to)

Bootstrap: a brand-new cluster's nodes each start with `conf_state` (and nothing else). The core
then writes one ADD_VOTER (or ADD_LEARNER) CONF_CHANGE entry per member at term 1, already
committed, so the initial membership is in the log like any later change and a node that joins
later learns it by replicating the log. Every bootstrapping node writes identical entries.

Membership takes effect when the driver applies a CONF_CHANGE entry (etcd's rule), one change at
a time, so any two successive configurations share a majority.
"""

from __future__ import annotations

import random
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.raft.codec import encode_conf_change
from mooncaked.raft.log import RaftLog
from mooncaked.raft.progress import (
    Inflights,
    Progress,
    ProgressState,
    VoteResult,
    quorum_size,
    quorum_value,
    tally_votes,
)
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
    SoftState,
)

# A vote request carrying this context comes from a leadership transfer: followers grant it
# even while they still hear from the current leader (who asked for it).
TRANSFER_CONTEXT = b"transfer"

# Queue bounds. Messages past MAX_OUTBOX_MESSAGES are dropped (counted in status()): Raft
# tolerates lost messages, and a driver that never drains Readies should not grow us forever.
MAX_OUTBOX_MESSAGES = 65536
MAX_PENDING_READS = 4096

# Terms grow by one per election and indexes by one per entry, so no cluster comes near these.
# A message with a larger term, or a snapshot past MAX_INDEX, is a lie: adopting it could
# leave no term to campaign at or no index to append at (both are u64 on the wire). Dropped.
MAX_TERM = (1 << 63) - 1
MAX_INDEX = (1 << 63) - 1

# A heartbeat carries (round, leader tick at send); the follower echoes it back.
_HEARTBEAT_CONTEXT = struct.Struct(">QQ")

MT = MessageType


@dataclass(frozen=True)
class RaftConfig:
    node_id: int  # > 0
    election_ticks: int = 10  # election timeout randomised in [election_ticks, 2*election_ticks)
    heartbeat_ticks: int = 1
    pre_vote: bool = True
    # The leader steps down if it has not heard from a quorum within election_ticks; a follower
    # that heard from a leader within election_ticks ignores (pre)vote requests, except those of
    # a leadership transfer.
    check_quorum: bool = True
    # "safe": a read index is confirmed by a heartbeat round acknowledged by a quorum.
    # "lease": the leader answers at once while its check-quorum lease holds (else as "safe").
    read_only: str = "safe"
    max_inflight_appends: int = 64  # pipelining window of APPEND messages per follower
    max_entries_per_append: int = 512
    max_bytes_per_append: int = 1 << 20
    max_uncommitted_entries: int = 10000  # proposals past this are refused (bounded memory)
    # The driver's write of a Ready's entries makes them durable (no separate sync to wait
    # for), and it writes them before it applies that Ready's committed entries or lets
    # anything else run. Then the leader counts its own new entries when it hands them out,
    # so an entry a single voter proposes commits in the same Ready. With a sync to wait for,
    # leave it False: the leader's own ack must wait for advance(), after the sync.
    entries_durable_when_written: bool = False

    def __post_init__(self) -> None:
        if self.node_id <= 0:
            raise ValueError("node_id must be > 0")
        if self.heartbeat_ticks < 1 or self.election_ticks <= self.heartbeat_ticks:
            raise ValueError("need 1 <= heartbeat_ticks < election_ticks")
        if self.read_only not in ("safe", "lease"):
            raise ValueError(f"read_only must be 'safe' or 'lease', not {self.read_only!r}")
        if self.read_only == "lease" and (not self.check_quorum or self.election_ticks < 3):
            raise ValueError("lease reads need check_quorum and election_ticks >= 3")
        for name in ("max_inflight_appends", "max_entries_per_append", "max_bytes_per_append",
                     "max_uncommitted_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class _PendingRead:
    round: int  # confirmed once a quorum answered a heartbeat round >= this
    index: int
    context: bytes


class RaftCore:
    def __init__(
        self,
        config: RaftConfig,
        rng: random.Random,
        *,
        hard_state: HardState = HardState(),
        snapshot: Snapshot | None = None,
        entries: Sequence[Entry] = (),
        conf_state: ConfState | None = None,
    ) -> None:
        """Restore from what the durable log recovered: the hard state, the latest snapshot and
        the entries after it. `conf_state` is the initial membership of a brand-new cluster (or,
        on a restart without a snapshot, the membership the log's entries start from); a node
        joining an existing cluster passes None and learns membership from the leader."""
        self.config = config
        self.node_id = config.node_id
        self._rng = rng
        self._log = RaftLog(snapshot, entries)
        if hard_state.commit > self._log.last_index:
            raise ValueError(f"hard state commit {hard_state.commit} is past the last entry "
                             f"{self._log.last_index}")
        self._log.commit_index = max(hard_state.commit, self._log.snapshot_index)
        if snapshot is not None:
            self.conf_state = _normalized(snapshot.meta.conf_state)
        else:
            self.conf_state = _normalized(conf_state or ConfState(()))
        self.term = hard_state.term
        self.vote = hard_state.vote
        self._prev_hard = hard_state  # what the driver has on disk

        brand_new = snapshot is None and not entries and hard_state == HardState()
        if brand_new and self.conf_state.voters:
            self._bootstrap()

        self.role = Role.FOLLOWER
        self.leader_id = 0
        self._now_ticks = 0
        self._election_elapsed_ticks = 0
        self._heartbeat_elapsed_ticks = 0
        self._randomized_election_ticks = config.election_ticks
        self._transfer_elapsed_ticks = 0
        self._transferee = 0
        self._votes: dict[int, bool] = {}
        self._progress: dict[int, Progress] = {}
        self._pending_conf_index = 0
        self._outbox: list[Message] = []
        self._dropped_messages = 0
        self._read_states: list[ReadState] = []
        self._reads_awaiting_commit: deque[bytes] = deque()  # a new leader's reads
        self._pending_reads: deque[_PendingRead] = deque()
        self._heartbeat_round = 0
        self._read_round_wanted = False
        self._lease_revoked = False
        self._entries_to_send = False  # batched: APPENDs go out when the next Ready is built
        self._commit_to_send = False
        # Lease reads assume a follower that answered the leader refuses votes for an election
        # timeout. A restarted node forgot whom it heard from, so it keeps quiet that long.
        restarted = not brand_new
        lease = config.read_only == "lease"
        self._vote_quiet_ticks = config.election_ticks if restarted and lease else 0

        self._become_follower(self.term, 0)
        self._prev_soft = SoftState(self.leader_id, self.role)

    def _bootstrap(self) -> None:
        changes = [ConfChange(ConfChangeKind.ADD_VOTER, node) for node in self.conf_state.voters]
        changes += [ConfChange(ConfChangeKind.ADD_LEARNER, node)
                    for node in self.conf_state.learners]
        self._log.append(
            [Entry(1, index, EntryKind.CONF_CHANGE, encode_conf_change(change))
             for index, change in enumerate(changes, start=1)]
        )
        self._log.commit_index = len(changes)
        self.term = 1

    # ------------------------------------------------------------------ state

    @property
    def commit_index(self) -> int:
        return self._log.commit_index

    @property
    def applied_index(self) -> int:
        return self._log.applied_index

    @property
    def last_index(self) -> int:
        return self._log.last_index

    @property
    def first_index(self) -> int:
        return self._log.first_index

    def status(self) -> dict:
        progress = {}
        if self.role == Role.LEADER:
            progress = {node: pr.summary() for node, pr in sorted(self._progress.items())}
        return {
            "id": self.node_id,
            "term": self.term,
            "vote": self.vote,
            "leader": self.leader_id,
            "role": self.role.name,
            "commit": self._log.commit_index,
            "applied": self._log.applied_index,
            "last_index": self._log.last_index,
            "first_index": self._log.first_index,
            "voters": list(self.conf_state.voters),
            "learners": list(self.conf_state.learners),
            "progress": progress,
            "transferring_to": self._transferee,
            "dropped_messages": self._dropped_messages,
        }

    def _promotable(self) -> bool:
        return self.node_id in self.conf_state.voters

    def _members(self) -> tuple[int, ...]:
        return self.conf_state.voters + self.conf_state.learners

    def _peers(self) -> list[int]:
        return [node for node in self._members() if node != self.node_id]

    def _quorum(self) -> int:
        return quorum_size(len(self.conf_state.voters))

    # ------------------------------------------------------------------ role changes

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = 0
        self.leader_id = 0
        self._election_elapsed_ticks = 0
        self._heartbeat_elapsed_ticks = 0
        self._randomized_election_ticks = self.config.election_ticks + self._rng.randrange(
            self.config.election_ticks
        )
        self._votes = {}
        self._progress = {}
        self._transferee = 0
        self._transfer_elapsed_ticks = 0
        # Reads in flight die with the leadership; the driver sees the role change in the
        # Ready's soft state and fails (or retries) them.
        self._reads_awaiting_commit.clear()
        self._pending_reads.clear()
        self._read_round_wanted = False
        self._entries_to_send = False
        self._commit_to_send = False

    def _become_follower(self, term: int, leader: int) -> None:
        self._reset(term)
        self.leader_id = leader
        self.role = Role.LEARNER if self.node_id in self.conf_state.learners else Role.FOLLOWER

    def _become_pre_candidate(self) -> None:
        # A pre-candidate asks whether it could win at term + 1 without touching its own term
        # or vote, so a node that cannot win (e.g. one just back from a partition) disrupts no one.
        self._votes = {}
        self.leader_id = 0
        self.role = Role.PRE_CANDIDATE

    def _become_candidate(self) -> None:
        self._reset(self.term + 1)
        self.vote = self.node_id
        self.role = Role.CANDIDATE

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.leader_id = self.node_id
        self.role = Role.LEADER
        for node in self._members():
            self._progress[node] = self._new_progress(node)
        for node, pr in self._progress.items():
            pr.recent_active = node == self.node_id  # peers must prove themselves in time
        own = self._progress[self.node_id]
        own.maybe_update(self._log.persisted_index)
        own.become_replicate()
        # Any conf change in the uncommitted tail may still be pending: refuse another until
        # everything up to here is applied.
        self._pending_conf_index = self._log.last_index
        self._lease_revoked = False
        # The no-op of the new term: committing it commits every earlier entry (Raft 5.4.2)
        # and tells this leader its commit index is current (needed before serving reads).
        self._log.append([Entry(self.term, self._log.last_index + 1)])
        self._entries_to_send = True

    def _new_progress(self, node: int) -> Progress:
        return Progress(
            inflights=Inflights(self.config.max_inflight_appends),
            next=self._log.last_index + 1,
            learner=node in self.conf_state.learners,
            recent_active=True,  # a new member gets a full check-quorum round to answer
        )

    # ------------------------------------------------------------------ ticks

    def tick(self) -> None:
        self._now_ticks += 1
        if self._vote_quiet_ticks:
            self._vote_quiet_ticks -= 1
        if self.role == Role.LEADER:
            self._tick_leader()
        else:
            self._tick_election()

    def _tick_election(self) -> None:
        self._election_elapsed_ticks += 1
        if self._promotable() and self._election_elapsed_ticks >= self._randomized_election_ticks:
            self._election_elapsed_ticks = 0
            self._campaign(transfer=False)

    def _tick_leader(self) -> None:
        self._election_elapsed_ticks += 1
        self._heartbeat_elapsed_ticks += 1
        if self._transferee:
            self._transfer_elapsed_ticks += 1
            if self._transfer_elapsed_ticks >= self.config.election_ticks:
                self._abort_transfer()
        if self._election_elapsed_ticks >= self.config.election_ticks:
            self._election_elapsed_ticks = 0
            if self.config.check_quorum:
                if not self._quorum_recently_active():
                    self._become_follower(self.term, 0)
                    return
                for node, pr in self._progress.items():
                    pr.recent_active = node == self.node_id
        if self._heartbeat_elapsed_ticks >= self.config.heartbeat_ticks:
            self._heartbeat_elapsed_ticks = 0
            self._broadcast_heartbeat()

    def _quorum_recently_active(self) -> bool:
        active = sum(
            1 for voter in self.conf_state.voters
            if voter == self.node_id
            or (voter in self._progress and self._progress[voter].recent_active)
        )
        return active >= self._quorum()

    def _heard_from_leader_recently(self) -> bool:
        if self._vote_quiet_ticks:
            return True
        return (
            self.config.check_quorum
            and self.leader_id != 0
            and self._election_elapsed_ticks < self.config.election_ticks
        )

    # ------------------------------------------------------------------ elections

    def campaign(self) -> None:
        """Start an election now (with pre-vote if configured), as if the timeout fired.
        Mainly for tests and for a driver that wants a fresh cluster to elect at once."""
        if self.role != Role.LEADER:
            self._campaign(transfer=False)

    def _campaign(self, transfer: bool) -> None:
        if not self._promotable():
            return
        # A committed but unapplied membership change may remove us or change the quorum:
        # wait until it is applied.
        if self._log.has_conf_change_between(self._log.applied_index + 1, self._log.commit_index):
            return
        if self.config.pre_vote and not transfer:
            self._become_pre_candidate()
        else:
            self._become_candidate()
        self._request_votes(transfer)

    def _request_votes(self, transfer: bool = False) -> None:
        pre_vote = self.role == Role.PRE_CANDIDATE
        self._votes[self.node_id] = True
        if self._tally_votes():
            return  # a single voter
        for voter in self.conf_state.voters:
            if voter != self.node_id:
                self._send(Message(
                    MT.PRE_VOTE if pre_vote else MT.VOTE, voter, self.node_id,
                    self.term + 1 if pre_vote else self.term,
                    log_term=self._log.last_term, index=self._log.last_index,
                    context=TRANSFER_CONTEXT if transfer else b"",
                ))

    def _tally_votes(self) -> bool:
        """Act on the votes so far; returns whether the election ended."""
        result = tally_votes(self.conf_state.voters, self._votes)
        if result == VoteResult.WON:
            if self.role == Role.PRE_CANDIDATE:
                self._become_candidate()  # the real election, now likely to succeed
                self._request_votes()
            else:
                self._become_leader()
            return True
        if result == VoteResult.LOST:
            self._become_follower(self.term, 0)
            return True
        return False

    def _handle_vote_request(self, msg: Message) -> None:
        pre_vote = msg.type == MT.PRE_VOTE
        response_type = MT.PRE_VOTE_RESPONSE if pre_vote else MT.VOTE_RESPONSE
        can_vote = (
            self.vote == msg.from_  # a repeated request: answer the same
            or (self.vote == 0 and self.leader_id == 0)
            or (pre_vote and msg.term > self.term)  # a pre-vote is for a term we have not seen
        )
        if can_vote and self._log.is_up_to_date(msg.index, msg.log_term):
            # A granted pre-vote answers at the asked term, so the pre-candidate can tell it apart.
            self._send(Message(response_type, msg.from_, self.node_id, msg.term))
            if not pre_vote:
                self._election_elapsed_ticks = 0
                self.vote = msg.from_  # in the next Ready's hard state, persisted before the send
        else:
            self._reply(msg, response_type, reject=True)

    # ------------------------------------------------------------------ messages in

    def step(self, msg: Message) -> None:
        """Handle one message from a peer. Stale, duplicated and reordered messages are safe."""
        if (msg.to != self.node_id or msg.from_ <= 0 or msg.from_ == self.node_id
                or msg.term > MAX_TERM):
            return
        if not self._check_term(msg):
            return
        if msg.type in (MT.PRE_VOTE, MT.VOTE):
            self._handle_vote_request(msg)
        elif self.role == Role.LEADER:
            self._step_leader(msg)
        elif self.role in (Role.PRE_CANDIDATE, Role.CANDIDATE):
            self._step_candidate(msg)
        else:
            self._step_follower(msg)

    def _check_term(self, msg: Message) -> bool:
        """Apply Raft's term rules; returns whether the message should be handled further."""
        if msg.term > self.term:
            if msg.type in (MT.PRE_VOTE, MT.VOTE):
                if self._heard_from_leader_recently() and msg.context != TRANSFER_CONTEXT:
                    return False  # a healthy leader exists: do not let this node disrupt it
                if msg.type == MT.PRE_VOTE:
                    return True  # pre-votes never change our term
            if msg.type == MT.PRE_VOTE_RESPONSE and not msg.reject:
                return True  # a grant at the term we would campaign for
            leader = msg.from_ if msg.type in (MT.APPEND, MT.HEARTBEAT, MT.SNAPSHOT) else 0
            self._become_follower(msg.term, leader)
            return True
        if msg.term < self.term:
            if msg.type in (MT.APPEND, MT.HEARTBEAT, MT.SNAPSHOT):
                # A stale leader (e.g. back from a partition, which pre-vote and check-quorum
                # keep from learning our term otherwise): answer so it steps down.
                self._reply(msg, MT.APPEND_RESPONSE)
            elif msg.type == MT.PRE_VOTE:
                self._reply(msg, MT.PRE_VOTE_RESPONSE, reject=True)
            return False
        return True

    def _step_follower(self, msg: Message) -> None:
        if msg.type == MT.APPEND:
            self._heard_from_leader(msg.from_)
            self._handle_append(msg)
        elif msg.type == MT.HEARTBEAT:
            self._heard_from_leader(msg.from_)
            self._log.commit_to(min(msg.commit, self._log.last_index))
            self._reply(msg, MT.HEARTBEAT_RESPONSE, context=msg.context)
        elif msg.type == MT.SNAPSHOT:
            self._heard_from_leader(msg.from_)
            self._handle_snapshot(msg)
        elif msg.type == MT.TIMEOUT_NOW:
            self._campaign(transfer=True)

    def _heard_from_leader(self, leader: int) -> None:
        self._election_elapsed_ticks = 0
        self.leader_id = leader

    def _step_candidate(self, msg: Message) -> None:
        if msg.type in (MT.APPEND, MT.HEARTBEAT, MT.SNAPSHOT):
            # A leader of our term exists (or, for a pre-candidate, of the current term).
            self._become_follower(self.term, msg.from_)
            self._step_follower(msg)
            return
        expected = MT.PRE_VOTE_RESPONSE if self.role == Role.PRE_CANDIDATE else MT.VOTE_RESPONSE
        if msg.type == expected and msg.from_ in self.conf_state.voters:
            self._votes.setdefault(msg.from_, not msg.reject)  # the first answer counts
            self._tally_votes()

    def _handle_append(self, msg: Message) -> None:
        if msg.index < self._log.commit_index:
            # Everything up to our commit index is settled; tell the leader how far we are.
            self._reply(msg, MT.APPEND_RESPONSE, index=self._log.commit_index)
            return
        if not _entries_follow(msg):
            return  # no leader sends these: a lie, which must not reach the log
        last_new = self._log.maybe_append(msg.index, msg.log_term, msg.entries)
        if last_new is not None:
            self._log.commit_to(min(msg.commit, last_new))
            self._reply(msg, MT.APPEND_RESPONSE, index=last_new)
            return
        # Refuse, with a hint that lets the leader skip a whole run of entries of a term we do
        # not share, rather than backing off one entry per round trip.
        hint = self._log.find_conflict_by_term(min(msg.index, self._log.last_index), msg.log_term)
        self._reply(msg, MT.APPEND_RESPONSE, index=msg.index, reject=True, reject_hint=hint,
                    log_term=self._log.term_at(hint) or 0)

    def _handle_snapshot(self, msg: Message) -> None:
        snapshot = msg.snapshot
        if snapshot is None:
            return
        meta = snapshot.meta
        if meta.term > msg.term or meta.index > MAX_INDEX:
            return  # no leader holds a snapshot of a later term than its own: a lie
        if meta.index <= self._log.commit_index:
            pass  # nothing new for us
        elif self._log.match_term(meta.index, meta.term):
            self._log.commit_to(meta.index)  # our log already holds it: just fast-forward
        else:
            self._log.restore(snapshot)
            self.conf_state = _normalized(meta.conf_state)
            self.role = Role.LEARNER if self.node_id in self.conf_state.learners else Role.FOLLOWER
        match = max(self._log.commit_index, min(meta.index, self._log.last_index))
        self._reply(msg, MT.APPEND_RESPONSE, index=match)

    # ------------------------------------------------------------------ leader

    def _step_leader(self, msg: Message) -> None:
        pr = self._progress.get(msg.from_)
        if pr is None:
            return  # not (or no longer) a member
        pr.recent_active = True
        if msg.type == MT.APPEND_RESPONSE:
            if msg.index > self._log.last_index:
                return  # vouches for entries we never had: not from this term's log
            self._handle_append_response(msg.from_, pr, msg)
        elif msg.type == MT.HEARTBEAT_RESPONSE:
            self._handle_heartbeat_response(msg.from_, pr, msg)

    def _handle_append_response(self, node: int, pr: Progress, msg: Message) -> None:
        if msg.reject:
            hint = msg.reject_hint
            if msg.log_term > 0:
                hint = self._log.find_conflict_by_term(hint, msg.log_term)
            if pr.maybe_decrease_to(msg.index, hint):
                if pr.state == ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(node)
            return
        if pr.maybe_update(msg.index):
            if pr.state == ProgressState.PROBE:
                pr.become_replicate()
            elif pr.state == ProgressState.SNAPSHOT and pr.match >= self._log.snapshot_index:
                pr.become_probe()  # the snapshot (or an equivalent log) arrived
                pr.become_replicate()
            if self._maybe_commit():
                self._commit_to_send = True
            if node == self._transferee and pr.match == self._log.last_index:
                self._send_timeout_now(node)
        if pr.state == ProgressState.REPLICATE:
            pr.inflights.free_through(msg.index)
        while self._send_append(node, send_if_empty=False):
            pass

    def _handle_heartbeat_response(self, node: int, pr: Progress, msg: Message) -> None:
        pr.probe_sent = False  # the follower is reachable again: let the next probe go
        if pr.state == ProgressState.REPLICATE and pr.inflights.full():
            pr.inflights.free_oldest()  # an APPEND may have been lost; do not stall forever
        if len(msg.context) == _HEARTBEAT_CONTEXT.size:
            heartbeat_round, sent_tick = _HEARTBEAT_CONTEXT.unpack(msg.context)
            pr.acked_round = max(pr.acked_round, heartbeat_round)
            if pr.acked_sent_tick is None or sent_tick > pr.acked_sent_tick:
                pr.acked_sent_tick = sent_tick
            self._release_confirmed_reads()
        if pr.match < self._log.last_index:
            self._send_append(node)  # empty if nothing new: a probe that finds a lost APPEND

    def _maybe_commit(self) -> bool:
        """Move the commit index to what a quorum holds, but only by counting replicas of an
        entry of the current term (Raft figure 8: an older term's entry on a majority can
        still be overwritten). Earlier entries commit with it."""
        voters = self.conf_state.voters
        matches = [self._progress[voter].match for voter in voters if voter in self._progress]
        index = quorum_value(matches, len(voters))
        if index <= self._log.commit_index or self._log.term_at(index) != self.term:
            return False
        self._log.commit_to(index)
        while self._reads_awaiting_commit:
            self._start_read(self._reads_awaiting_commit.popleft())
        return True

    def _reply(self, msg: Message, msg_type: MessageType, **fields) -> None:
        self._send(Message(msg_type, msg.from_, self.node_id, self.term, **fields))

    def _send(self, msg: Message) -> None:
        if len(self._outbox) >= MAX_OUTBOX_MESSAGES:
            self._dropped_messages += 1
            return
        self._outbox.append(msg)

    def _send_append(self, node: int, send_if_empty: bool = True) -> bool:
        """Send `node` the entries it needs next (or a snapshot). Returns whether entries went
        out, so a caller can keep filling the pipeline."""
        pr = self._progress[node]
        if pr.is_paused():
            return False
        prev_index = pr.next - 1
        prev_term = self._log.term_at(prev_index)
        if prev_term is None:
            self._send_snapshot(node, pr)  # the entries it needs were compacted away
            return False
        entries: list[Entry] = []
        if pr.next <= self._log.last_index:
            entries = self._log.entries_for_append(
                pr.next, self.config.max_entries_per_append, self.config.max_bytes_per_append
            )
        if not entries and not send_if_empty:
            return False
        self._send(Message(
            MT.APPEND, node, self.node_id, self.term, log_term=prev_term, index=prev_index,
            entries=tuple(entries), commit=self._log.commit_index,
        ))
        if entries:
            pr.sent_entries(entries[-1].index)
        elif pr.state == ProgressState.PROBE:
            pr.probe_sent = True
        return bool(entries)

    def _send_snapshot(self, node: int, pr: Progress) -> None:
        snapshot = self._log.snapshot
        if snapshot is None:
            pr.probe_sent = True  # cannot happen with a consistent log; retry on a heartbeat
            return
        self._send(Message(MT.SNAPSHOT, node, self.node_id, self.term, snapshot=snapshot))
        pr.become_snapshot(snapshot.meta.index)

    def _broadcast_heartbeat(self) -> None:
        self._heartbeat_round += 1
        self._read_round_wanted = False
        context = _HEARTBEAT_CONTEXT.pack(self._heartbeat_round, self._now_ticks)
        for node in self._peers():
            # Only up to what the follower is known to hold: its log past `match` may differ.
            commit = min(self._progress[node].match, self._log.commit_index)
            self._send(Message(MT.HEARTBEAT, node, self.node_id, self.term, commit=commit,
                               context=context))
        self._release_confirmed_reads()

    def _flush(self) -> None:
        """Send what batching held back: new entries, a new commit index, a read round."""
        if self.role == Role.LEADER:
            if self._entries_to_send or self._commit_to_send:
                for node in self._peers():
                    sent = False
                    while self._send_append(node, send_if_empty=False):
                        sent = True
                    # Nothing new to send, but a new commit index to spread, or a follower
                    # (e.g. a new member) whose log we have not probed yet.
                    probing = self._progress[node].state == ProgressState.PROBE
                    if not sent and (self._commit_to_send or probing):
                        self._send_append(node, send_if_empty=True)
            if self._read_round_wanted:
                self._broadcast_heartbeat()
        self._entries_to_send = self._commit_to_send = self._read_round_wanted = False

    # ------------------------------------------------------------------ requests

    def propose(self, data: bytes) -> int:
        """Append a command to the log (leader only); returns its index. It commits once a
        quorum persisted it, and comes back in a Ready's committed_entries."""
        return self._append_proposal(EntryKind.NORMAL, bytes(data))

    def _append_proposal(self, kind: EntryKind, data: bytes) -> int:
        if self.role != Role.LEADER:
            raise NotLeader(self.leader_id)
        if self._transferee:
            raise ProposalDropped(f"leadership is being transferred to {self._transferee}")
        uncommitted = self._log.last_index - self._log.commit_index
        if uncommitted >= self.config.max_uncommitted_entries:
            raise ProposalDropped(f"{uncommitted} entries are uncommitted")
        index = self._log.last_index + 1
        self._log.append([Entry(self.term, index, kind, data)])
        self._entries_to_send = True
        return index

    def propose_conf_change(self, change: ConfChange) -> int:
        """Propose one membership change (leader only). It takes effect when the driver applies
        the committed entry and calls apply_conf_change."""
        if self.role != Role.LEADER:
            raise NotLeader(self.leader_id)
        if self._pending_conf_index > self._log.applied_index:
            raise ProposalDropped("another membership change is not applied yet")
        voters, learners = self.conf_state.voters, self.conf_state.learners
        node = change.node_id
        if node <= 0:
            raise ProposalDropped(f"invalid node id {node}")
        if change.kind == ConfChangeKind.ADD_LEARNER and (node in voters or node in learners):
            raise ProposalDropped(f"node {node} is already a member")
        if change.kind == ConfChangeKind.PROMOTE and node not in learners:
            raise ProposalDropped(f"node {node} is not a learner")
        if change.kind == ConfChangeKind.REMOVE:
            if node not in voters and node not in learners:
                raise ProposalDropped(f"node {node} is not a member")
            if voters == (node,):
                raise ProposalDropped("cannot remove the last voter")
        if change.kind == ConfChangeKind.ADD_VOTER:
            raise ProposalDropped("add a node as a learner, then promote it")
        index = self._append_proposal(EntryKind.CONF_CHANGE, encode_conf_change(change))
        self._pending_conf_index = index
        return index

    def apply_conf_change(self, change: ConfChange) -> ConfState:
        """The driver applies a committed CONF_CHANGE entry: membership changes now. Returns
        the new ConfState. Applying a change that does not fit the current membership (which
        propose_conf_change refuses) leaves it unchanged, identically on every node."""
        voters = set(self.conf_state.voters)
        learners = set(self.conf_state.learners)
        node = change.node_id
        if change.kind == ConfChangeKind.ADD_VOTER:
            learners.discard(node)
            voters.add(node)
        elif change.kind == ConfChangeKind.ADD_LEARNER:
            if node not in voters:
                learners.add(node)
        elif change.kind == ConfChangeKind.PROMOTE:
            if node in learners:
                learners.discard(node)
                voters.add(node)
        elif change.kind == ConfChangeKind.REMOVE:
            if voters != {node}:
                voters.discard(node)
                learners.discard(node)
        self.conf_state = ConfState(tuple(sorted(voters)), tuple(sorted(learners)))
        if self.role == Role.LEADER:
            self._leader_membership_changed()
        elif self.role in (Role.FOLLOWER, Role.LEARNER):
            self.role = Role.LEARNER if self.node_id in learners else Role.FOLLOWER
        elif not self._promotable():
            self._become_follower(self.term, 0)  # a candidate that is no longer a voter
        return self.conf_state

    def _leader_membership_changed(self) -> None:
        if not self._promotable():
            self._become_follower(self.term, 0)  # removed (or demoted): someone else leads
            return
        members = set(self._members())
        for node in list(self._progress):
            if node not in members:
                del self._progress[node]  # a removed node stops counting at once
        for node in self._members():
            if node not in self._progress:
                self._progress[node] = self._new_progress(node)
            self._progress[node].learner = node in self.conf_state.learners
        if self._transferee and self._transferee not in self.conf_state.voters:
            self._abort_transfer()
        if self._maybe_commit():
            self._commit_to_send = True
        self._entries_to_send = True  # a new member needs the log
        self._release_confirmed_reads()

    def read_index(self, context: bytes) -> None:
        """Ask for a linearizable read (leader only). A ReadState(index, context) comes out in a
        later Ready once this node is confirmed to still lead at `index`; serve the read once
        the applied index reaches it. Reads in flight are dropped if leadership is lost."""
        if self.role != Role.LEADER:
            raise NotLeader(self.leader_id)
        queued = (len(self._reads_awaiting_commit) + len(self._pending_reads)
                  + len(self._read_states))
        if queued >= MAX_PENDING_READS:
            raise ProposalDropped(f"{queued} reads are pending")
        if self._log.term_at(self._log.commit_index) != self.term:
            # A new leader's commit index may lag the real one until its no-op commits.
            self._reads_awaiting_commit.append(bytes(context))
            return
        self._start_read(bytes(context))

    def serves_reads_now(self) -> bool:
        """Whether a read_index asked now would be answered at once (a leader whose commit
        index is of its term, alone or within its check-quorum lease): the synchronous form
        of a read barrier, for callers that need no index."""
        return (self.role == Role.LEADER
                and self._log.term_at(self._log.commit_index) == self.term
                and (len(self.conf_state.voters) == 1
                     or (self.config.read_only == "lease" and self._lease_holds())))

    def _start_read(self, context: bytes) -> None:
        index = self._log.commit_index
        lease = self.config.read_only == "lease"
        if len(self.conf_state.voters) == 1 or (lease and self._lease_holds()):
            self._read_states.append(ReadState(index, context))
            return
        # Confirmed by the next heartbeat round a quorum answers; rounds are batched, one per
        # Ready at most.
        self._pending_reads.append(_PendingRead(self._heartbeat_round + 1, index, context))
        self._read_round_wanted = True

    def _release_confirmed_reads(self) -> None:
        if not self._pending_reads:
            return
        rounds = [
            self._heartbeat_round if voter == self.node_id else self._progress[voter].acked_round
            for voter in self.conf_state.voters if voter in self._progress
        ]
        confirmed_round = quorum_value(rounds, len(self.conf_state.voters))
        while self._pending_reads and self._pending_reads[0].round <= confirmed_round:
            read = self._pending_reads.popleft()
            self._read_states.append(ReadState(read.index, read.context))

    def _lease_holds(self) -> bool:
        """Whether a quorum answered heartbeats this leader sent within the last
        election_ticks - 1 ticks.

        Clock assumption: every node's ticks run at about the same rate. A follower that
        answered a heartbeat sent at leader tick t refuses (pre)votes until it has counted
        election_ticks of its own ticks since receiving it, so no other leader can be elected
        before leader tick t + election_ticks; one tick is kept as slack for tick phase and
        drift. Leadership transfers bypass that refusal, so a leader that sent TIMEOUT_NOW
        stops using its lease for the rest of its term."""
        if self._lease_revoked or self._transferee:
            return False
        window_ticks = self.config.election_ticks - 1
        fresh = 0
        for voter in self.conf_state.voters:
            if voter == self.node_id:
                fresh += 1
                continue
            pr = self._progress.get(voter)
            if pr is None or pr.acked_sent_tick is None:
                continue
            if self._now_ticks - pr.acked_sent_tick < window_ticks:
                fresh += 1
        return fresh >= self._quorum()

    def transfer_leader(self, target: int) -> None:
        """Hand leadership to `target` (leader only): bring it up to date, then tell it to
        campaign at once. Proposals are refused meanwhile; gives up after election_ticks."""
        if self.role != Role.LEADER:
            raise NotLeader(self.leader_id)
        if target == self.node_id or target == self._transferee:
            return
        if target not in self.conf_state.voters:
            raise ProposalDropped(f"node {target} is not a voter")
        self._transferee = target
        self._transfer_elapsed_ticks = 0
        if self._progress[target].match == self._log.last_index:
            self._send_timeout_now(target)
        else:
            self._send_append(target)

    def _send_timeout_now(self, node: int) -> None:
        self._lease_revoked = True
        self._send(Message(MT.TIMEOUT_NOW, node, self.node_id, self.term))

    def _abort_transfer(self) -> None:
        self._transferee = 0
        self._transfer_elapsed_ticks = 0

    def compact(self, snapshot: Snapshot) -> None:
        """The driver took a state machine snapshot at snapshot.meta.index (<= applied): keep it
        for lagging followers and drop the log up to there."""
        meta = snapshot.meta
        if meta.index <= self._log.snapshot_index:
            return  # older than what we have
        if meta.index > self._log.applied_index:
            raise ValueError(
                f"snapshot index {meta.index} is past the applied index {self._log.applied_index}")
        if self._log.term_at(meta.index) != meta.term:
            raise ValueError(f"snapshot term {meta.term} does not match the log at {meta.index}")
        self._log.compact(snapshot)

    def report_unreachable(self, node_id: int) -> None:
        """A send to node_id failed: stop streaming and probe it again."""
        pr = self._progress.get(node_id) if self.role == Role.LEADER else None
        if pr is not None and pr.state == ProgressState.REPLICATE:
            pr.become_probe()

    def report_snapshot(self, node_id: int, ok: bool) -> None:
        """The transfer of a SNAPSHOT message to node_id ended (ok: delivered)."""
        pr = self._progress.get(node_id) if self.role == Role.LEADER else None
        if pr is None or pr.state != ProgressState.SNAPSHOT:
            return
        if not ok:
            pr.pending_snapshot_index = 0
        pr.become_probe()
        # Wait for the follower's answer (or a heartbeat reply) before sending again.
        pr.probe_sent = True

    # ------------------------------------------------------------------ Ready

    def _hard_state(self) -> HardState:
        return HardState(self.term, self.vote, self._log.commit_index)

    def has_ready(self) -> bool:
        return bool(
            self._outbox
            or self._read_states
            or self._log.has_unoffered()
            or self._entries_to_send
            or self._commit_to_send
            or self._read_round_wanted
            or self._hard_state_changed()
            or self._soft_state_changed()
        )

    # Field by field: has_ready runs at least twice per pass, and most passes change neither.
    def _hard_state_changed(self) -> bool:
        prev = self._prev_hard
        return (self._log.commit_index != prev.commit or self.term != prev.term
                or self.vote != prev.vote)

    def _soft_state_changed(self) -> bool:
        prev = self._prev_soft
        return self.role != prev.role or self.leader_id != prev.leader

    def ready(self) -> Ready:
        """The next batch of work; see Ready in types.py. Whatever it holds is not handed out
        again, so call advance(rd) once it is done (step and tick may come in between)."""
        self._flush()
        rd = Ready()
        if self._soft_state_changed():
            rd.soft_state = self._prev_soft = SoftState(self.leader_id, self.role)
        rd.snapshot = self._log.take_unoffered_snapshot()
        rd.entries = self._log.take_unoffered_entries()
        if (rd.entries and self.config.entries_durable_when_written
                and self.role == Role.LEADER and rd.snapshot is None):
            # Durable once written, and written before this Ready's committed entries are
            # applied (see RaftConfig): the leader's own copy counts now. The messages were
            # built above with the old commit index; the new one goes out with the next Ready.
            if self._progress[self.node_id].maybe_update(rd.entries[-1].index) \
                    and self._maybe_commit() and len(self._progress) > 1:
                self._commit_to_send = True  # with no one else to tell, no Ready for it
        if self._hard_state_changed():
            rd.hard_state = self._prev_hard = self._hard_state()
        rd.committed_entries = self._log.take_committed_entries()
        rd.messages, self._outbox = self._outbox, []
        rd.read_states, self._read_states = self._read_states, []
        return rd

    def advance(self, rd: Ready) -> None:
        """The driver persisted, sent and applied what `rd` held. The leader's own entries
        count toward the commit quorum only from here."""
        if rd.snapshot is not None:
            self._log.snapshot_persisted(rd.snapshot)
            self._log.applied_to(rd.snapshot.meta.index)
        if rd.entries:
            self._log.persisted(rd.entries)
        if rd.committed_entries:
            self._log.applied_to(rd.committed_entries[-1].index)
        if self.role == Role.LEADER:
            own = self._progress[self.node_id]
            own.maybe_update(self._log.persisted_index)
            if self._maybe_commit():
                self._commit_to_send = True


def _entries_follow(msg: Message) -> bool:
    """Whether an APPEND's entries are what a leader's log can hold after (index, log_term):
    consecutive indexes from index + 1, terms that never decrease and never pass its term."""
    previous_term = msg.log_term
    for position, entry in enumerate(msg.entries):
        if entry.index != msg.index + 1 + position or not previous_term <= entry.term <= msg.term:
            return False
        previous_term = entry.term
    return True


def _normalized(conf_state: ConfState) -> ConfState:
    voters = tuple(sorted(set(conf_state.voters)))
    learners = tuple(sorted(set(conf_state.learners) - set(voters)))
    return ConfState(voters, learners)
