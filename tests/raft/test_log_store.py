"""The durable Raft log: round trips, truncation, compaction, crashes, torn tails and corruption."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.raft.log_store import (
    SNAPSHOT_NAME, SNAPSHOT_TMP_NAME, CorruptLog, LogStore, segment_name)
from mooncaked.raft.types import ConfState, Entry, EntryKind, HardState, Snapshot, SnapshotMeta


def entry(index: int, term: int = 1, data: bytes | None = None) -> Entry:
    return Entry(term, index, EntryKind.NORMAL, f"cmd-{index}-{term}".encode() if data is None else data)


def snapshot(index: int, term: int = 1, data: bytes = b"state") -> Snapshot:
    return Snapshot(SnapshotMeta(index, term, ConfState((1, 2, 3), (4,))), data)


def open_store(directory, **options) -> tuple[LogStore, object]:
    store = LogStore(str(directory), **options)
    return store, store.open()


def reopen(directory, **options):
    store, recovered = open_store(directory, **options)
    store.close()
    return recovered


def segment_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".wal"))


def record_bounds(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each record, reading the documented header."""
    bounds, offset = [], 0
    while offset < len(data):
        length = struct.unpack_from("<I", data, offset)[0]
        bounds.append((offset, offset + 9 + length))
        offset += 9 + length
    return bounds


def entry_record(term: int, index: int, data: bytes) -> bytes:
    """An ENTRY record built from the documented format, independently of the store."""
    payload = struct.pack("<QQB", term, index, 0) + data
    return struct.pack("<IIB", len(payload), zlib.crc32(bytes([1]) + payload), 1) + payload


# -- round trips --


def test_empty_directory_opens_empty(tmp_path):
    recovered = reopen(tmp_path / "log")
    assert recovered.entries == [] and recovered.snapshot is None
    assert recovered.hard_state == HardState() and recovered.truncated_bytes == 0


def test_round_trip_entries_hard_state_and_snapshot(tmp_path):
    store, _ = open_store(tmp_path)
    entries = [entry(i) for i in range(1, 6)] + [Entry(2, 6, EntryKind.CONF_CHANGE, b"\x00conf")]
    store.append(entries[:3], HardState(1, 2, 0))
    store.append(entries[3:], HardState(2, 0, 4))
    store.sync()
    store.close()
    recovered = reopen(tmp_path)
    assert recovered.entries == entries
    assert recovered.hard_state == HardState(2, 0, 4)
    assert recovered.snapshot is None

    store, _ = open_store(tmp_path)
    snap = Snapshot(SnapshotMeta(3, 1, ConfState((1, 2), (7, 8))), b"\xff" * 1000)
    store.save_snapshot(snap)
    assert (store.first_index, store.last_index) == (4, 6)
    store.close()
    recovered = reopen(tmp_path)
    assert recovered.snapshot == snap
    assert recovered.entries == entries[3:]
    assert recovered.hard_state == HardState(2, 0, 4)


def test_stats(tmp_path):
    store, _ = open_store(tmp_path, segment_bytes=1 << 20)
    store.append([entry(i) for i in range(1, 11)], HardState(1, 1, 5))
    store.sync()
    assert store.bytes_written == os.path.getsize(tmp_path / segment_name(1))
    assert (store.segments, store.first_index, store.last_index) == (1, 1, 10)
    assert store.fsyncs >= 1
    store.close()


# -- truncation --


def test_later_entry_replaces_the_suffix(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(i, 1) for i in range(1, 6)], None)
    store.append([entry(3, 2), entry(4, 2)], None)
    assert store.last_index == 4
    store.close()
    assert reopen(tmp_path).entries == [entry(1), entry(2), entry(3, 2), entry(4, 2)]


def test_truncation_across_segments(tmp_path):
    store, _ = open_store(tmp_path, segment_bytes=100)
    for i in range(1, 21):
        store.append([entry(i, 1)], None)
    store.append([entry(5, 3)], None)
    store.append([entry(6, 3)], None)
    assert store.segments > 3
    store.close()
    recovered = reopen(tmp_path, segment_bytes=100)
    assert recovered.entries == [entry(i) for i in range(1, 5)] + [entry(5, 3), entry(6, 3)]


def test_append_refuses_gaps_and_covered_indexes(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1), entry(2)], None)
    with pytest.raises(ValueError):
        store.append([entry(4)], None)
    with pytest.raises(ValueError):
        store.append([entry(3), entry(5)], None)
    store.save_snapshot(snapshot(2))
    with pytest.raises(ValueError):
        store.append([entry(2, 2)], None)
    store.close()


