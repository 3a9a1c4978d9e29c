"""The simulated disk (sim/disk.py SimFileSystem) and the real log store running on it.

The file system alone first: what a power loss keeps and loses, faults, determinism. Then
raft/log_store.py on it: what a sync promises survives a crash, what it does not is lost, a
torn tail is cut at reopen, a snapshot interrupted anywhere leaves a log that replays to the
same entries, and write or sync errors surface and stop the store. The properties that need no
power loss run on the real file system too (parametrized over both).
"""

from __future__ import annotations

import asyncio
import errno
import random

import pytest

from mooncaked.cluster.raft_node import RaftNode
from mooncaked.meta import commands
from mooncaked.raft.fs import OsFileSystem
from mooncaked.raft.log_store import SNAPSHOT_NAME, SNAPSHOT_TMP_NAME, LogFailed, LogStore
from mooncaked.raft.types import ConfState, Entry, EntryKind, HardState, Role, Snapshot, SnapshotMeta
from mooncaked.sim.disk import SimFileSystem


def entry(index: int, term: int = 1, size: int = 0) -> Entry:
    return Entry(term, index, EntryKind.NORMAL, f"cmd-{index}-{term}".encode() + bytes(size))


def entries(first: int, last: int, term: int = 1, size: int = 0) -> list[Entry]:
    return [entry(i, term, size) for i in range(first, last + 1)]


def snapshot(index: int, data: bytes = b"state") -> Snapshot:
    return Snapshot(SnapshotMeta(index, 1, ConfState((1, 2, 3))), data)


class Crash(Exception):
    """The power went out here."""


# -- the file system alone ---------------------------------------------------------------------


def write_file(fs, path: str, data: bytes) -> int:
    fd = fs.open_append(path, create=True)
    assert fs.write(fd, data) == len(data)
    return fd


def test_synced_data_and_entries_survive_a_crash_and_the_rest_is_lost():
    fs = SimFileSystem()
    fs.makedirs("/d")
    fs.fsync_directory("/")
    fd = write_file(fs, "/d/a", b"synced")
    fs.fdatasync(fd)
    fs.fsync_directory("/d")
    fs.write(fd, b" not synced")
    fd_b = write_file(fs, "/d/b", b"file synced, entry not")
    fs.fsync(fd_b)
    assert fs.read_file("/d/a") == b"synced not synced"
    fs.crash()
    assert fs.listdir("/d") == ["a"]
    assert fs.read_file("/d/a") == b"synced"
    with pytest.raises(OSError) as closed:
        fs.write(fd, b"x")  # no descriptor survives
    assert closed.value.errno == errno.EBADF


def test_a_directory_made_but_not_synced_in_its_parent_is_lost():
    fs = SimFileSystem()
    fs.makedirs("/data/node-1")
    fd = write_file(fs, "/data/node-1/log", b"abc")
    fs.fsync(fd)
    fs.fsync_directory("/data/node-1")
    fs.crash()
    assert not fs.exists("/data")


def test_unlink_and_replace_take_effect_at_a_crash_only_once_the_directory_is_synced():
    fs = SimFileSystem()
    for name, data in (("old", b"old"), ("target", b"target")):
        fs.fsync(write_file(fs, f"/{name}", data))
    fs.fsync_directory("/")
    fs.unlink("/old")
    fs.fsync(write_file(fs, "/new", b"new"))
    fs.replace("/new", "/target")
    assert fs.listdir("/") == ["target"] and fs.read_file("/target") == b"new"
    fs.crash()
    assert fs.listdir("/") == ["old", "target"]
    assert fs.read_file("/target") == b"target"
    fs.unlink("/old")
    fs.fsync(write_file(fs, "/new", b"new"))
    fs.replace("/new", "/target")
    fs.fsync_directory("/")
    fs.crash()
    assert fs.listdir("/") == ["target"] and fs.read_file("/target") == b"new"


def test_a_torn_crash_keeps_a_prefix_and_a_rename_is_atomic():
    kept_lengths = set()
    for seed in range(60):
        fs = SimFileSystem(random.Random(seed))
        fd = write_file(fs, "/a", b"0123")
        fs.fsync(fd)
        fs.fsync_directory("/")
        fs.write(fd, b"456789")
        fs.fsync(write_file(fs, "/tmp", b"new"))
        fs.replace("/tmp", "/b")
        fs.crash()
        data = fs.read_file("/a")
        assert b"0123456789".startswith(data) and len(data) >= 4
        kept_lengths.add(len(data))
        # The rename is one change: either it happened or nothing did, never half of it.
        assert fs.listdir("/") in (["a"], ["a", "b"], ["a", "tmp"])
        if fs.exists("/b"):
            assert fs.read_file("/b") == b"new"
    assert len(kept_lengths) > 3  # the tears fall in different places


