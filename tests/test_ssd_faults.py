"""The disk tier against a failing or unusual file system: EIO on writes and reads (a FUSE
file system of tests/eio_fuse.py that passes through to a directory and fails chosen
requests), O_DIRECT refused (ramfs), and no room for the files (a small tmpfs).

Mounting needs root; the FUSE tests also need /dev/fuse, libfuse2 and fusepy. Each test says
why it skips where one of these is missing."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

import pytest

from mooncaked.ssd import DiskFull, DiskIOError, DiskTier
from mooncaked.ssd.records import record_bytes
from ssd_support import MIB, file_system_type, require_io_uring, run, ssd_config, value_of

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 4096


@pytest.fixture(autouse=True)
def _io_uring():
    require_io_uring()


def _mount(kind: str, target, options: str = "") -> None:
    command = ["mount", "-t", kind] + (["-o", options] if options else []) + [kind, str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount {kind} here ({result.stderr.strip() or 'not root?'})")


def _umount(target) -> None:
    subprocess.run(["umount", str(target)], capture_output=True)


def _mounted(path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class EioFuse:
    """tests/eio_fuse.py mounted at `mountpoint` over `backing`; set_faults() chooses what
    fails from now on."""

    def __init__(self, root):
        self.backing = root / "backing"
        self.mountpoint = root / "mnt"
        self.faults_path = root / "faults.json"
        self.backing.mkdir()
        self.mountpoint.mkdir()
        self.set_faults()
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "eio_fuse.py"), str(self.backing),
             str(self.mountpoint), str(self.faults_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 20
        while not _mounted(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                output = self.close()
                pytest.skip(f"the FUSE test file system did not mount: {output.strip()}")
            time.sleep(0.05)

    def set_faults(self, read=(), write=()) -> None:
        temporary = str(self.faults_path) + ".tmp"
        with open(temporary, "w") as f:
            json.dump({"read": list(read), "write": list(write)}, f)
        os.replace(temporary, self.faults_path)

    def close(self) -> str:
        # Lazily: a failed test may leave files open on the mount; the file system process
        # then ends once they are closed, or is killed below (and the mount goes with -l).
        subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
        try:
            output, _ = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        return output or ""


@pytest.fixture
def eio_fuse(tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    try:
        importlib.import_module("fuse")  # fusepy; loads libfuse.so.2
    except (ImportError, OSError, EnvironmentError) as exc:
        pytest.skip(f"fusepy or libfuse2 missing: {exc}")
    fs = EioFuse(tmp_path)
    yield fs
    fs.close()


def _file_range(config, locator, start: int, length: int) -> list:
    """A fault entry: bytes [start, start + length) of a record, in its data file."""
    per_file = config.file_bytes // config.region_bytes
    file_index, within = divmod(locator.region, per_file)
    at = within * config.region_bytes + locator.offset + start
    return [f"ssd/ssd-{file_index:04d}.data", at, at + length]


def test_eio_on_write_of_a_header_fails_it_and_the_writes_after_it_in_its_region(eio_fuse):
    directory = eio_fuse.mountpoint / "ssd"
    config = ssd_config(directory)
    size = 10_000

    async def main():
        tier = await DiskTier.open(config)
        first = [await tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", size))])
                 for i in range(2)]
        last = first[-1]
        following = type(last)(last.region, last.offset + record_bytes(size, BLOCK), size, 2)
        # The next record's header block fails to write, and so does its DEAD mark: the
        # walk of this region cannot pass it, so the records after it fail too.
        eio_fuse.set_faults(write=[_file_range(config, following, 0, BLOCK)])
        import asyncio
        results = await asyncio.gather(*(
            tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", size))])
            for i in range(2, 5)), return_exceptions=True)
        assert all(isinstance(r, DiskIOError) for r in results), results
        status = tier.status()
        assert status["write_errors"] >= 1 and status["live_records"] == 2
        eio_fuse.set_faults()
        # The tier keeps working, in another region.
        later = await tier.write("ns", "later", 9, [memoryview(value_of("later", size))])
        assert later.region != last.region
        for i, locator in enumerate(first):
            assert await tier.read(locator) == value_of(f"k{i}", size)
        assert await tier.read(later) == value_of("later", size)
        await tier.close()
        tier = await DiskTier.open(config)
        assert {r.key for r in tier.recovered} == {"k0", "k1", "later"}
        await tier.close()

    run(main())


def test_eio_on_write_of_a_value_fails_that_record_only(eio_fuse):
    directory = eio_fuse.mountpoint / "ssd"
    config = ssd_config(directory)
    size = 10_000

    async def main():
        import asyncio
        tier = await DiskTier.open(config)
        first = await tier.write("ns", "k0", 0, [memoryview(value_of("k0", size))])
        following = type(first)(first.region, first.offset + record_bytes(size, BLOCK),
                                size, 1)
        # Its value's second block fails; its header can still be marked DEAD, so the
        # records written after it in the region are kept.
        eio_fuse.set_faults(write=[_file_range(config, following, 2 * BLOCK, BLOCK)])
        results = await asyncio.gather(*(
            tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", size))])
            for i in range(1, 4)), return_exceptions=True)
        assert isinstance(results[0], DiskIOError)
        assert not any(isinstance(r, BaseException) for r in results[1:]), results
        eio_fuse.set_faults()
        for i, locator in enumerate(results[1:], start=2):
            assert await tier.read(locator) == value_of(f"k{i}", size)
        await tier.close()
        tier = await DiskTier.open(config)
        assert {r.key for r in tier.recovered} == {"k0", "k2", "k3"}
        await tier.close()

    run(main())


def test_enospc_on_write_is_disk_full_and_writes_resume_once_space_returns(eio_fuse):
    directory = eio_fuse.mountpoint / "ssd"
    config = ssd_config(directory)
    size = 10_000

    async def main():
        tier = await DiskTier.open(config)
        first = await tier.write("ns", "k0", 0, [memoryview(value_of("k0", size))])
        following = type(first)(first.region, first.offset + record_bytes(size, BLOCK),
                                size, 1)
        eio_fuse.set_faults(write=[_file_range(config, following, BLOCK, BLOCK) + ["ENOSPC"]])
        with pytest.raises(DiskFull):
            await tier.write("ns", "k1", 1, [memoryview(value_of("k1", size))])
        assert tier.status()["live_records"] == 1
        eio_fuse.set_faults()
        second = await tier.write("ns", "k2", 2, [memoryview(value_of("k2", size))])
        assert await tier.read(second) == value_of("k2", size)
        assert await tier.read(first) == value_of("k0", size)
        await tier.close()
        tier = await DiskTier.open(config)
        assert {r.key for r in tier.recovered} == {"k0", "k2"}
        await tier.close()

    run(main())


def test_eio_on_read_drops_that_record_and_leaves_the_others(eio_fuse):
    directory = eio_fuse.mountpoint / "ssd"
    config = ssd_config(directory)
    size = 30_000

    async def main():
        tier = await DiskTier.open(config)
        locators = [await tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", size))])
                    for i in range(5)]
        eio_fuse.set_faults(read=[_file_range(config, locators[2], BLOCK, size)])
        with pytest.raises(DiskIOError):
            await tier.read(locators[2])
        status = tier.status()
        assert status["read_errors"] == 1 and status["live_records"] == 4
        with pytest.raises(KeyError):
            await tier.read(locators[2])  # a miss from now on
        for i in (0, 1, 3, 4):
            assert await tier.read(locators[i]) == value_of(f"k{i}", size)
        eio_fuse.set_faults()
        await tier.close()
        tier = await DiskTier.open(config)  # it was marked DEAD: it does not come back
        assert {r.key for r in tier.recovered} == {"k0", "k1", "k3", "k4"}
        await tier.close()

    run(main())


def test_ramfs_refuses_o_direct_and_the_tier_says_so(tmp_path):
    target = tmp_path / "ramfs"
    target.mkdir()
    _mount("ramfs", target)
    try:
        config = ssd_config(target / "ssd", capacity_bytes=4 * MIB, file_bytes=2 * MIB)

        async def main():
            tier = await DiskTier.open(config)
            status = tier.status()
            assert status["direct_io"] is False
            assert "O_DIRECT" in status["direct_io_reason"]
            locator = await tier.write("ns", "k", 1, [memoryview(value_of("k", 12_345))])
            backing = bytearray(12_346)
            await tier.read_into(locator, memoryview(backing)[1:])
            assert bytes(backing[1:]) == value_of("k", 12_345)
            await tier.close()
            tier = await DiskTier.open(config)
            assert [r.locator for r in tier.recovered] == [locator]
            await tier.close()

        run(main())
    finally:
        _umount(target)


def test_no_room_for_the_files_is_disk_full_and_a_smaller_tier_then_starts(tmp_path):
    target = tmp_path / "small"
    target.mkdir()
    _mount("tmpfs", target, "size=3m")
    try:
        assert file_system_type(target) == "tmpfs"
        with pytest.raises(DiskFull, match="no room"):
            run(DiskTier.open(ssd_config(target / "ssd", capacity_bytes=8 * MIB,
                                         file_bytes=4 * MIB)))

        async def smaller():
            tier = await DiskTier.open(ssd_config(target / "ssd", capacity_bytes=2 * MIB,
                                                  file_bytes=2 * MIB, region_bytes=512 * 1024,
                                                  reformat_on_mismatch=True))
            locator = await tier.write("ns", "k", 1, [memoryview(value_of("k", 1000))])
            assert await tier.read(locator) == value_of("k", 1000)
            await tier.close()

        run(smaller())
    finally:
        _umount(target)