# -- rotation and compaction --


def test_rotation_and_compaction_after_snapshot(tmp_path):
    store, _ = open_store(tmp_path, segment_bytes=200)
    store.append([], HardState(1, 1, 0))
    for i in range(1, 51):
        store.append([entry(i)], HardState(1, 1, i - 1) if i % 10 == 0 else None)
    store.sync()
    before = segment_files(tmp_path)
    assert len(before) > 5 and store.segments == len(before)

    store.save_snapshot(snapshot(30))
    after = segment_files(tmp_path)
    assert len(after) < len(before) and store.segments == len(after)
    # Every segment deleted held only entries the snapshot covers; those kept start where the
    # deleted ones stopped.
    deleted = sorted(set(before) - set(after))
    assert deleted == before[:len(deleted)]
    assert min(e.index for e in reopen_entries_of(tmp_path, after[0])) <= 31
    store.append([entry(51)], HardState(1, 1, 50))
    store.close()

    recovered = reopen(tmp_path, segment_bytes=200)
    assert recovered.snapshot == snapshot(30)
    assert recovered.entries == [entry(i) for i in range(31, 52)]
    assert recovered.hard_state == HardState(1, 1, 50)

    # A snapshot covering everything leaves only the newest segment, and the hard state with it.
    store, _ = open_store(tmp_path, segment_bytes=200)
    store.save_snapshot(snapshot(51))
    assert store.segments == 1 and len(segment_files(tmp_path)) == 1
    store.close()
    recovered = reopen(tmp_path)
    assert recovered.entries == [] and recovered.hard_state == HardState(1, 1, 50)
    assert recovered.snapshot == snapshot(51)


def reopen_entries_of(directory, name) -> list[Entry]:
    """Entries physically in one segment file (decoded by the documented format)."""
    with open(os.path.join(directory, name), "rb") as file:
        data = file.read()
    found = []
    for start, _end in record_bounds(data):
        if data[start + 8] == 1:
            term, index = struct.unpack_from("<QQ", data, start + 9)
            found.append(Entry(term, index))
    return found


def test_snapshot_beyond_the_log_then_new_entries(tmp_path):
    # A follower far behind installs a snapshot past its last entry.
    store, _ = open_store(tmp_path, segment_bytes=100)
    store.append([entry(i) for i in range(1, 6)], HardState(1, 0, 3))
    store.save_snapshot(snapshot(20, 2))
    assert (store.first_index, store.last_index) == (21, 20)
    store.append([entry(21, 2), entry(22, 2)], HardState(2, 0, 21))
    store.close()
    recovered = reopen(tmp_path)
    assert recovered.snapshot == snapshot(20, 2)
    assert recovered.entries == [entry(21, 2), entry(22, 2)]
    assert recovered.hard_state == HardState(2, 0, 21)


def test_truncation_below_the_snapshot_drops_what_it_replaced(tmp_path):
    # Records before the snapshot: 1..10, then 2' (which replaced 3..10). The snapshot is at 2,
    # so nothing after it survives.
    store, _ = open_store(tmp_path, segment_bytes=80)
    store.append([entry(i) for i in range(1, 11)], None)
    store.append([entry(2, 2)], None)
    store.save_snapshot(snapshot(2, 2))
    store.close()
    assert reopen(tmp_path).entries == []


# -- a crash inside save_snapshot --


class Crash(Exception):
    pass


def crash(*_args, **_kwargs):
    raise Crash()


def build_for_snapshot(directory) -> LogStore:
    store, _ = open_store(directory, segment_bytes=150)
    for i in range(1, 31):
        store.append([entry(i)], HardState(1, 1, i) if i % 7 == 0 else None)
        if i == 20:
            store.save_snapshot(snapshot(10))
    store.sync()
    return store


