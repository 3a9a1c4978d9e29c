"""The Raft log as the core holds it in memory: a compacted prefix (the snapshot) and the entries
after it.

Index 0 is the empty log (term 0). The snapshot covers indices 1..snapshot_index; `_entries[k]`
holds index snapshot_index + 1 + k. Everything the core knows is in memory: the driver hands
the recovered entries to the core at start and bounds memory with `RaftCore.compact`.

Cursors, each moved forward only by a Ready being produced or advanced:

    persisted_index <= offered_index <= last_index    entries on disk / handed to a Ready
    applied_index <= applying_index <= commit_index   entries applied / handed to a Ready

A truncation (a follower replacing a conflicting suffix) pulls persisted_index and
offered_index back, so the replacement entries go out in the next Ready.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncaked.raft.types import Entry, EntryKind, Snapshot, SnapshotMeta

ENTRY_OVERHEAD_BYTES = 16  # what an entry costs beyond its data, for batching limits


def entry_size_bytes(entry: Entry) -> int:
    return len(entry.data) + ENTRY_OVERHEAD_BYTES


class RaftLog:
    def __init__(self, snapshot: Snapshot | None, entries: Sequence[Entry]) -> None:
        meta = snapshot.meta if snapshot is not None else SnapshotMeta()
        self.snapshot = snapshot  # the latest state machine snapshot; sent to lagging followers
        self.snapshot_index = meta.index
        self.snapshot_term = meta.term
        self._entries: list[Entry] = []
        last_term = meta.term
        for entry in entries:
            if entry.index <= meta.index:
                continue  # already covered by the snapshot
            if entry.index != self.last_index + 1:
                raise ValueError(f"recovered entries are not contiguous at index {entry.index}")
            if entry.term < last_term:
                # Terms never decrease along a log: this is the stale suffix of a log that a
                # snapshot from the leader replaced (a crash before the store dropped it).
                break
            self._entries.append(entry)
            last_term = entry.term
        self.commit_index = meta.index
        self.applied_index = meta.index
        self.applying_index = meta.index
        self.persisted_index = self.last_index  # what the driver recovered is on disk
        self.offered_index = self.last_index
        # A snapshot from the leader, installed but not yet handed to a Ready.
        self._unoffered_snapshot: Snapshot | None = None

    # --- reading ---

    @property
    def first_index(self) -> int:
        return self.snapshot_index + 1

    @property
    def last_index(self) -> int:
        return self.snapshot_index + len(self._entries)

    @property
    def last_term(self) -> int:
        return self._entries[-1].term if self._entries else self.snapshot_term

    def term_at(self, index: int) -> int | None:
        """The term of the entry at `index`; None if it was compacted away or does not exist."""
        position = index - self.snapshot_index  # 1 for the first entry after the snapshot
        if position == 0:
            return self.snapshot_term
        if position < 0 or position > len(self._entries):
            return None
        return self._entries[position - 1].term

    def match_term(self, index: int, term: int) -> bool:
        return self.term_at(index) == term

    def entries_between(self, low: int, high: int) -> list[Entry]:
        """Entries with low <= index < high; both must lie within first_index..last_index + 1."""
        assert self.snapshot_index < low <= high <= self.last_index + 1, (low, high)
        return self._entries[low - self.snapshot_index - 1 : high - self.snapshot_index - 1]

    def entries_for_append(self, start: int, max_count: int, max_bytes: int) -> list[Entry]:
        """Entries from `start` on, at most max_count and max_bytes (but at least one entry)."""
        batch = self.entries_between(start, min(self.last_index + 1, start + max_count))
        total_bytes = 0
        for count, entry in enumerate(batch):
            total_bytes += entry_size_bytes(entry)
            if total_bytes > max_bytes and count > 0:
                return batch[:count]
        return batch

    def is_up_to_date(self, index: int, term: int) -> bool:
        """Whether a log ending at (index, term) is at least as up to date as ours (Raft 5.4.1)."""
        return term > self.last_term or (term == self.last_term and index >= self.last_index)

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """The largest index <= `index` whose term is <= `term`: where a rejected append can
        resume, skipping a whole run of entries of a term the other log does not have."""
        index = min(index, self.last_index)
        while index > self.snapshot_index:
            entry_term = self.term_at(index)
            if entry_term is not None and entry_term <= term:
                break
            index -= 1
        return index

    # --- writing ---

    def append(self, entries: Sequence[Entry]) -> None:
        """The leader's own new entries, contiguous after last_index."""
        for entry in entries:
            assert entry.index == self.last_index + 1, (entry.index, self.last_index)
            self._entries.append(entry)

    def maybe_append(self, prev_index: int, prev_term: int, entries: Sequence[Entry]) -> int | None:
        """A follower accepts entries after (prev_index, prev_term) if it holds that entry.

        Entries we already hold are kept (a duplicate or reordered append must not truncate
        anything); the suffix from the first conflicting entry is replaced. Returns the index of
        the last entry the append vouches for, or None if the consistency check failed."""
        if not self.match_term(prev_index, prev_term):
            return None
        for position, entry in enumerate(entries):
            if self.term_at(entry.index) == entry.term:
                continue
            if entry.index <= self.commit_index:
                raise AssertionError(f"append conflicts with committed entry {entry.index}")
            self._truncate_from(entry.index)
            self._entries.extend(entries[position:])
            break
        return prev_index + len(entries)

    def _truncate_from(self, index: int) -> None:
        del self._entries[index - self.snapshot_index - 1 :]
        self.offered_index = min(self.offered_index, index - 1)
        self.persisted_index = min(self.persisted_index, index - 1)

    def commit_to(self, index: int) -> bool:
        if index <= self.commit_index:
            return False
        assert index <= self.last_index, (index, self.last_index)
        self.commit_index = index
        return True

    def compact(self, snapshot: Snapshot) -> None:
        """Drop the entries the snapshot covers; keep the snapshot for lagging followers."""
        index = snapshot.meta.index
        del self._entries[: index - self.snapshot_index]
        self.snapshot = snapshot
        self.snapshot_index = index
        self.snapshot_term = snapshot.meta.term

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the whole log by a snapshot from the leader; the next Ready carries it."""
        index = snapshot.meta.index
        self._entries = []
        self.snapshot = snapshot
        self.snapshot_index = index
        self.snapshot_term = snapshot.meta.term
        self.commit_index = index
        self.applying_index = index
        self.offered_index = index
        self.persisted_index = min(self.persisted_index, index)
        self._unoffered_snapshot = snapshot

    # --- handing work to a Ready and hearing back ---

    def has_unoffered(self) -> bool:
        return (
            self._unoffered_snapshot is not None
            or self.offered_index < self.last_index
            or self.applying_index < self.commit_index
        )

    def take_unoffered_snapshot(self) -> Snapshot | None:
        snapshot, self._unoffered_snapshot = self._unoffered_snapshot, None
        return snapshot

    def take_unoffered_entries(self) -> list[Entry]:
        last_index = self.last_index
        if self.offered_index >= last_index:
            return []
        entries = self.entries_between(self.offered_index + 1, last_index + 1)
        self.offered_index = last_index
        return entries

    def take_committed_entries(self) -> list[Entry]:
        if self.applying_index >= self.commit_index:
            return []
        entries = self.entries_between(self.applying_index + 1, self.commit_index + 1)
        self.applying_index = self.commit_index
        return entries

    def persisted(self, entries: Sequence[Entry]) -> None:
        """The driver wrote `entries` (from one Ready). The log may have been truncated since,
        so only the prefix that still matches counts."""
        for entry in reversed(entries):
            if entry.index <= self.persisted_index:
                return
            if self.term_at(entry.index) == entry.term:
                self.persisted_index = entry.index
                return

    def snapshot_persisted(self, snapshot: Snapshot) -> None:
        if snapshot.meta.index == self.snapshot_index and snapshot.meta.term == self.snapshot_term:
            self.persisted_index = max(self.persisted_index, snapshot.meta.index)

    def applied_to(self, index: int) -> None:
        self.applied_index = max(self.applied_index, index)

    def has_conf_change_between(self, low: int, high: int) -> bool:
        """Whether a CONF_CHANGE entry lies at low <= index <= high."""
        low = max(low, self.first_index)
        high = min(high, self.last_index)
        if low > high:
            return False
        entries = self.entries_between(low, high + 1)
        return any(entry.kind == EntryKind.CONF_CHANGE for entry in entries)
