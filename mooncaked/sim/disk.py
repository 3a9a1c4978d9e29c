"""A node's simulated disk, with the rules of raft/log_store.py.

Records (entries, hard states) are appended and become durable at `sync()`; a crash keeps the
durable records and a random prefix of the unsynced ones (the page cache may have written some
back; a torn record is cut off at recovery, so losing it is all a tear can do). An entry at index
i replaces what is stored at i and later. `save_snapshot` is durable at once and, like the
LogStore, syncs the log too; it keeps entries after the snapshot index.

Two images are kept: what was written (the node's view, used by the checkers) and what is
durable (what a restart recovers).

Mutants (test the tester; never on in a real run):
- ack_before_sync: `sync()` returns at once and the records reach the disk only
  `writeback_ms` after they were written, so a crash loses records the node already acted on;
- vote_not_persisted: the durable hard state never takes a new vote (the term and commit do),
  so a node that crashes after voting may vote again in the same term.
"""

from __future__ import annotations

import random

from mooncaked.raft.types import Entry, HardState, Snapshot
from mooncaked.sim.events import MS


class DiskError(Exception):
    """A write the LogStore would refuse (the driver or core handed it a bad batch)."""


class LogImage:
    __slots__ = ("hard_state", "snapshot", "entries")

    def __init__(self) -> None:
        self.hard_state = HardState()
        self.snapshot: Snapshot | None = None
        self.entries: list[Entry] = []  # contiguous, after the snapshot index

    def copy(self) -> "LogImage":
        image = LogImage()
        image.hard_state, image.snapshot, image.entries = (self.hard_state, self.snapshot,
                                                           list(self.entries))
        return image

    @property
    def snapshot_index(self) -> int:
        return self.snapshot.meta.index if self.snapshot is not None else 0

    @property
    def last_index(self) -> int:
        return self.snapshot_index + len(self.entries)

    def entry(self, index: int) -> Entry | None:
        position = index - self.snapshot_index - 1
        if 0 <= position < len(self.entries):
            return self.entries[position]
        return None

    def term_at(self, index: int) -> int | None:
        if index == self.snapshot_index:
            return self.snapshot.meta.term if self.snapshot is not None else 0
        entry = self.entry(index)
        return entry.term if entry is not None else None

    def put_entry(self, entry: Entry) -> None:
        position = entry.index - self.snapshot_index - 1
        if position < 0:
            # LogStore replay: an entry the snapshot covers replaces every entry after it too.
            self.entries.clear()
            return
        if position > len(self.entries):
            raise DiskError(f"entry {entry.index} leaves a gap after index {self.last_index}")
        del self.entries[position:]
        self.entries.append(entry)

    def put_snapshot(self, snapshot: Snapshot) -> None:
        index = snapshot.meta.index
        self.entries = [e for e in self.entries if e.index > index]
        self.snapshot = snapshot


class SimDisk:
    def __init__(self, rng: random.Random, mutant: str | None = None,
                 writeback_ms: float = 200.0) -> None:
        self.rng = rng
        self.mutant = mutant
        self.writeback_ns = int(writeback_ms * MS)
        self.written = LogImage()
        self.durable = LogImage()
        self._unsynced: list[tuple[int, object]] = []  # (time written, Entry | HardState)
        self.syncs = 0

    # -- writing ------------------------------------------------------------------------------

    def append(self, entries: list[Entry], hard_state: HardState | None, now: int) -> None:
        image = self.written
        if entries:
            first = entries[0].index
            if not image.snapshot_index < first <= image.last_index + 1:
                raise DiskError(f"entry index {first} must be in {image.snapshot_index + 1}.."
                                f"{image.last_index + 1}")
            for previous, entry in zip(entries, entries[1:]):
                if entry.index != previous.index + 1:
                    raise DiskError(f"entries not contiguous: {previous.index}, {entry.index}")
        for entry in entries:
            image.put_entry(entry)
            self._unsynced.append((now, entry))
        if hard_state is not None and hard_state != image.hard_state:
            image.hard_state = hard_state
            self._unsynced.append((now, hard_state))

    def sync(self, now: int) -> None:
        self.syncs += 1
        if self.mutant == "ack_before_sync":
            self.write_back(now - self.writeback_ns)
            return
        self.write_back(now)

    def write_back(self, upto: int) -> None:
        """Make the records written at or before `upto` durable."""
        records = self._unsynced
        count = 0
        while count < len(records) and records[count][0] <= upto:
            count += 1
        for _, record in records[:count]:
            self._make_durable(record)
        del records[:count]

    def _make_durable(self, record) -> None:
        durable = self.durable
        if isinstance(record, Entry):
            durable.put_entry(record)
        elif self.mutant == "vote_not_persisted":
            old = durable.hard_state
            vote = old.vote if record.term == old.term else 0
            durable.hard_state = HardState(record.term, vote, record.commit)
        else:
            durable.hard_state = record

    def save_snapshot(self, snapshot: Snapshot, now: int) -> None:
        """Durable at once (temp file, fsync, rename); the log is synced with it."""
        if snapshot.meta.index < self.written.snapshot_index:
            raise DiskError(f"snapshot index {snapshot.meta.index} is below the stored one")
        self.written.put_snapshot(snapshot)
        self.write_back(now)
        self.durable.put_snapshot(snapshot)

    # -- crashing and recovering --------------------------------------------------------------

    def crash(self) -> int:
        """Lose the unsynced records but a random prefix; returns how many were lost."""
        records = self._unsynced
        kept = self.rng.randint(0, len(records)) if records else 0
        for _, record in records[:kept]:
            self._make_durable(record)
        lost = len(records) - kept
        self._unsynced = []
        self.written = self.durable.copy()
        return lost

    def recover(self) -> tuple[HardState, Snapshot | None, list[Entry]]:
        image = self.durable
        return image.hard_state, image.snapshot, list(image.entries)