@pytest.mark.parametrize("step", ["before_rename", "before_rotate", "before_delete", "mid_delete"])
def test_crash_during_save_snapshot(tmp_path, monkeypatch, step):
    store = build_for_snapshot(tmp_path)
    segments_before = segment_files(tmp_path)
    with monkeypatch.context() as patch:
        if step == "before_rename":
            patch.setattr(os, "replace", crash)
        elif step == "before_rotate":
            patch.setattr(store, "_rotate", crash)
        elif step == "before_delete":
            patch.setattr(store, "_delete_compacted", crash)
        else:
            real_unlink, calls = os.unlink, []

            def unlink_once(path):
                calls.append(path)
                if len(calls) > 1:
                    raise Crash()
                real_unlink(path)
            patch.setattr(os, "unlink", unlink_once)
        with pytest.raises(Crash):
            store.save_snapshot(snapshot(25, 1, b"newer"))
    # The process "dies" here: the store is abandoned without close().

    if step == "before_rename":
        assert os.path.exists(tmp_path / SNAPSHOT_TMP_NAME)
        expected_snapshot, first = snapshot(10), 11
    else:
        expected_snapshot, first = snapshot(25, 1, b"newer"), 26
    if step == "mid_delete":
        assert len(segment_files(tmp_path)) == len(segments_before)  # the new one, one deleted

    store, recovered = open_store(tmp_path, segment_bytes=150)
    assert not os.path.exists(tmp_path / SNAPSHOT_TMP_NAME)
    assert recovered.snapshot == expected_snapshot
    assert recovered.entries == [entry(i) for i in range(first, 31)]
    assert recovered.hard_state == HardState(1, 1, 28)
    # The store works on: more entries, another snapshot that compacts, another reopen.
    store.append([entry(31)], HardState(1, 1, 31))
    store.save_snapshot(snapshot(30, 1, b"newest"))
    store.close()
    recovered = reopen(tmp_path)
    assert recovered.snapshot == snapshot(30, 1, b"newest")
    assert recovered.entries == [entry(31)]
    assert recovered.hard_state == HardState(1, 1, 31)


def test_leftover_temp_snapshot_is_ignored(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1)], None)
    store.close()
    (tmp_path / SNAPSHOT_TMP_NAME).write_bytes(b"half a snapsh")
    recovered = reopen(tmp_path)
    assert recovered.snapshot is None and recovered.entries == [entry(1)]
    assert not os.path.exists(tmp_path / SNAPSHOT_TMP_NAME)


# -- torn tails --


TAIL_BATCHES = [([entry(1)], None), ([entry(2)], None), ([], HardState(1, 1, 1)),
                ([entry(3)], None), ([entry(4)], None), ([], HardState(2, 2, 3)), ([entry(5)], None)]


def write_tail_log(directory) -> bytes:
    """One segment, one record per batch (TAIL_BATCHES); returns its bytes."""
    store, _ = open_store(directory, fsync="none")
    for entries, hard_state in TAIL_BATCHES:
        store.append(entries, hard_state)
    store.close()
    with open(os.path.join(directory, segment_name(1)), "rb") as file:
        return file.read()


def expected_after(complete: int) -> tuple[list[Entry], HardState]:
    entries, hard_state = [], HardState()
    for batch_entries, batch_hard_state in TAIL_BATCHES[:complete]:
        entries += batch_entries
        hard_state = batch_hard_state or hard_state
    return entries, hard_state


def open_with_segment(directory, data: bytes, **options):
    os.makedirs(directory)
    with open(os.path.join(directory, segment_name(1)), "wb") as file:
        file.write(data)
    return open_store(directory, fsync="none", **options)


def test_torn_tail_at_every_byte_of_the_last_records(tmp_path):
    data = write_tail_log(tmp_path / "source")
    bounds = record_bounds(data)
    assert len(bounds) == len(TAIL_BATCHES)
    for cut in range(bounds[-4][0], len(data) + 1):
        complete = sum(1 for _start, end in bounds if end <= cut)
        boundary = bounds[complete - 1][1]
        directory = tmp_path / f"cut{cut}"
        store, recovered = open_with_segment(directory, data[:cut])
        entries, hard_state = expected_after(complete)
        assert (recovered.entries, recovered.hard_state) == (entries, hard_state), cut
        assert recovered.truncated_bytes == cut - boundary
        assert os.path.getsize(directory / segment_name(1)) == boundary
        # Appending after the cut lands on a clean boundary.
        store.append([entry(entries[-1].index + 1, 9)], HardState(9, 0, 0))
        store.close()
        recovered = reopen(directory)
        assert recovered.entries == entries + [entry(entries[-1].index + 1, 9)]
        assert recovered.hard_state == HardState(9, 0, 0) and recovered.truncated_bytes == 0