def test_same_seed_same_crash():
    def run(seed):
        fs = SimFileSystem(random.Random(seed))
        for i in range(5):
            fd = write_file(fs, f"/f{i}", bytes(range(50)))
            if i % 2:
                fs.fsync(fd)
        fs.crash()
        return [(name, fs.read_file(f"/{name}")) for name in fs.listdir("/")]
    assert run(7) == run(7)
    assert len({repr(run(seed)) for seed in range(10)}) > 1


def test_eio_on_write_stores_nothing_and_on_sync_makes_nothing_durable():
    fs = SimFileSystem()
    fd = write_file(fs, "/a", b"abc")
    fs.fsync_directory("/")
    fs.fail_writes()
    with pytest.raises(OSError) as failed:
        fs.write(fd, b"def")
    assert failed.value.errno == errno.EIO
    assert fs.read_file("/a") == b"abc"
    fs.fail_syncs()
    with pytest.raises(OSError) as failed:
        fs.fdatasync(fd)
    assert failed.value.errno == errno.EIO
    assert fs.write(fd, b"def") == 3  # one failure each, as asked
    fs.crash()
    assert fs.read_file("/a") == b""


def test_a_full_disk_writes_what_fits_then_refuses_and_frees_on_unlink():
    fs = SimFileSystem(capacity_bytes=10)
    fd = write_file(fs, "/a", b"123456")
    assert fs.write(fd, b"7890abc") == 4  # a short write
    with pytest.raises(OSError) as full:
        fs.write(fd, b"x")
    assert full.value.errno == errno.ENOSPC
    assert fs.used_bytes == 10
    fs.close(fd)
    fs.unlink("/a")
    assert fs.used_bytes == 0
    fs.close(write_file(fs, "/b", b"0123456789"))
    fs.capacity_bytes = None
    assert fs.used_bytes == 10


def test_a_process_death_closes_files_and_keeps_every_write():
    fs = SimFileSystem()
    fd = write_file(fs, "/a", b"never synced")
    fs.close_all()
    with pytest.raises(OSError):
        fs.write(fd, b"x")
    assert fs.read_file("/a") == b"never synced"


# -- the log store on it -----------------------------------------------------------------------


class FailingOsFileSystem(OsFileSystem):
    """The real file system, with the sim's write and sync faults injected in front of it."""

    def __init__(self) -> None:
        self.failing_writes = self.failing_syncs = 0
        self.capacity_bytes: int | None = None
        self.written_bytes = 0

    def fail_writes(self, count: int = 1) -> None:
        self.failing_writes += count

    def fail_syncs(self, count: int = 1) -> None:
        self.failing_syncs += count

    def write(self, fd, data):
        if self.failing_writes:
            self.failing_writes -= 1
            raise OSError(errno.EIO, "injected")
        if self.capacity_bytes is not None:
            room = self.capacity_bytes - self.written_bytes
            if room <= 0:
                raise OSError(errno.ENOSPC, "injected")
            data = data[:room]
        count = super().write(fd, data)
        self.written_bytes += count
        return count

    def _sync(self) -> None:
        if self.failing_syncs:
            self.failing_syncs -= 1
            raise OSError(errno.EIO, "injected")

    def fdatasync(self, fd):
        self._sync()
        super().fdatasync(fd)

    def fsync(self, fd):
        self._sync()
        super().fsync(fd)

    def fsync_directory(self, path):
        self._sync()
        super().fsync_directory(path)


@pytest.fixture(params=["os", "sim"])
def disk(request, tmp_path):
    """(file system, log directory): the real one in a temp dir, or a fresh simulated one."""
    if request.param == "os":
        return FailingOsFileSystem(), str(tmp_path / "data" / "node-1")
    return SimFileSystem(), "/data/node-1"


def open_store(fs, directory, **options):
    store = LogStore(directory, fs=fs, **options)
    return store, store.open()


def test_round_trip_with_rotation_and_snapshot(disk):
    fs, directory = disk
    store, recovered = open_store(fs, directory, segment_bytes=200)
    assert recovered.entries == [] and recovered.snapshot is None
    for i in range(1, 21):
        store.append([entry(i)], HardState(1, 1, i - 1))
    store.save_snapshot(snapshot(10))
    store.append(entries(21, 25), HardState(1, 1, 24))
    store.close()
    store, recovered = open_store(fs, directory)
    store.close()
    assert recovered.snapshot == snapshot(10)
    assert recovered.entries == entries(11, 25)
    assert recovered.hard_state == HardState(1, 1, 24)
    assert SNAPSHOT_TMP_NAME not in fs.listdir(directory)


