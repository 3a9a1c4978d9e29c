"""The Raft core's vocabulary: log entries, messages, persistent state and the Ready batch.

These are plain values. The core (raft/core.py) consumes messages and ticks and produces
`Ready` batches; the node driver persists, sends and applies what a Ready holds, then calls
`advance`. raft/codec.py turns them into bytes for the wire and the log file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class EntryKind(IntEnum):
    NORMAL = 0  # data is a state machine command (empty: the leader's no-op of a new term)
    CONF_CHANGE = 1  # data is an encoded ConfChange


class MessageType(IntEnum):
    PRE_VOTE = 1
    PRE_VOTE_RESPONSE = 2
    VOTE = 3
    VOTE_RESPONSE = 4
    APPEND = 5  # log entries (possibly none: a probe)
    APPEND_RESPONSE = 6
    HEARTBEAT = 7
    HEARTBEAT_RESPONSE = 8
    SNAPSHOT = 9  # install the snapshot the message carries
    TIMEOUT_NOW = 10  # leadership transfer: start an election now, skipping pre-vote


class Role(IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3
    LEARNER = 4  # a non-voting member: receives the log, never votes or campaigns


class ConfChangeKind(IntEnum):
    ADD_LEARNER = 0
    PROMOTE = 1  # learner -> voter
    REMOVE = 2
    ADD_VOTER = 3  # only in the entries a brand-new cluster bootstraps its initial voters with


@dataclass(frozen=True, slots=True)
class ConfChange:
    """One membership change; the core allows one uncommitted change at a time."""
    kind: ConfChangeKind
    node_id: int
    context: bytes = b""  # opaque to the core (the node's addresses)


@dataclass(frozen=True, slots=True)
class ConfState:
    voters: tuple[int, ...]
    learners: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Entry:
    term: int
    index: int
    kind: EntryKind = EntryKind.NORMAL
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before a message that depends on it is sent."""
    term: int = 0
    vote: int = 0  # 0: voted for no one in this term
    commit: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    index: int = 0
    term: int = 0
    conf_state: ConfState = ConfState(())


@dataclass(frozen=True, slots=True)
class Snapshot:
    meta: SnapshotMeta
    data: bytes = b""  # the state machine's encoded state at meta.index


@dataclass(slots=True)
class Message:
    type: MessageType
    to: int
    from_: int
    term: int
    log_term: int = 0  # APPEND: term of the entry at `index`; votes: last log term
    index: int = 0  # APPEND: index before `entries`; votes: last log index; responses: match
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    # APPEND_RESPONSE rejected: where the logs may match (<= the follower's last index); log_term
    # then holds the follower's term at that index.
    reject_hint: int = 0
    snapshot: Snapshot | None = None
    context: bytes = b""  # read index requests and heartbeats carry it back


@dataclass(frozen=True, slots=True)
class ReadState:
    """A linearizable read may be served once the applied index reaches `index`."""
    index: int
    context: bytes


@dataclass(frozen=True, slots=True)
class SoftState:
    leader: int  # 0: no known leader
    role: Role


@dataclass(slots=True)
class Ready:
    """One batch of work for the driver, in this order:

    1. persist `hard_state` (if not None), `snapshot` (if not None) and `entries` (an entry at
       index i replaces any stored entry at i or later; a snapshot here came from the leader
       and replaces the whole stored log, `entries` then follow it), fsynced as the policy asks;
    2. send `messages`;
    3. apply `snapshot` then `committed_entries` to the state machine, in order;
    4. serve `read_states` once applied >= their index;
    5. call `core.advance(ready)`.
    """
    soft_state: SoftState | None = None
    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    committed_entries: list[Entry] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)


class RaftError(Exception):
    pass


class NotLeader(RaftError):
    """A proposal, read or transfer that only the leader can take; `leader` is 0 if unknown."""

    def __init__(self, leader: int) -> None:
        super().__init__(f"not the leader (leader: {leader or 'unknown'})")
        self.leader = leader


class ProposalDropped(RaftError):
    """The core refused a proposal (a leadership transfer in progress, a change pending...)."""