def test_zeroed_tail_is_torn(tmp_path):
    # A crash can leave the file longer than what reached it, filled with zeros.
    data = write_tail_log(tmp_path / "source")
    _store, recovered = open_with_segment(tmp_path / "log", data + bytes(4096))
    assert recovered.entries == expected_after(len(TAIL_BATCHES))[0]
    assert recovered.truncated_bytes == 4096


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_bit_flip_in_the_last_record_is_a_torn_tail(tmp_path, mask):
    data = write_tail_log(tmp_path / "source")
    start, end = record_bounds(data)[-1]
    for position in range(start, end):
        damaged = bytearray(data)
        damaged[position] ^= mask
        store, recovered = open_with_segment(tmp_path / f"flip{position}", bytes(damaged))
        store.close()
        assert (recovered.entries, recovered.hard_state) == expected_after(len(TAIL_BATCHES) - 1)
        assert recovered.truncated_bytes == end - start


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_bit_flip_in_a_middle_record_is_corruption(tmp_path, mask):
    data = write_tail_log(tmp_path / "source")
    start, end = record_bounds(data)[-4]
    for position in range(start, end):
        damaged = bytearray(data)
        damaged[position] ^= mask
        with pytest.raises(CorruptLog, match=rf"{segment_name(1)}: bad record at offset {start}"):
            open_with_segment(tmp_path / f"flip{position}", bytes(damaged))


def multi_segment_log(directory) -> list[str]:
    store, _ = open_store(directory, segment_bytes=100)
    for i in range(1, 16):
        store.append([entry(i)], None)
    store.close()
    names = segment_files(directory)
    assert len(names) >= 3
    return names


def test_damage_in_a_non_last_segment_is_corruption(tmp_path):
    names = multi_segment_log(tmp_path)
    path = tmp_path / names[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last record of a segment that is not the last one
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLog, match=names[0]):
        reopen(tmp_path)


def test_missing_middle_segment_is_corruption(tmp_path):
    names = multi_segment_log(tmp_path)
    os.unlink(tmp_path / names[1])
    with pytest.raises(CorruptLog):
        reopen(tmp_path)


def test_gap_in_entry_indexes_is_corruption(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1), entry(2)], None)
    store.close()
    with open(tmp_path / segment_name(1), "ab") as file:
        file.write(entry_record(1, 4, b"skips three"))
    with pytest.raises(CorruptLog, match="gap"):
        reopen(tmp_path)


def test_records_match_the_documented_format(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1, 3, b"abc")], None)
    store.close()
    assert (tmp_path / segment_name(1)).read_bytes() == entry_record(3, 1, b"abc")


def test_oversized_record_length_is_corruption_not_an_allocation(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1, 1, b"x" * 1000), entry(2)], None)
    store.close()
    # Read with a smaller bound, the first record's length is out of range, and valid ones follow.
    with pytest.raises(CorruptLog, match="offset 0"):
        reopen(tmp_path, max_record_bytes=500)


def test_append_refuses_records_over_the_bound(tmp_path):
    store, _ = open_store(tmp_path, max_record_bytes=100)
    with pytest.raises(ValueError):
        store.append([entry(1, 1, b"y" * 200)], None)
    store.close()


# -- snapshot file damage --


@pytest.mark.parametrize("damage", ["body_byte", "magic", "truncated", "crc_field"])
def test_bad_snapshot_is_corruption(tmp_path, damage):
    store, _ = open_store(tmp_path)
    store.append([entry(i) for i in range(1, 4)], None)
    store.save_snapshot(snapshot(2, 1, b"some state"))
    store.close()
    path = tmp_path / SNAPSHOT_NAME
    data = bytearray(path.read_bytes())
    if damage == "body_byte":
        data[-3] ^= 0x10
    elif damage == "magic":
        data[0] ^= 0x10
    elif damage == "crc_field":
        data[16] ^= 0x10
    else:
        del data[-1]
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLog, match=SNAPSHOT_NAME):
        reopen(tmp_path)


# -- fsync policy --


def count_syncs(monkeypatch) -> dict[str, int]:
    counts = {"fdatasync": 0, "fsync": 0}
    for name in counts:
        real = getattr(os, name)

        def counted(fd, name=name, real=real):
            counts[name] += 1
            real(fd)
        monkeypatch.setattr(os, name, counted)
    return counts