def test_synced_entries_survive_a_crash_of_a_fresh_log():
    # The directory itself is new: its own entry in the parent must be durable too.
    fs = SimFileSystem()
    store, _ = open_store(fs, "/data/node-1")
    store.append(entries(1, 3), HardState(1, 1, 2))
    store.sync()
    fs.crash()
    store, recovered = open_store(fs, "/data/node-1")
    assert recovered.entries == entries(1, 3)
    assert recovered.hard_state == HardState(1, 1, 2)


def test_unsynced_entries_are_lost_at_a_crash():
    fs = SimFileSystem()
    store, _ = open_store(fs, "/data/node-1", segment_bytes=150)
    store.append(entries(1, 4), HardState(1, 1, 2))
    store.sync()
    store.append(entries(5, 12), HardState(2, 2, 4))  # rotates: a new segment, never synced
    fs.crash()
    store, recovered = open_store(fs, "/data/node-1")
    assert recovered.entries == entries(1, 4)
    assert recovered.hard_state == HardState(1, 1, 2)
    assert recovered.truncated_bytes == 0
    # It goes on from there, and what it syncs now survives the next crash.
    store.append(entries(5, 6, term=2), HardState(2, 1, 4))
    store.sync()
    fs.crash()
    _, recovered = open_store(fs, "/data/node-1")
    assert recovered.entries == entries(1, 4) + entries(5, 6, term=2)


def test_a_torn_tail_is_cut_at_reopen():
    torn = 0
    for seed in range(40):
        fs = SimFileSystem(random.Random(seed))
        store, _ = open_store(fs, "/data/node-1")
        store.append(entries(1, 3), HardState(1, 1, 2))
        store.sync()
        for i in range(4, 9):
            store.append([entry(i, size=30)], None)  # one record per write, none synced
        fs.crash()
        store, recovered = open_store(fs, "/data/node-1")
        kept = len(recovered.entries)
        assert 3 <= kept <= 8
        assert recovered.entries == [entry(1), entry(2), entry(3)] + [
            entry(i, size=30) for i in range(4, kept + 1)]
        torn += recovered.truncated_bytes > 0
        # The cut is made durable: new records follow the prefix and survive the next crash.
        store.append([entry(kept + 1, term=2)], HardState(2, 1, 3))
        store.sync()
        fs.crash()
        _, again = open_store(fs, "/data/node-1")
        assert again.entries == recovered.entries + [entry(kept + 1, term=2)]
        assert again.truncated_bytes == 0
    assert torn > 10  # most tears fall inside a record


def sync_points_of_a_snapshot() -> int:
    fs = SimFileSystem()
    store = build_snapshot_log(fs)
    before = fs.syncs
    store.save_snapshot(snapshot(25, b"newer"))
    return fs.syncs - before


def build_snapshot_log(fs) -> LogStore:
    store, _ = open_store(fs, "/data/node-1", segment_bytes=150)
    for i in range(1, 31):
        store.append([entry(i)], HardState(1, 1, i) if i % 7 == 0 else None)
        if i == 20:
            store.save_snapshot(snapshot(10))
    store.sync()
    return store


class CrashAtSync:
    """The n-th sync (file or directory) from now raises Crash without syncing; the caller
    then calls crash(): the power went out just before that sync."""

    def __init__(self, fs: SimFileSystem, n: int) -> None:
        self.left = n
        for name in ("fsync", "fdatasync", "fsync_directory"):
            real = getattr(fs, name)
            setattr(fs, name, self._wrap(fs, real))

    def _wrap(self, fs, real):
        def sync(target):
            self.left -= 1
            if self.left == 0:
                raise Crash()
            return real(target)
        return sync


def test_a_snapshot_crashing_before_its_directory_sync_leaves_the_old_one():
    fs = SimFileSystem()
    store = build_snapshot_log(fs)
    real_fsync_directory = fs.fsync_directory

    def crash_instead(path):
        raise Crash()
    fs.fsync_directory = crash_instead
    with pytest.raises(Crash):
        store.save_snapshot(snapshot(25, b"newer"))
    fs.crash()
    # The rename and the temp file were never made durable: both are gone.
    assert SNAPSHOT_TMP_NAME not in fs.listdir("/data/node-1")
    assert SNAPSHOT_NAME in fs.listdir("/data/node-1")
    fs.fsync_directory = real_fsync_directory
    store, recovered = open_store(fs, "/data/node-1", segment_bytes=150)
    assert recovered.snapshot == snapshot(10)
    assert recovered.entries == entries(11, 30)
    assert recovered.hard_state == HardState(1, 1, 28)


