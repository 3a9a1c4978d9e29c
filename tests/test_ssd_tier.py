"""The disk tier engine (mooncaked/ssd) on real files through real io_uring: writes read back,
aligned and unaligned destinations, recovery after close, drops and superseded records across
restarts, corrupt and torn records, reclaim and pins, DiskFull, the layout check, and the
ring's queue depth and shared datasyncs. Faults of the file system itself (EIO, O_DIRECT
refused, no room) are in test_ssd_faults.py; a kill -9 mid-write in test_ssd_crash.py."""

from __future__ import annotations

import asyncio
import mmap
import os

import pytest

from mooncaked import config as config_module
from mooncaked.ssd import DirectoryInUse, DiskCorrupt, DiskFull, DiskTier, LayoutMismatch
from mooncaked.ssd.records import RECORD_HEADER_BYTES
from ssd_support import MIB, file_system_type, require_io_uring, run, ssd_config, value_of

BLOCK = 4096


@pytest.fixture(autouse=True)
def _io_uring():
    require_io_uring()


def data_path(directory, region: int, offset: int, config) -> tuple[str, int]:
    """(data file, byte offset in it) of a region-relative offset."""
    per_file = config.file_bytes // config.region_bytes
    file_index, within = divmod(region, per_file)
    return (os.path.join(str(directory), f"ssd-{file_index:04d}.data"),
            within * config.region_bytes + offset)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- writes and reads -----------------------------------------------------------------------

@pytest.mark.parametrize("loop_kind", ["asyncio", "uring"])
def test_many_records_read_back_exactly(tmp_path, loop_kind):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=16 * MIB)
    sizes = [0, 1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 70_000, 300_000, 1000]

    async def main():
        tier = await DiskTier.open(config)
        assert tier.recovered == []
        written = await asyncio.gather(*(
            tier.write("ns", f"key-{i}", i + 1, [memoryview(value_of(f"key-{i}", size))])
            for i, size in enumerate(sizes * 4)))
        assert len(set(written)) == len(written)
        for i, locator in enumerate(written):
            size = (sizes * 4)[i]
            assert locator.size_bytes == size and locator.version == i + 1
            assert await tier.read(locator) == value_of(f"key-{i}", size)
        status = tier.status()
        assert status["writes"] == len(written) and status["reads"] == len(written)
        assert status["live_records"] == len(written)
        assert status["live_bytes"] == sum(sizes) * 4
        assert status["write_bytes"] == sum(sizes) * 4
        assert status["write_latency_us"]["count"] == len(written)
        assert status["in_flight"] == 0
        await tier.close()

    run(main(), loop_kind)


def test_value_in_several_parts_and_formats(tmp_path):
    config = ssd_config(tmp_path / "ssd")
    value = value_of("parts", 50_000)

    async def main():
        tier = await DiskTier.open(config)
        parts = [memoryview(value)[:7], memoryview(bytearray(value[7:20_000])),
                 memoryview(value[20_000:]).cast("I") if (50_000 - 20_000) % 4 == 0 else None]
        locator = await tier.write("ns", "k", 1, [p for p in parts if p is not None])
        assert await tier.read(locator) == value
        await tier.close()

    run(main())


def test_unaligned_destination_goes_through_bounce_memory(tmp_path):
    config = ssd_config(tmp_path / "ssd")
    value = value_of("u", 3 * BLOCK + 123)

    async def main():
        tier = await DiskTier.open(config)
        locator = await tier.write("ns", "u", 1, [memoryview(value)])
        backing = bytearray(len(value) + 1)
        destination = memoryview(backing)[1:]  # odd address
        await tier.read_into(locator, destination)
        assert bytes(destination) == value
        with pytest.raises(ValueError):
            await tier.read_into(locator, memoryview(backing))  # wrong length
        with pytest.raises(ValueError):
            await tier.read_into(locator, memoryview(bytes(len(value))))  # read-only
        await tier.close()

    run(main())