def test_batch_policy_fdatasyncs_once_per_sync(tmp_path, monkeypatch):
    counts = count_syncs(monkeypatch)
    store, _ = open_store(tmp_path, fsync="batch")
    store.append([entry(1), entry(2)], HardState(1, 1, 0))
    store.append([entry(3)], None)
    assert counts["fdatasync"] == 0  # appends only write
    store.sync()
    assert counts["fdatasync"] == 1
    store.sync()  # nothing new: no second fsync
    assert counts["fdatasync"] == 1
    store.append([], HardState(1, 1, 3))
    store.sync()
    assert counts["fdatasync"] == 2
    store.save_snapshot(snapshot(2))
    assert counts["fsync"] >= 2  # the snapshot file and the directory
    assert store.fsyncs == counts["fdatasync"] + counts["fsync"]
    store.close()


def test_none_policy_never_syncs(tmp_path, monkeypatch):
    counts = count_syncs(monkeypatch)
    store, _ = open_store(tmp_path, fsync="none", segment_bytes=100)
    for i in range(1, 20):
        store.append([entry(i)], HardState(1, 1, i))
        store.sync()
    store.save_snapshot(snapshot(10))
    store.close()
    store, recovered = open_store(tmp_path, fsync="none")
    store.close()
    assert recovered.entries == [entry(i) for i in range(11, 20)]
    assert counts == {"fdatasync": 0, "fsync": 0} and store.fsyncs == 0


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError):
        LogStore(str(tmp_path), fsync="always")


# -- random sequences against an in-memory oracle --


OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 1000), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("snapshot"), st.integers(0, 1000), st.just(0), st.just(False)),
    st.tuples(st.just("reopen"), st.just(0), st.just(0), st.just(False)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS, segment_bytes=st.sampled_from([60, 300, 1 << 20]))
def test_random_sequences_match_an_oracle(operations, segment_bytes):
    with tempfile.TemporaryDirectory() as directory:
        options = {"fsync": "none", "segment_bytes": segment_bytes}
        store, _ = open_store(directory, **options)
        oracle_snapshot: Snapshot | None = None
        oracle_entries: list[Entry] = []
        oracle_hard_state = HardState()

        def check(recovered):
            assert recovered.snapshot == oracle_snapshot
            assert recovered.entries == oracle_entries
            assert recovered.hard_state == oracle_hard_state
            assert recovered.truncated_bytes == 0

        for step, (kind, pick, count, with_hard_state) in enumerate(operations):
            snapshot_index = oracle_snapshot.meta.index if oracle_snapshot else 0
            last = oracle_entries[-1].index if oracle_entries else snapshot_index
            if kind == "append":
                start = snapshot_index + 1 + pick % (last - snapshot_index + 1)
                new = [Entry(step, start + k, EntryKind(pick % 2), f"{step}.{k}".encode())
                       for k in range(count)]
                hard_state = HardState(step, pick % 3, pick % 5) if with_hard_state else None
                store.append(new, hard_state)
                if new:
                    oracle_entries = [e for e in oracle_entries if e.index < start] + new
                oracle_hard_state = hard_state or oracle_hard_state
            elif kind == "snapshot":
                index = snapshot_index + pick % (last - snapshot_index + 3)
                oracle_snapshot = Snapshot(SnapshotMeta(index, step, ConfState((1, step))),
                                           f"state {step}".encode())
                store.save_snapshot(oracle_snapshot)
                oracle_entries = [e for e in oracle_entries if e.index > index]
            else:
                store.close()
                store, recovered = open_store(directory, **options)
                check(recovered)
            store.sync()
            snapshot_index = oracle_snapshot.meta.index if oracle_snapshot else 0
            assert store.first_index == snapshot_index + 1
            assert store.last_index == (oracle_entries[-1].index if oracle_entries else snapshot_index)
            assert store.segments == len(segment_files(directory))
        store.close()
        check(reopen(directory, **options))


def test_only_whole_segment_names_are_segments(tmp_path):
    store, _ = open_store(tmp_path)
    store.append([entry(1), entry(2)], None)
    store.close()
    (name,) = segment_files(tmp_path)
    # A stray file whose name is a segment's plus a newline is not read as a segment.
    with open(os.path.join(tmp_path, name), "rb") as f:
        data = f.read()
    with open(os.path.join(tmp_path, name + "\n"), "wb") as f:
        f.write(data)
    store, recovered = open_store(tmp_path)
    assert recovered.entries == [entry(1), entry(2)]
    assert store.segments == 1
    store.close()
