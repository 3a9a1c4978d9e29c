"""Regions of the disk tier: their states, the records in them, and the order of acks.

A region is FREE (no region header on disk, or a FREE one), OPENING (its header being
written), ACTIVE (the one region appended to), SEALED (full, or found at start: never appended
to again until reclaimed), RECLAIMING, or FAILED (a header write failed; out of service).

Writes to a region are acknowledged in offset order (`PendingWrite`, `Region.settle`):
recovery walks a region from its first record and stops at the first block that is not a
record header, so a record is only recoverable when every record before it in the region is
on disk. A record is therefore reported durable only once it and all earlier ones are; a
failed write whose header could not be made a valid DEAD header breaks the walk there, and
every later write of that region fails as well (the region is sealed).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass, field


class RegionState(enum.Enum):
    FREE = "free"  # no header, or a FREE one written by reclaim
    OPENING = "opening"
    ACTIVE = "active"
    SEALED = "sealed"
    RECLAIMING = "reclaiming"
    FAILED = "failed"


@dataclass(eq=False)
class RecordInfo:
    """A live record: what its header says, and who holds it."""
    namespace: str
    key: str
    size_bytes: int
    version: int
    value_crc: int
    region: int
    offset: int
    sequence: int
    pins: int = 0


class PendingWrite:
    """One write in a region, until it is acknowledged in offset order."""
    __slots__ = ("record", "error", "walkable", "resolved", "final")

    def __init__(self, record: RecordInfo, final: asyncio.Future):
        self.record = record
        self.error: BaseException | None = None
        self.walkable = True   # on disk there is a valid header at offset (LIVE or DEAD)
        self.resolved = False
        self.final = final     # its outcome for the writer: None or the exception


@dataclass(eq=False)
class Region:
    index: int
    file_index: int
    file_offset: int                 # where the region starts in its file
    state: RegionState = RegionState.FREE
    sequence: int = 0
    append_offset: int = 0           # next free byte (region-relative); 0 when FREE
    records: dict[int, RecordInfo] = field(default_factory=dict)  # live, by offset
    pins: int = 0                    # pins of its records, summed
    readers: int = 0                 # reads in flight
    pending: deque[PendingWrite] = field(default_factory=deque)
    broken: bool = False             # a failed write left the walk unable to pass it

    @property
    def busy(self) -> bool:
        """Cannot be reclaimed now."""
        return bool(self.pins or self.readers or self.pending)

    def reset(self) -> None:
        self.state = RegionState.FREE
        self.sequence = 0
        self.append_offset = 0
        self.records.clear()
        self.pins = 0
        self.broken = False

    def settle(self, make_error, on_written) -> None:
        """Acknowledge the writes at the front that are resolved, in offset order:
        on_written(record) for each that succeeded (before its writer resumes, so the record
        is held before anything else runs); make_error() builds the exception of a write
        behind a broken walk."""
        while self.pending and self.pending[0].resolved:
            entry = self.pending.popleft()
            outcome = entry.error
            if outcome is None and self.broken:
                outcome = make_error()
            if entry.error is not None and not entry.walkable:
                self.broken = True
            if outcome is None:
                on_written(entry.record)
            if not entry.final.done():
                entry.final.set_result(outcome)
