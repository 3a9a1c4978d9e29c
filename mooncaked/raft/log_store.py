"""The durable Raft log: checksummed records in append-only segment files, plus one snapshot file.

Directory layout:

    log-<16-digit sequence>.wal   segments; the name is the sequence number of the first record
                                  in the file (records are numbered 1, 2, ... across all segments)
    snapshot.bin                  the latest durable snapshot
    snapshot.bin.tmp              a snapshot being written; removed at open (it never got renamed)

A record is `[u32 payload_length][u32 crc32(type byte + payload)][u8 type][payload]`,
little-endian. ENTRY payload: `[u64 term][u64 index][u8 kind][data]`; HARD_STATE payload:
`[u64 term][u64 vote][u64 commit]`.

CRC-32 is enough here: it guards against torn writes and media bit rot, not against an
adversary, and it catches every burst of up to 32 bits and all but 2^-32 of other damage.
Record lengths are bounded by `max_record_bytes`, so a damaged length is treated as corruption
rather than an allocation.

Recovery rules:
- the latest HARD_STATE record wins; every new segment starts with the current hard state, so
  deleting older segments never loses it;
- an ENTRY at index i replaces whatever is stored at i and later (Raft's log truncation): on
  replay the later record wins and the suffix after it is dropped;
- entries at or below the snapshot index are covered by the snapshot and are not returned;
- a bad record at the end of the LAST segment with no valid record after it is a torn write
  (the process or machine died mid-write): the file is cut there and the node starts with the
  complete prefix. Any other damage raises `CorruptLog` and the node must not start.

Crash safety of `save_snapshot`: the snapshot is written to a temp file, fsynced and renamed
over snapshot.bin (then the directory is fsynced); only then does the log rotate to a fresh
segment (synced, with the hard state) and delete the oldest segments whose entries are all
covered, oldest first. Dying at any point leaves either the old snapshot with the full log, or
the new snapshot with a log whose surviving records replay to the same state.

A directory that `open` creates is made durable in its parent (and so on up), so a power loss
cannot take away a log that was already synced. All file I/O goes through `fs` (raft/fs.py;
the simulator passes a simulated disk). The first write or sync error is raised and stops the
store: from then on appends, syncs and snapshots raise `LogFailed`, as a partial record or an
fsync that lost its data makes the file's state unknown until a reopen reads it back.

fsync policy "batch": `sync()` fdatasyncs the current segment (the driver calls it once per
Ready batch, so one fsync covers a whole batch: group commit). "none": never fsync; the OS
flushes when it likes, so a power loss (not a process crash) can lose the unsynced tail, or
leave a non-final segment torn, which then opens as `CorruptLog`. For tests and benchmarks.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from mooncaked.raft.fs import OsFileSystem
from mooncaked.raft.types import ConfState, Entry, EntryKind, HardState, Snapshot, SnapshotMeta

FSYNC_BATCH = "batch"
FSYNC_NONE = "none"
FSYNC_POLICIES = (FSYNC_BATCH, FSYNC_NONE)

REC_ENTRY = 1
REC_HARD_STATE = 2

_RECORD_HEAD = struct.Struct("<IIB")  # payload length, crc32, type
_ENTRY_HEAD = struct.Struct("<QQB")  # term, index, kind
_HARD_STATE = struct.Struct("<QQQ")  # term, vote, commit
_CRC_SEED = {kind: zlib.crc32(bytes([kind])) for kind in (REC_ENTRY, REC_HARD_STATE)}
# A type byte a record header could carry; the resync scan looks for these (see _valid_record_after).
_TYPE_BYTES = re.compile(rb"[\x01\x02]")

_SEGMENT_NAME = re.compile(r"log-([0-9]{16})\.wal")  # matched in full (fullmatch)
SNAPSHOT_NAME = "snapshot.bin"
SNAPSHOT_TMP_NAME = "snapshot.bin.tmp"
_SNAPSHOT_MAGIC = b"MCSN"
_SNAPSHOT_VERSION = 1
_SNAPSHOT_HEAD = struct.Struct("<4sHHQI")  # magic, version, reserved, body length, crc32 of body
_SNAPSHOT_META = struct.Struct("<QQII")  # index, term, voter count, learner count

# Deciding "torn tail or corruption" may scan the rest of the last segment for a valid record;
# past this many bytes of candidate checksums we stop guessing and refuse to start.
_RESYNC_CRC_BUDGET_BYTES = 256 << 20


class CorruptLog(Exception):
    """Damage that is not a torn tail: the node must not start on this directory."""


class LogFailed(Exception):
    """An earlier write or sync failed, so what the disk holds is unknown: the store takes no
    more writes or syncs (close it; a fresh store opened on the directory recovers)."""


@dataclass
class Recovered:
    hard_state: HardState
    snapshot: Snapshot | None  # the latest durable snapshot, if any
    entries: list[Entry]  # every durable entry after the snapshot index, contiguous, in order
    truncated_bytes: int  # bytes of a torn tail cut off at open (0 normally)


@dataclass
class _Segment:
    path: str
    first_seq: int
    records: int = 0
    size_bytes: int = 0
    max_index: int = 0  # highest entry index physically in the file; 0: no entries


def segment_name(first_seq: int) -> str:
    return f"log-{first_seq:016d}.wal"


def encode_snapshot(snapshot: Snapshot) -> bytes:
    meta = snapshot.meta
    voters, learners = meta.conf_state.voters, meta.conf_state.learners
    body = b"".join((
        _SNAPSHOT_META.pack(meta.index, meta.term, len(voters), len(learners)),
        struct.pack(f"<{len(voters)}Q", *voters),
        struct.pack(f"<{len(learners)}Q", *learners),
        snapshot.data,
    ))
    head = _SNAPSHOT_HEAD.pack(_SNAPSHOT_MAGIC, _SNAPSHOT_VERSION, 0, len(body), zlib.crc32(body))
    return head + body


def decode_snapshot(raw: bytes, path: str) -> Snapshot:
    if len(raw) < _SNAPSHOT_HEAD.size:
        raise CorruptLog(f"{path}: {len(raw)} bytes is shorter than the snapshot header")
    magic, version, _reserved, body_length, crc = _SNAPSHOT_HEAD.unpack_from(raw)
    if magic != _SNAPSHOT_MAGIC:
        raise CorruptLog(f"{path}: bad magic {magic!r}")
    if version != _SNAPSHOT_VERSION:
        raise CorruptLog(f"{path}: unknown snapshot version {version}")
    body = memoryview(raw)[_SNAPSHOT_HEAD.size:]
    if len(body) != body_length:
        raise CorruptLog(f"{path}: header says {body_length} body bytes, file has {len(body)}")
    if zlib.crc32(body) != crc:
        raise CorruptLog(f"{path}: body checksum mismatch")
    if body_length < _SNAPSHOT_META.size:
        raise CorruptLog(f"{path}: body too short for the snapshot metadata")
    index, term, voter_count, learner_count = _SNAPSHOT_META.unpack_from(body)
    members_end = _SNAPSHOT_META.size + 8 * (voter_count + learner_count)
    if members_end > body_length:
        raise CorruptLog(f"{path}: member counts run past the body")
    members = struct.unpack_from(f"<{voter_count + learner_count}Q", body, _SNAPSHOT_META.size)
    conf_state = ConfState(voters=members[:voter_count], learners=members[voter_count:])
    return Snapshot(SnapshotMeta(index, term, conf_state), bytes(body[members_end:]))


class LogStore:
    def __init__(self, directory: str, *, fsync: str = FSYNC_BATCH,
                 segment_bytes: int = 64 << 20, max_record_bytes: int = 64 << 20,
                 fs=None) -> None:
        """`fs`: the file system to use (`OsFileSystem()` by default; see raft/fs.py)."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self._directory = directory
        self._fs = OsFileSystem() if fs is None else fs
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._max_record_bytes = max_record_bytes
        self._segments: list[_Segment] = []
        self._fd: int | None = None  # the current (last) segment, opened for appending
        self._next_seq = 1
        self._hard_state: HardState | None = None  # the latest one written, carried into new segments
        self._snapshot_index = 0
        self._last_index = 0
        self._unsynced = False  # the current segment has writes sync() has not covered
        self._directory_unsynced = False  # a segment file was created since the last sync()
        self._failed: OSError | None = None  # the first write or sync error; see LogFailed
        # Stats for metrics.
        self.bytes_written = 0  # record and snapshot bytes written to disk
        self.fsyncs = 0  # fsync and fdatasync calls, files and directory

    # -- stats --

    @property
    def segments(self) -> int:
        return len(self._segments)

    @property
    def first_index(self) -> int:
        """The first index the log can hold: everything below is covered by the snapshot."""
        return self._snapshot_index + 1

    @property
    def last_index(self) -> int:
        """The last entry index stored, or the snapshot index if no entry is after it."""
        return self._last_index

    # -- opening and recovery --

    @property
    def fsync(self) -> str:
        """The fsync policy: "batch" or "none"."""
        return self._fsync

    def open(self) -> Recovered:
        if self._fd is not None:
            raise RuntimeError("log store is already open")
        fs = self._fs
        self._failed = None
        self._make_directory()
        self._unsynced = self._directory_unsynced = False
        tmp_path = os.path.join(self._directory, SNAPSHOT_TMP_NAME)
        if fs.exists(tmp_path):
            fs.unlink(tmp_path)  # a save_snapshot that died before its rename
        snapshot = self._read_snapshot()
        self._snapshot_index = snapshot.meta.index if snapshot is not None else 0

        self._segments = self._list_segments()
        hard_state: HardState | None = None
        entries: list[Entry] = []
        truncated_bytes = 0
        valid_end = 0
        for position, segment in enumerate(self._segments):
            is_last = position == len(self._segments) - 1
            data = fs.read_file(segment.path)
            records, valid_end = self._scan(segment, data, is_last)
            truncated_bytes = len(data) - valid_end
            segment.records = len(records)
            segment.size_bytes = valid_end
            for offset, record in records:
                if isinstance(record, HardState):
                    hard_state = record
                    continue
                segment.max_index = max(segment.max_index, record.index)
                self._replay_entry(entries, record, segment.path, offset)
            if not is_last:
                following = self._segments[position + 1]
                if segment.first_seq + segment.records != following.first_seq:
                    raise CorruptLog(
                        f"{segment.path}: holds records {segment.first_seq}.."
                        f"{segment.first_seq + segment.records - 1} but the next segment starts"
                        f" at {following.first_seq}")

        if self._segments:
            last = self._segments[-1]
            self._fd = fs.open_append(last.path, create=False)
            if truncated_bytes:
                # Cut the torn tail off the file itself so that new records follow the prefix.
                fs.ftruncate(self._fd, valid_end)
                self._unsynced = True
            self._next_seq = last.first_seq + last.records
        else:
            self._next_seq = 1
            self._create_segment()

        self._hard_state = hard_state
        self._last_index = entries[-1].index if entries else self._snapshot_index
        if self._unsynced:
            self.sync()
        return Recovered(hard_state or HardState(), snapshot, entries, truncated_bytes)

    def _make_directory(self) -> None:
        """Create the directory and any missing parents, each with its entry made durable:
        a power loss must not take away a directory whose log a sync already promised."""
        fs = self._fs
        missing = []
        path = os.path.normpath(self._directory)
        while not fs.exists(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent in ("", path):
                break
            path = parent
        if not missing:
            return
        fs.makedirs(self._directory)
        if self._fsync != FSYNC_NONE:
            for path in missing:
                fs.fsync_directory(os.path.dirname(path) or os.curdir)
                self.fsyncs += 1

    def _read_snapshot(self) -> Snapshot | None:
        path = os.path.join(self._directory, SNAPSHOT_NAME)
        try:
            raw = self._fs.read_file(path)
        except FileNotFoundError:
            return None
        return decode_snapshot(raw, path)

    def _list_segments(self) -> list[_Segment]:
        segments = []
        for name in self._fs.listdir(self._directory):
            match = _SEGMENT_NAME.fullmatch(name)
            if match:
                segments.append(_Segment(os.path.join(self._directory, name), int(match[1])))
        segments.sort(key=lambda segment: segment.first_seq)
        return segments

    def _replay_entry(self, entries: list[Entry], entry: Entry, path: str, offset: int) -> None:
        if entry.index <= self._snapshot_index:
            # It replaced everything stored at its index and later, which includes every entry
            # after the snapshot seen so far; itself it is covered by the snapshot.
            entries.clear()
            return
        position = entry.index - self._snapshot_index - 1
        if position > len(entries):
            raise CorruptLog(
                f"{path}: entry {entry.index} at offset {offset} leaves a gap after index"
                f" {self._snapshot_index + len(entries)}")
        del entries[position:]
        entries.append(entry)

    def _scan(self, segment: _Segment, data: bytes,
              is_last: bool) -> tuple[list[tuple[int, Entry | HardState]], int]:
        """Decode a segment's records; return them with their offsets, and where they end."""
        view = memoryview(data)
        records: list[tuple[int, Entry | HardState]] = []
        offset = 0
        while offset < len(data):
            found = self._parse_at(view, offset)
            if found is None:
                if not is_last:
                    raise CorruptLog(f"{segment.path}: bad record at offset {offset}")
                if self._valid_record_after(view, offset, segment.path):
                    raise CorruptLog(
                        f"{segment.path}: bad record at offset {offset} with valid records after it")
                return records, offset  # a torn tail
            kind, payload_start, payload_end = found
            records.append((offset, self._decode(kind, view, payload_start, payload_end,
                                                  segment.path, offset)))
            offset = payload_end
        return records, offset

    def _parse_at(self, view: memoryview, offset: int) -> tuple[int, int, int] | None:
        """(type, payload start, payload end) of an intact record at offset, else None."""
        if len(view) - offset < _RECORD_HEAD.size:
            return None
        length, crc, kind = _RECORD_HEAD.unpack_from(view, offset)
        if kind == REC_ENTRY:
            if length < _ENTRY_HEAD.size:
                return None
        elif kind == REC_HARD_STATE:
            if length != _HARD_STATE.size:
                return None
        else:
            return None
        start = offset + _RECORD_HEAD.size
        if length > self._max_record_bytes or length > len(view) - start:
            return None
        if zlib.crc32(view[start:start + length], _CRC_SEED[kind]) != crc:
            return None
        return kind, start, start + length

    def _valid_record_after(self, view: memoryview, offset: int, path: str) -> bool:
        """Whether an intact record starts anywhere after a bad one at offset.

        The bad record's own length cannot be trusted, so try every position whose type byte
        could be a record's; the regex finds those at C speed, and most fail the length check
        before any checksum is computed.
        """
        budget_bytes = _RESYNC_CRC_BUDGET_BYTES
        for match in _TYPE_BYTES.finditer(view, offset + 1 + _RECORD_HEAD.size - 1):
            candidate = match.start() - (_RECORD_HEAD.size - 1)
            length = _RECORD_HEAD.unpack_from(view, candidate)[0]
            if length > len(view) - candidate - _RECORD_HEAD.size:
                continue
            budget_bytes -= length
            if budget_bytes < 0:
                raise CorruptLog(f"{path}: bad record at offset {offset} with too much data after"
                                 " it to tell a torn tail from corruption")
            if self._parse_at(view, candidate) is not None:
                return True
        return False

    def _decode(self, kind: int, view: memoryview, start: int, end: int, path: str,
                offset: int) -> Entry | HardState:
        if kind == REC_HARD_STATE:
            return HardState(*_HARD_STATE.unpack_from(view, start))
        term, index, entry_kind = _ENTRY_HEAD.unpack_from(view, start)
        try:
            entry_kind = EntryKind(entry_kind)
        except ValueError:
            raise CorruptLog(f"{path}: entry at offset {offset} has unknown kind {entry_kind}") from None
        if index == 0:
            raise CorruptLog(f"{path}: entry at offset {offset} has index 0")
        return Entry(term, index, entry_kind, bytes(view[start + _ENTRY_HEAD.size:end]))

    # -- writing --

    def append(self, entries: Sequence[Entry], hard_state: HardState | None) -> None:
        """Write entries (then the hard state) in one write; durable after `sync()`.

        An entry at index i replaces the stored entries at i and later.
        """
        if self._fd is None:
            raise RuntimeError("log store is not open")
        if self._failed is not None:
            self._refuse()
        if entries:
            self._check_indexes(entries)
        write_hard_state = hard_state is not None and hard_state != self._hard_state
        if not entries and not write_hard_state:
            return
        try:
            if self._segments[-1].size_bytes >= self._segment_bytes:
                self._rotate()
        except OSError as error:
            self._fail(error)
        parts: list[bytes] = []
        for entry in entries:
            head = _ENTRY_HEAD.pack(entry.term, entry.index, entry.kind)
            data = entry.data
            crc = zlib.crc32(data, zlib.crc32(head, _CRC_SEED[REC_ENTRY]))
            parts.append(_RECORD_HEAD.pack(len(head) + len(data), crc, REC_ENTRY))
            parts.append(head)
            parts.append(data)
        if write_hard_state:
            parts.append(self._hard_state_record(hard_state))
            self._hard_state = hard_state
        try:
            self._write(b"".join(parts), len(entries) + write_hard_state,
                        max((entry.index for entry in entries), default=0))
        except OSError as error:
            self._fail(error)
        if entries:
            self._last_index = entries[-1].index

    def _check_indexes(self, entries: Sequence[Entry]) -> None:
        # Refuse what recovery would reject (a gap) or misread (an index the snapshot covers),
        # rather than write a log the node cannot start from.
        first = entries[0].index
        if not self._snapshot_index < first <= self._last_index + 1:
            raise ValueError(f"entry index {first} must be in {self._snapshot_index + 1}.."
                             f"{self._last_index + 1}")
        for previous, entry in zip(entries, entries[1:]):
            if entry.index != previous.index + 1:
                raise ValueError(f"entry indexes not contiguous: {previous.index} then {entry.index}")
        for entry in entries:
            if _ENTRY_HEAD.size + len(entry.data) > self._max_record_bytes:
                raise ValueError(f"entry {entry.index} is over max_record_bytes")

    @staticmethod
    def _hard_state_record(hard_state: HardState) -> bytes:
        payload = _HARD_STATE.pack(hard_state.term, hard_state.vote, hard_state.commit)
        crc = zlib.crc32(payload, _CRC_SEED[REC_HARD_STATE])
        return _RECORD_HEAD.pack(len(payload), crc, REC_HARD_STATE) + payload

    def _write_all(self, fd: int, data: bytes | memoryview) -> None:
        write = self._fs.write
        view = memoryview(data)
        while view:
            view = view[write(fd, view):]

    def _write(self, data: bytes, records: int, max_index: int) -> None:
        self._write_all(self._fd, data)
        segment = self._segments[-1]
        segment.records += records
        segment.size_bytes += len(data)
        segment.max_index = max(segment.max_index, max_index)
        self._next_seq += records
        self.bytes_written += len(data)
        self._unsynced = True

    def sync(self) -> None:
        """Make everything appended so far durable (a no-op under fsync="none")."""
        if self._fsync == FSYNC_NONE or self._fd is None:
            return
        if self._failed is not None:
            self._refuse()
        try:
            if self._unsynced:
                self._fs.fdatasync(self._fd)
                self.fsyncs += 1
                self._unsynced = False
            if self._directory_unsynced:
                self._sync_directory()
        except OSError as error:
            self._fail(error)

    def _fail(self, error: OSError) -> None:
        """Stop taking writes after an I/O error, and raise it.

        After a failed write the file may hold part of a record, which any later record
        would turn from a torn tail into corruption; after a failed fsync the kernel may have
        dropped the dirty data and a retried fsync can succeed without writing it. Either way
        only a reopen (which re-reads what is really on disk) can go on safely.
        """
        if self._failed is None:
            self._failed = error
        raise error

    def _refuse(self) -> None:
        raise LogFailed(f"the log stopped at an earlier I/O error: {self._failed}") \
            from self._failed

    def _sync_directory(self) -> None:
        self._directory_unsynced = False
        if self._fsync == FSYNC_NONE:
            return
        self._fs.fsync_directory(self._directory)
        self.fsyncs += 1

    def _create_segment(self) -> None:
        segment = _Segment(os.path.join(self._directory, segment_name(self._next_seq)), self._next_seq)
        self._fd = self._fs.open_append(segment.path, create=True)
        self._segments.append(segment)
        self._directory_unsynced = True

    def _rotate(self) -> None:
        """Start a new segment that begins with the current hard state."""
        # The old segment must be complete on disk before a newer one can exist: only the last
        # segment may have a torn tail.
        self.sync()
        self._fs.close(self._fd)
        self._fd = None
        self._create_segment()
        if self._hard_state is not None:
            self._write(self._hard_state_record(self._hard_state), 1, 0)

    # -- snapshots and compaction --

    def save_snapshot(self, snapshot: Snapshot) -> None:
        """Store the snapshot durably and atomically, then drop segments it covers entirely."""
        if self._fd is None:
            raise RuntimeError("log store is not open")
        if self._failed is not None:
            self._refuse()
        index = snapshot.meta.index
        if index < self._snapshot_index:
            raise ValueError(f"snapshot index {index} is below the stored one {self._snapshot_index}")
        try:
            self._write_snapshot(encode_snapshot(snapshot), index)
        except OSError as error:
            self._fail(error)

    def _write_snapshot(self, raw: bytes, index: int) -> None:
        tmp_path = os.path.join(self._directory, SNAPSHOT_TMP_NAME)
        fs = self._fs
        fd = fs.open_truncate(tmp_path)
        try:
            self._write_all(fd, raw)
            if self._fsync != FSYNC_NONE:
                fs.fsync(fd)
                self.fsyncs += 1
        finally:
            fs.close(fd)
        self.bytes_written += len(raw)
        fs.replace(tmp_path, os.path.join(self._directory, SNAPSHOT_NAME))
        self._sync_directory()
        self._snapshot_index = index
        self._last_index = max(self._last_index, index)

        # Rotate so that the segment written so far can go once a later snapshot covers it,
        # and make the new one (it carries the hard state) durable before deleting any.
        if self._segments[-1].max_index:
            self._rotate()
        self.sync()
        self._delete_compacted()

    def _delete_compacted(self) -> None:
        # Oldest first and only a prefix: a crash midway leaves a contiguous run of segments,
        # and a record kept never depends on a deleted later one (which could truncate it).
        deleted = False
        while len(self._segments) > 1 and self._segments[0].max_index <= self._snapshot_index:
            self._fs.unlink(self._segments[0].path)
            del self._segments[0]
            deleted = True
        if deleted:
            self._sync_directory()

    def close(self) -> None:
        """Sync (unless an I/O error stopped the store) and close."""
        if self._fd is None:
            return
        try:
            if self._failed is None:
                self.sync()
        finally:
            self._fs.close(self._fd)
            self._fd = None