def test_aligned_destination_is_read_into_directly(tmp_path):
    """With every bounce slot held by someone else, a page-aligned, whole-block destination
    is still read: its bytes never pass through bounce memory."""
    config = ssd_config(tmp_path / "ssd", bounce_bytes=2 * MIB)
    value = value_of("a", 5 * BLOCK)
    assert file_system_type(tmp_path) not in ("", "tmpfs")

    async def main():
        tier = await DiskTier.open(config)
        locator = await tier.write("ns", "a", 1, [memoryview(value)])
        held = [await tier._bounce.acquire() for _ in range(tier._bounce.slots)]
        destination = mmap.mmap(-1, len(value))  # page-aligned, like a segment range
        with memoryview(destination) as view:
            await asyncio.wait_for(tier.read_into(locator, view), 30)
            assert bytes(view) == value
            # An unaligned destination needs a slot: it waits until one is released.
            backing = bytearray(len(value) + 1)
            read = asyncio.ensure_future(tier.read_into(locator, memoryview(backing)[1:]))
            await asyncio.sleep(0.05)
            assert not read.done()
            for slot in held:
                tier._bounce.release(slot)
            await read
            assert bytes(backing[1:]) == value
        destination.close()
        await tier.close()

    run(main())


def test_real_disk_uses_direct_io(tmp_path):
    kind = file_system_type(tmp_path)
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {kind or 'an unknown file system'}, not a disk")
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        status = tier.status()
        assert status["direct_io"] is True and status["direct_io_reason"] == ""
        await tier.close()

    run(main())


def test_dev_shm_works_whatever_o_direct_answers(tmp_path):
    """tmpfs: O_DIRECT is refused by kernels before 6.6 (the tier then says why and goes
    on without it), accepted since. Either way the tier works."""
    directory = f"/dev/shm/mooncaked-ssd-test-{os.getpid()}"
    config = ssd_config(directory, capacity_bytes=4 * MIB, file_bytes=2 * MIB)

    async def main():
        tier = await DiskTier.open(config)
        status = tier.status()
        assert status["direct_io"] == (status["direct_io_reason"] == "")
        if not status["direct_io"]:
            assert "O_DIRECT" in status["direct_io_reason"]
        locator = await tier.write("ns", "k", 1, [memoryview(value_of("k", 10_000))])
        assert await tier.read(locator) == value_of("k", 10_000)
        await tier.close()
        tier = await DiskTier.open(config)
        assert [r.locator for r in tier.recovered] == [locator]
        await tier.close()

    try:
        run(main())
    finally:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)


def test_fits_refuses_long_keys_and_values_larger_than_a_region(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        longest = "k" * (BLOCK - RECORD_HEADER_BYTES - 2)
        assert tier.fits("ns", longest, 10)
        assert not tier.fits("ns", longest + "k", 10)
        assert not tier.fits("ns", "é" * 3000, 10)  # UTF-8 bytes count
        assert tier.fits("ns", "k", MIB - 2 * BLOCK)
        assert not tier.fits("ns", "k", MIB - 2 * BLOCK + 1)
        with pytest.raises(ValueError):
            await tier.write("ns", longest + "k", 1, [memoryview(b"x")])
        assert tier.status()["key_too_long"] == 1
        locator = await tier.write("ns", longest, 1, [memoryview(b"x")])
        await tier.close()
        tier = await DiskTier.open(config)
        assert [(r.key, r.locator) for r in tier.recovered] == [(longest, locator)]
        await tier.close()

    run(main())


# -- restarts -------------------------------------------------------------------------------

@pytest.mark.parametrize("loop_kind", ["asyncio", "uring"])
def test_recovery_after_close_finds_every_record(tmp_path, loop_kind):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=16 * MIB)

    async def write():
        tier = await DiskTier.open(config)
        written = {}
        for i in range(60):
            key = f"key-{i}"
            written[key] = await tier.write(f"ns{i % 3}", key, 1000 + i,
                                            [memoryview(value_of(key, 1000 * i))])
        await tier.close()
        return written

    async def reopen(written):
        tier = await DiskTier.open(config)
        assert {r.key: r.locator for r in tier.recovered} == written
        for record in tier.recovered:
            i = int(record.key.split("-")[1])
            assert record.namespace == f"ns{i % 3}" and record.version == 1000 + i
            assert record.size_bytes == 1000 * i
            assert await tier.read(record.locator) == value_of(record.key, 1000 * i)
        # New writes after a restart go to new regions and survive the next one too.
        extra = await tier.write("ns", "after", 1, [memoryview(value_of("after", 5000))])
        await tier.close()
        return extra

    written = run(write(), loop_kind)
    extra = run(reopen(written), loop_kind)
    written["after"] = extra

    async def third():
        tier = await DiskTier.open(config)
        assert {r.key: r.locator for r in tier.recovered} == written
        assert await tier.read(extra) == value_of("after", 5000)
        await tier.close()

    run(third(), loop_kind)