@pytest.mark.parametrize("seed", range(6))
def test_a_snapshot_interrupted_at_any_sync_replays_to_the_same_log(seed):
    points = sync_points_of_a_snapshot()
    assert points >= 4  # temp file, directory (rename), new segment, directory (deletes)
    for crash_at in range(1, points + 1):
        fs = SimFileSystem(random.Random(seed * 100 + crash_at))
        store = build_snapshot_log(fs)
        CrashAtSync(fs, crash_at)
        with pytest.raises(Crash):
            store.save_snapshot(snapshot(25, b"newer"))
        fs.crash()
        store, recovered = open_store(fs, "/data/node-1", segment_bytes=150)
        if recovered.snapshot == snapshot(10):
            assert recovered.entries == entries(11, 30)
        else:
            assert recovered.snapshot == snapshot(25, b"newer")
            assert recovered.entries == entries(26, 30)
        assert recovered.hard_state == HardState(1, 1, 28)


@pytest.mark.parametrize("fault", ["write", "sync"])
def test_an_io_error_surfaces_and_stops_the_store(disk, fault):
    fs, directory = disk
    store, _ = open_store(fs, directory)
    store.append(entries(1, 2), HardState(1, 1, 1))
    store.sync()
    if fault == "write":
        fs.fail_writes()
        with pytest.raises(OSError) as failed:
            store.append([entry(3)], None)
    else:
        store.append([entry(3)], None)
        fs.fail_syncs()
        with pytest.raises(OSError) as failed:
            store.sync()
    assert failed.value.errno == errno.EIO
    # A failed sync may have dropped the data it was to write (Linux marks the pages clean),
    # so a retry that succeeds would promise what is not on disk: the store takes no more.
    with pytest.raises(LogFailed):
        store.sync()
    with pytest.raises(LogFailed):
        store.append([entry(3)], None)
    with pytest.raises(LogFailed):
        store.save_snapshot(snapshot(2))
    store.close()
    store, recovered = open_store(fs, directory)
    assert recovered.entries[:2] == entries(1, 2)


def test_a_full_disk_surfaces_and_the_partial_record_is_cut_at_reopen(disk):
    fs, directory = disk
    store, _ = open_store(fs, directory)
    store.append(entries(1, 2), HardState(1, 1, 1))
    store.sync()
    fs.capacity_bytes = (fs.used_bytes if isinstance(fs, SimFileSystem) else fs.written_bytes) + 20
    with pytest.raises(OSError) as failed:
        store.append([entry(3, size=100)], None)  # 20 bytes of it fit
    assert failed.value.errno == errno.ENOSPC
    fs.capacity_bytes = None  # space again: still no write after the partial record
    with pytest.raises(LogFailed):
        store.append([entry(3)], None)
    store.close()
    store, recovered = open_store(fs, directory)
    assert recovered.entries == entries(1, 2)
    assert recovered.truncated_bytes == 20
    store.append([entry(3)], None)
    store.close()
    _, recovered = open_store(fs, directory)
    assert recovered.entries == entries(1, 3)


# -- the Raft node on it -----------------------------------------------------------------------


class RecordingState:
    def __init__(self) -> None:
        self.applied: list[str] = []

    def apply(self, command):
        self.applied.append(command.name)
        return len(self.applied)

    def snapshot(self) -> bytes:
        return b""

    def restore(self, data: bytes) -> None:
        pass


@pytest.mark.parametrize("fault", ["sync", "write"])
def test_a_raft_node_whose_log_cannot_sync_stops(fault):
    """A failed sync or a failed write of the log halts the node (fail-stop): nothing later is
    applied or acknowledged, and the daemon is told (fatal)."""
    async def scenario():
        fs = SimFileSystem()
        node = RaftNode(1, RecordingState(), LogStore("/data/node-1", fs=fs, fsync="batch"),
                        election_ticks=2, heartbeat_ticks=1, tick_ms=5, read_mode="safe",
                        snapshot_entries=10_000, max_pending_proposals=100,
                        proposal_timeout_ms=1000, initial_voters=(1,), send=lambda to, data: True)
        fatal: list[BaseException] = []
        node.fatal = fatal.append
        node.start()
        try:
            for _ in range(400):
                if node.role == Role.LEADER:
                    break
                await asyncio.sleep(0.005)
            assert node.role == Role.LEADER
            assert await node.propose(commands.NodeUp(1, "a", "h:1", "h:2")) == 1
            if fault == "sync":
                fs.fail_syncs()
            else:
                fs.fail_writes()
            waiter = node.propose(commands.NodeUp(1, "b", "h:1", "h:2"))
            with pytest.raises(Exception):
                await asyncio.wait_for(waiter, 30)
            assert len(fatal) == 1 and isinstance(fatal[0], OSError)
            assert node.halted is fatal[0]
            assert node.state.applied == ["a"]
        finally:
            node.stop()
    asyncio.run(scenario())
