"""What the leader knows about each member's log, and the quorum arithmetic.

A follower's Progress is in one of three states:

    PROBE      the leader does not know where the follower's log matches its own; it sends one
               APPEND at a time and waits for the answer (or a heartbeat round) before the next
    REPLICATE  the logs match up to `match`; the leader streams APPENDs optimistically, moving
               `next` ahead as it sends, with at most `Inflights.capacity` unacknowledged
    SNAPSHOT   the entries the follower needs were compacted away; a SNAPSHOT is on its way and
               nothing else is sent until the follower acknowledges it or the driver reports it
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum


class ProgressState(IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Inflights:
    """The last index of each APPEND sent and not yet acknowledged, oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._last_indices: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._last_indices)

    def full(self) -> bool:
        return len(self._last_indices) >= self.capacity

    def add(self, last_index: int) -> None:
        assert not self.full()
        self._last_indices.append(last_index)

    def free_through(self, index: int) -> None:
        """The follower acknowledged everything up to `index`."""
        while self._last_indices and self._last_indices[0] <= index:
            self._last_indices.popleft()

    def free_oldest(self) -> None:
        if self._last_indices:
            self._last_indices.popleft()

    def clear(self) -> None:
        self._last_indices.clear()


@dataclass(eq=False)
class Progress:
    inflights: Inflights
    match: int = 0  # highest index known to be in the follower's log
    next: int = 1  # next index to send
    state: ProgressState = ProgressState.PROBE
    learner: bool = False
    probe_sent: bool = False  # PROBE: an APPEND is out; wait for its answer or a heartbeat reply
    pending_snapshot_index: int = 0  # SNAPSHOT: the index of the snapshot sent
    recent_active: bool = False  # heard from since the last check-quorum round
    acked_round: int = 0  # highest heartbeat round the follower answered (read index)
    acked_sent_tick: int | None = None  # leader tick at which that answered heartbeat left (lease)

    def become_probe(self) -> None:
        if self.state == ProgressState.SNAPSHOT:
            # The snapshot may have arrived: try right after it rather than from scratch.
            self.next = max(self.match + 1, self.pending_snapshot_index + 1)
        else:
            self.next = self.match + 1
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot_index = 0
        self.inflights.clear()

    def become_replicate(self) -> None:
        self.state = ProgressState.REPLICATE
        self.next = self.match + 1
        self.probe_sent = False
        self.inflights.clear()

    def become_snapshot(self, snapshot_index: int) -> None:
        self.state = ProgressState.SNAPSHOT
        self.pending_snapshot_index = snapshot_index
        self.probe_sent = False
        self.inflights.clear()

    def is_paused(self) -> bool:
        if self.state == ProgressState.PROBE:
            return self.probe_sent
        if self.state == ProgressState.REPLICATE:
            return self.inflights.full()
        return True

    def sent_entries(self, last_index: int) -> None:
        """An APPEND carrying entries up to `last_index` went out."""
        if self.state == ProgressState.REPLICATE:
            self.next = last_index + 1
            self.inflights.add(last_index)
        elif self.state == ProgressState.PROBE:
            self.probe_sent = True

    def maybe_update(self, index: int) -> bool:
        """The follower holds our log up to `index`; returns whether `match` moved."""
        self.next = max(self.next, index + 1)
        if index <= self.match:
            return False
        self.match = index
        self.probe_sent = False
        return True

    def maybe_decrease_to(self, rejected: int, match_hint: int) -> bool:
        """The follower refused the APPEND whose previous index was `rejected`; it suggests our
        logs may match up to `match_hint`. Returns False for a stale refusal."""
        if self.state == ProgressState.REPLICATE:
            if rejected <= self.match:
                return False  # an old APPEND; we already know better
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False  # not the probe we are waiting on
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.probe_sent = False
        return True

    def summary(self) -> dict:
        return {
            "match": self.match,
            "next": self.next,
            "state": self.state.name,
            "inflight": len(self.inflights),
            "learner": self.learner,
        }


def quorum_size(voter_count: int) -> int:
    return voter_count // 2 + 1


def quorum_value(values: Iterable[int], voter_count: int) -> int:
    """The largest v such that a quorum of voters has a value >= v (e.g. the commit index from
    match indices). Voters missing from `values` count as 0."""
    ranked = sorted(values, reverse=True)
    position = quorum_size(voter_count) - 1
    return ranked[position] if position < len(ranked) else 0


class VoteResult(IntEnum):
    PENDING = 0
    WON = 1
    LOST = 2


def tally_votes(voters: Iterable[int], votes: dict[int, bool]) -> VoteResult:
    voter_list = list(voters)
    granted = sum(1 for voter in voter_list if votes.get(voter) is True)
    refused = sum(1 for voter in voter_list if votes.get(voter) is False)
    needed = quorum_size(len(voter_list))
    if granted >= needed:
        return VoteResult.WON
    if refused > len(voter_list) - needed:
        return VoteResult.LOST
    return VoteResult.PENDING