def test_drop_survives_a_restart(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        keep = await tier.write("ns", "keep", 1, [memoryview(value_of("keep", 9000))])
        gone = await tier.write("ns", "gone", 1, [memoryview(value_of("gone", 9000))])
        await tier.drop(gone)
        with pytest.raises(KeyError):
            await tier.read(gone)
        await tier.drop(gone)  # a second drop does nothing
        assert tier.status()["live_records"] == 1
        await tier.close()
        tier = await DiskTier.open(config)
        assert [r.key for r in tier.recovered] == ["keep"]
        assert await tier.read(keep) == value_of("keep", 9000)
        with pytest.raises(KeyError):
            await tier.read(gone)
        await tier.close()

    run(main())


def test_newest_record_of_a_key_wins_and_the_older_never_returns(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        old = await tier.write("ns", "k", 1, [memoryview(value_of("old", 5000))])
        new = await tier.write("ns", "k", 2, [memoryview(value_of("new", 6000))])
        await tier.close()  # no drop of the old one: both are LIVE on disk
        tier = await DiskTier.open(config)
        assert [r.locator for r in tier.recovered] == [new]
        assert tier.status()["superseded_records"] == 1
        with pytest.raises(KeyError):
            await tier.read(old)
        await tier.drop(new)
        await tier.close()
        tier = await DiskTier.open(config)  # the old one was marked DEAD: nothing returns
        assert tier.recovered == []
        await tier.close()

    run(main())


def test_corrupt_value_is_never_served_and_stays_dropped(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def write():
        tier = await DiskTier.open(config)
        good = await tier.write("ns", "good", 1, [memoryview(value_of("good", 20_000))])
        bad = await tier.write("ns", "bad", 1, [memoryview(value_of("bad", 20_000))])
        await tier.close()
        return good, bad

    good, bad = run(write())
    path, offset = data_path(tmp_path / "ssd", bad.region, bad.offset + BLOCK + 12_345, config)
    flip_byte(path, offset)

    async def read_back():
        tier = await DiskTier.open(config)
        assert {r.key for r in tier.recovered} == {"good", "bad"}  # values are not read
        destination = bytearray(20_000)
        with pytest.raises(DiskCorrupt):
            await tier.read_into(bad, memoryview(destination))
        assert tier.status()["corrupt_records"] == 1
        with pytest.raises(KeyError):
            await tier.read(bad)  # a miss from now on
        assert await tier.read(good) == value_of("good", 20_000)
        await tier.close()
        tier = await DiskTier.open(config)
        assert [r.key for r in tier.recovered] == ["good"]
        await tier.close()

    run(read_back())


def test_torn_record_header_ends_the_walk_and_is_counted(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def write():
        tier = await DiskTier.open(config)
        locators = [await tier.write("ns", f"k{i}", 1, [memoryview(value_of(f"k{i}", 3000))])
                    for i in range(5)]
        await tier.close()
        return locators

    locators = run(write())
    torn = locators[3]
    path, offset = data_path(tmp_path / "ssd", torn.region, torn.offset, config)
    flip_byte(path, offset + 40)  # inside the header, after the magic

    async def reopen():
        tier = await DiskTier.open(config)
        assert [r.locator for r in tier.recovered] == locators[:3]
        assert tier.status()["torn_records"] == 1
        await tier.close()

    run(reopen())


def test_layout_mismatch_is_refused_unless_reformat_is_asked(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def write():
        tier = await DiskTier.open(config)
        await tier.write("ns", "k", 1, [memoryview(b"abc")])
        await tier.close()

    run(write())
    for change in (dict(region_bytes=2 * MIB), dict(capacity_bytes=12 * MIB),
                   dict(file_bytes=8 * MIB)):
        with pytest.raises(LayoutMismatch) as raised:
            run(DiskTier.open(ssd_config(tmp_path / "ssd", **change)))
        message = str(raised.value)
        assert str(tmp_path / "ssd") in message and "reformat_on_mismatch" in message
        assert next(iter(change)) in message or "files=" in message
    # Refused starts changed nothing: the original configuration still finds the record.

    async def same():
        tier = await DiskTier.open(config)
        assert [r.key for r in tier.recovered] == ["k"]
        await tier.close()

    run(same())

    async def reformat():
        tier = await DiskTier.open(ssd_config(tmp_path / "ssd", region_bytes=2 * MIB,
                                              reformat_on_mismatch=True))
        assert tier.recovered == [] and tier.status()["regions"] == 4
        await tier.close()

    run(reformat())


def test_foreign_meta_file_is_refused(tmp_path):
    directory = tmp_path / "ssd"
    directory.mkdir()
    (directory / "ssd.meta").write_text("not json")
    with pytest.raises(LayoutMismatch, match="ssd.meta"):
        run(DiskTier.open(ssd_config(directory)))


# -- reclaim, pins, DiskFull ------------------------------------------------------------------

def test_reclaim_hands_records_over_oldest_region_first(tmp_path):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=4 * MIB, file_bytes=4 * MIB)
    handed = []

    async def main():
        tier = await DiskTier.open(config, on_reclaim=handed.append)
        written = []
        for i in range(40):  # 40 records of 200 KB + a block: ~2 MiB per 10 records
            written.append(await tier.write("ns", f"k{i}", i,
                                            [memoryview(value_of(f"k{i}", 200_000))]))
        await tier.close()  # waits for a reclaim in progress
        return written, tier.status()

    written, status = run(main())
    assert status["reclaimed_regions"] >= 1 and handed
    reclaimed = [record for batch in handed for record in batch]
    assert status["reclaimed_records"] == len(reclaimed)
    # The oldest records went first, whole regions at a time.
    assert [r.locator for r in reclaimed] == written[:len(reclaimed)]
    assert [r.key for r in reclaimed] == [f"k{i}" for i in range(len(reclaimed))]

    async def reopen():
        tier = await DiskTier.open(config)
        keys = {r.key for r in tier.recovered}
        assert keys == {f"k{i}" for i in range(len(reclaimed), 40)}
        for record in tier.recovered:
            assert await tier.read(record.locator) == value_of(record.key, 200_000)
        await tier.close()

    run(reopen())


def test_async_on_reclaim_is_awaited(tmp_path):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=4 * MIB, file_bytes=4 * MIB)
    handed = []

    async def on_reclaim(records):
        await asyncio.sleep(0)
        handed.extend(records)

    async def main():
        tier = await DiskTier.open(config, on_reclaim=on_reclaim)
        for i in range(40):
            await tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", 200_000))])
        await tier.close()
        return tier.status()

    status = run(main())
    assert len(handed) == status["reclaimed_records"] > 0


def test_pins_hold_a_region_and_disk_full_until_unpinned(tmp_path):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=4 * MIB, file_bytes=4 * MIB)
    handed = []

    async def main():
        tier = await DiskTier.open(config, on_reclaim=handed.extend)
        pinned = []
        with pytest.raises(DiskFull):
            for i in range(100):
                locator = await tier.write("ns", f"k{i}", i,
                                           [memoryview(value_of(f"k{i}", 200_000))])
                tier.pin(locator)
                tier.pin(locator)  # pins count: two unpins are needed
                pinned.append(locator)
        assert handed == []  # nothing pinned was reclaimed
        assert tier.status()["free_regions"] == 0
        for locator in pinned:  # every pinned record still reads back
            assert await tier.read(locator) == value_of(f"k{pinned.index(locator)}", 200_000)
        # Unpinning the oldest once is not enough; twice frees its region for reclaim.
        tier.unpin(pinned[0])
        with pytest.raises(DiskFull):
            await tier.write("ns", "more", 1, [memoryview(value_of("more", 200_000))])
        oldest = [locator for locator in pinned if locator.region == pinned[0].region]
        assert 1 < len(oldest) < len(pinned)
        for locator in oldest:
            tier.unpin(locator)
            tier.unpin(locator)  # pinned[0]'s second unpin finds no pin: nothing happens
        locator = await tier.write("ns", "more", 1, [memoryview(value_of("more", 200_000))])
        assert await tier.read(locator) == value_of("more", 200_000)
        assert [r.locator for r in handed] == oldest
        with pytest.raises(KeyError):
            await tier.read(pinned[0])
        after = pinned[len(oldest)]
        assert await tier.read(after) == value_of(f"k{len(oldest)}", 200_000)
        with pytest.raises(KeyError):
            tier.pin(pinned[0])
        await tier.close()

    run(main())


def test_reads_in_flight_hold_their_region(tmp_path):
    """A region is not reclaimed under a read: the read returns the right bytes."""
    config = ssd_config(tmp_path / "ssd", capacity_bytes=4 * MIB, file_bytes=4 * MIB,
                        queue_depth=1)

    async def main():
        tier = await DiskTier.open(config)
        first = await tier.write("ns", "first", 1, [memoryview(value_of("first", 200_000))])
        reads = [asyncio.ensure_future(tier.read(first)) for _ in range(8)]
        writes = [asyncio.ensure_future(tier.write(
            "ns", f"k{i}", i, [memoryview(value_of(f"k{i}", 200_000))])) for i in range(30)]
        for read in reads:
            try:
                assert await read == value_of("first", 200_000)
            except KeyError:
                pass  # started after its region was reclaimed: a miss, never wrong bytes
        await asyncio.gather(*writes)
        await tier.close()

    run(main())


# -- the ring ---------------------------------------------------------------------------------

class _CountingRing:
    """Wraps the tier's DiskRing to count submits and fsyncs."""

    def __init__(self, ring):
        self._ring = ring
        self.submits = 0
        self.fsyncs = 0
        self.writes = 0

    def submit(self):
        self.submits += 1
        return self._ring.submit()

    def prep_fsync(self, *args):
        self.fsyncs += 1
        return self._ring.prep_fsync(*args)

    def prep_write(self, *args):
        self.writes += 1
        return self._ring.prep_write(*args)

    def __getattr__(self, name):
        return getattr(self._ring, name)


def test_queue_depth_bounds_requests_in_flight_and_datasyncs_are_shared(tmp_path):
    config = ssd_config(tmp_path / "ssd", capacity_bytes=16 * MIB, queue_depth=4)

    async def main():
        tier = await DiskTier.open(config)
        counting = _CountingRing(tier._io._ring)
        tier._io._ring = counting
        seen = []
        running = True

        def sample():
            seen.append(tier._io.in_flight)
            if running:
                asyncio.get_running_loop().call_soon(sample)

        sample()
        locators = await asyncio.gather(*(
            tier.write("ns", f"k{i}", i, [memoryview(value_of(f"k{i}", 10_000))])
            for i in range(64)))
        running = False
        assert max(seen) <= 4
        assert max(seen) >= 2  # requests of one iteration went in together
        assert counting.writes >= 64
        assert counting.fsyncs < 64  # one fdatasync covers a batch of writes
        assert counting.submits < counting.writes + counting.fsyncs
        for i, locator in enumerate(locators):
            assert await tier.read(locator) == value_of(f"k{i}", 10_000)
        await tier.close()

    run(main())


def test_cancelled_write_leaves_no_record_behind(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        write = asyncio.ensure_future(tier.write("ns", "cancelled", 1,
                                                 [memoryview(value_of("c", 100_000))]))
        await asyncio.sleep(0)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        kept = await tier.write("ns", "kept", 1, [memoryview(value_of("kept", 1000))])
        await tier.close()
        tier = await DiskTier.open(config)
        assert [r.locator for r in tier.recovered] == [kept]
        await tier.close()

    run(main())


def test_closed_tier_refuses_calls(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        await tier.close()
        await tier.close()
        with pytest.raises(RuntimeError):
            await tier.write("ns", "k", 1, [memoryview(b"x")])

    run(main())


def test_config_checks_of_the_ssd_section(tmp_path):
    def load(text):
        path = tmp_path / "c.toml"
        path.write_text(text)
        return config_module.load(path)

    with pytest.raises(config_module.ConfigError, match="block_bytes .* power of two"):
        load("[ssd]\nblock_bytes = 12288\n")
    with pytest.raises(config_module.ConfigError, match="region_bytes .* multiple"):
        load("[ssd]\nregion_bytes = 10000\n")
    with pytest.raises(config_module.ConfigError, match="file_bytes .* multiple"):
        load("[ssd]\nfile_bytes = 100663296\n")
    with pytest.raises(config_module.ConfigError, match="capacity_bytes .* regions"):
        load("[ssd]\nenabled = true\ncapacity_bytes = 134217728\n")
    loaded = load("[ssd]\nenabled = true\ncapacity_bytes = 1073741824\n")
    assert loaded.ssd.capacity_bytes == 1 << 30 and loaded.ssd.region_bytes == 64 * MIB


def test_writes_of_a_region_are_acknowledged_in_offset_order():
    """Recovery walks a region from its start, so a write is reported only once every
    earlier write of its region is; a failed one that leaves no valid header fails the
    writes after it."""
    from mooncaked.ssd.regions import PendingWrite, Region

    async def main():
        loop = asyncio.get_running_loop()
        region = Region(0, 0, 0)
        entries = [PendingWrite(f"r{i}", loop.create_future()) for i in range(5)]
        region.pending.extend(entries)
        written = []

        def settle():
            region.settle(lambda: OSError("behind a broken walk"), written.append)

        entries[1].resolved = True          # the second finishes first: not reported yet
        settle()
        assert written == [] and not entries[1].final.done()
        entries[0].resolved = True
        settle()
        assert written == ["r0", "r1"]
        assert entries[0].final.result() is None and entries[1].final.result() is None
        entries[2].error = OSError("EIO")   # failed, and its DEAD mark failed too
        entries[2].walkable = False
        entries[2].resolved = True
        entries[3].resolved = True
        settle()
        assert isinstance(entries[2].final.result(), OSError)
        assert str(entries[3].final.result()) == "behind a broken walk"
        assert written == ["r0", "r1"] and region.broken

    run(main())


def test_status_names_every_figure(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        locator = await tier.write("ns", "k", 1, [memoryview(value_of("k", 5000))])
        await tier.read(locator)
        status = tier.status()
        await tier.close()
        return status

    status = run(main())
    for name in ("capacity_bytes", "used_bytes", "live_bytes", "live_records", "free_regions",
                 "regions", "direct_io", "direct_io_reason", "queue_depth", "in_flight",
                 "writes", "write_bytes", "reads", "read_bytes", "write_errors",
                 "read_errors", "corrupt_records", "torn_records", "superseded_records",
                 "reclaimed_regions", "reclaimed_records", "write_latency_us",
                 "read_latency_us"):
        assert name in status, name
    assert status["capacity_bytes"] == 8 * MIB and status["regions"] == 8
    assert status["used_bytes"] == 2 * BLOCK + 2 * BLOCK  # region header + one record
    assert status["free_regions"] == 7 and status["live_bytes"] == 5000
    histogram = status["read_latency_us"]
    assert histogram["count"] == 1 and sum(histogram["counts"]) == 1
    assert len(histogram["counts"]) == len(histogram["bounds_us"]) + 1


def test_a_directory_serves_one_open_tier_at_a_time(tmp_path):
    config = ssd_config(tmp_path / "ssd")

    async def main():
        tier = await DiskTier.open(config)
        with pytest.raises(DirectoryInUse, match="in use"):
            await DiskTier.open(config)
        await tier.close()
        again = await DiskTier.open(config)  # closing released it
        await again.close()

    run(main())


def test_a_region_erased_and_reused_never_revives_its_old_records(tmp_path):
    """A reclaimed region's header is erased but its old records stay in its body. When it
    is opened again it must get a sequence it never had, or a walk that runs past the new
    records would take the old ones as its own."""
    config = ssd_config(tmp_path / "ssd")

    async def write_old():
        tier = await DiskTier.open(config)
        old = [await tier.write("ns", f"old{i}", i, [memoryview(value_of(f"old{i}", 3000))])
               for i in range(4)]
        await tier.close()
        return old

    old = run(write_old())
    assert {locator.region for locator in old} == {0}
    # Erase region 0's header the way a reclaim whose erase was cut short leaves it.
    path, offset = data_path(tmp_path / "ssd", 0, 0, config)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(BLOCK))

    async def write_new():
        tier = await DiskTier.open(config)
        assert tier.recovered == []
        new = await tier.write("ns", "new", 1, [memoryview(value_of("new", 3000))])
        assert new.region == 0 and new.offset == old[0].offset  # region 0 reused
        await tier.close()
        tier = await DiskTier.open(config)
        assert [r.key for r in tier.recovered] == ["new"]
        await tier.close()

    run(write_new())


def test_aligned_source_is_written_from_its_own_memory(tmp_path):
    """A value in one page-aligned part (a segment range) goes to disk straight from it:
    the header block and the tail are staged, the whole blocks between are not."""
    config = ssd_config(tmp_path / "ssd", capacity_bytes=16 * MIB, file_bytes=8 * MIB,
                        region_bytes=4 * MIB)
    if file_system_type(tmp_path) in ("", "tmpfs"):
        pytest.skip("needs O_DIRECT")

    async def main():
        tier = await DiskTier.open(config)
        written = {"first": await tier.write("ns", "first", 1, [memoryview(b"opens a region")])}
        counting = _CountingRing(tier._io._ring)
        tier._io._ring = counting
        # (name, size, page-aligned, write requests: header + direct parts + tail)
        for name, size, aligned, expected_writes in (
                ("tail", 5 * BLOCK + 100, True, 3),
                ("whole", 300 * BLOCK, True, 3),       # 300 blocks: two direct requests
                ("exact", 4 * BLOCK, True, 2),
                ("unaligned", 5 * BLOCK + 100, False, 1)):
            source = mmap.mmap(-1, size + 1)
            start = 0 if aligned else 1
            source[start:start + size] = value_of(name, size)
            before = counting.writes
            with memoryview(source) as view:
                written[name] = await tier.write("ns", name, 1, [view[start:start + size]])
            assert counting.writes - before == expected_writes, name
            assert await tier.read(written[name]) == value_of(name, size)
        await tier.close()
        tier = await DiskTier.open(config)
        assert {r.key: r.locator for r in tier.recovered} == written
        for record in tier.recovered[1:]:
            assert await tier.read(record.locator) == value_of(record.key, record.size_bytes)
        await tier.close()

    run(main())
