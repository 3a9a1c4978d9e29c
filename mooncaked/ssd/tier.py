"""DiskTier: one node's disk tier, a log-structured record store on local SSD.

    tier = await DiskTier.open(config.ssd, on_reclaim=callback)
    tier.recovered                                # DiskRecord list found at start
    if tier.fits(namespace, key, size):
        locator = await tier.write(namespace, key, version, [memoryview(...)])  # durable
    await tier.read_into(locator, destination)    # raises DiskCorrupt / DiskIOError
    await tier.drop(locator)                      # DEAD on disk, durable
    tier.pin(locator); tier.unpin(locator)        # holds its region against reclaim
    await tier.close()

Records are appended to one region at a time (regions.py), written through the tier's own
io_uring with O_DIRECT where the file system allows it (disk_io.py), staged through aligned
bounce memory (bounce.py), and found again at start by a scan (recovery.py). The layout on
disk is described in layout.py and records.py, and in the README ("SSD tier").

Every method runs on the loop the tier was opened on.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import inspect
import logging
import mmap
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from mooncaked._native import buffer_address, crc32c
from mooncaked.config import SsdConfig
from mooncaked.ssd import recovery
from mooncaked.ssd.bounce import BouncePool, slot_size
from mooncaked.ssd.disk_io import DiskIO
from mooncaked.ssd.layout import (DirectoryInUse, Layout, LayoutFull, LayoutMismatch,
                                  open_directory)
from mooncaked.ssd.records import (FLAG_DEAD, FLAG_LIVE, RecordHeader, RegionHeader,
                                   encode_record_header, encode_region_header, key_fits,
                                   pad_to_block, record_bytes)
from mooncaked.ssd.regions import PendingWrite, RecordInfo, Region, RegionState

log = logging.getLogger("mooncaked.ssd")

__all__ = ["DiskTier", "Locator", "DiskRecord", "DiskFull", "DiskIOError", "DiskCorrupt",
           "LayoutMismatch", "DirectoryInUse", "LATENCY_BOUNDS_US"]

# Reads straight into a destination need this address alignment (O_DIRECT; a page).
DIRECT_ALIGNMENT = 4096
# Upper bounds (µs) of the latency histogram buckets; the last bucket is unbounded.
LATENCY_BOUNDS_US = (50, 100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000,
                     250_000, 500_000, 1_000_000)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Locator:
    """Where a record is; opaque to the store except for equality."""
    region: int
    offset: int
    size_bytes: int
    version: int


@dataclass(frozen=True)
class DiskRecord:
    """What recovery found, and what on_reclaim hands over."""
    namespace: str
    key: str
    size_bytes: int
    version: int
    locator: Locator


class DiskFull(Exception):
    """No region can take the record: every region is full and pinned or busy, or the file
    system has no room (ENOSPC, EDQUOT)."""


class DiskIOError(Exception):
    """The disk failed a read or write (EIO and the like)."""


class DiskCorrupt(DiskIOError):
    """A value read back does not match its crc; it was not served, and is dropped."""


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS_US) + 1)
        self.sum_us = 0

    def observe(self, started_ns: int) -> None:
        micros = (time.monotonic_ns() - started_ns) // 1000
        self.counts[bisect.bisect_left(LATENCY_BOUNDS_US, micros)] += 1
        self.sum_us += micros

    def snapshot(self) -> dict:
        return {"bounds_us": list(LATENCY_BOUNDS_US), "counts": list(self.counts),
                "sum_us": self.sum_us, "count": sum(self.counts)}


def _byte_view(part) -> memoryview:
    view = memoryview(part)
    if not view.c_contiguous:
        raise ValueError("a value part must be contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _locator(info: RecordInfo) -> Locator:
    return Locator(info.region, info.offset, info.size_bytes, info.version)


class DiskTier:
    recovered: list[DiskRecord]

    def __init__(self, config: SsdConfig, loop: asyncio.AbstractEventLoop,
                 on_reclaim: Callable | None, layout: Layout, files, io: DiskIO,
                 bounce: BouncePool):
        self._config = config
        self._loop = loop
        self._on_reclaim = on_reclaim
        self._layout = layout
        self._files = files
        self._io = io
        self._bounce = bounce
        self._block = layout.block_bytes
        self.direct_io = files.direct_io
        self.direct_io_reason = files.direct_io_reason
        self._regions = [Region(index, *layout.region_place(index))
                         for index in range(layout.regions)]
        self._free: deque[Region] = deque()
        self._active: Region | None = None
        self._opening: asyncio.Future | None = None
        self._next_sequence = 1
        self._index: dict[Locator, RecordInfo] = {}
        self._live_bytes = 0
        self._reclaim_lock = asyncio.Lock()
        self._reclaim_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()   # writes and reads in flight
        self._closed = False
        self.recovered = []
        self._stats = dict.fromkeys(
            ("writes", "write_bytes", "reads", "read_bytes", "write_errors", "read_errors",
             "corrupt_records", "torn_records", "superseded_records", "reclaimed_regions",
             "reclaimed_records", "drops", "key_too_long"), 0)
        self._write_latency = _Histogram()
        self._read_latency = _Histogram()

    # -- open and close -------------------------------------------------------------------

    @classmethod
    async def open(cls, config: SsdConfig, *, loop=None, on_reclaim=None) -> "DiskTier":
        """Creates/preallocates or opens the directory and recovers; .recovered lists what
        was found (the newest live record of each key), oldest first.

        on_reclaim(records: list[DiskRecord]) is called (and awaited if it returns an
        awaitable) with the live records of each reclaimed region, once they are gone from
        the tier and from the disk; it must not wait for a write of this tier. Raises LayoutMismatch for a
        directory formatted with other sizes, DirectoryInUse when another open tier holds
        it, DiskFull when the files do not fit, OSError when the directory or io_uring
        cannot be used."""
        loop = loop or asyncio.get_running_loop()
        layout = Layout(config.block_bytes, config.region_bytes, config.file_bytes,
                        config.capacity_bytes // config.region_bytes)
        if layout.regions <= config.reclaim_free_regions:
            raise ValueError(f"[ssd] capacity_bytes = {config.capacity_bytes} holds "
                             f"{layout.regions} regions of {config.region_bytes} bytes; the "
                             f"tier needs more than reclaim_free_regions "
                             f"({config.reclaim_free_regions})")
        if config.file_bytes % config.region_bytes or config.region_bytes % config.block_bytes:
            raise ValueError("[ssd] file_bytes must be a multiple of region_bytes, and "
                             "region_bytes of block_bytes")
        # Formatting preallocates and syncs every file: off the loop.
        opening = loop.run_in_executor(None, open_directory, config.directory, layout,
                                       config.reformat_on_mismatch)
        try:
            files = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened_files)  # it finishes in its thread
            raise
        except LayoutFull as exc:
            raise DiskFull(str(exc)) from None
        try:
            io = DiskIO(loop, config.queue_depth, files.fds)
        except BaseException:
            files.close()
            raise
        bounce = BouncePool(config.bounce_bytes, slot_size(config.bounce_bytes,
                                                           config.block_bytes))
        tier = cls(config, loop, on_reclaim, layout, files, io, bounce)
        if not files.direct_io:
            log.warning("ssd: %s: running without O_DIRECT (%s); writes still end with "
                        "fdatasync", config.directory, files.direct_io_reason)
        try:
            await tier._recover(files.formatted)
        except BaseException:
            await tier.close()
            raise
        log.info("ssd: %s: %d regions of %d bytes, %d records recovered (%d torn, %d "
                 "superseded), direct I/O %s", config.directory, layout.regions,
                 layout.region_bytes, len(tier.recovered), tier._stats["torn_records"],
                 tier._stats["superseded_records"], "on" if tier.direct_io else "off")
        return tier

    async def close(self) -> None:
        """Waits for the writes and reads in flight, then closes the ring and the files."""
        if self._closed:
            return
        self._closed = True
        while self._tasks or self._reclaim_task is not None:
            pending = set(self._tasks)
            if self._reclaim_task is not None:
                pending.add(self._reclaim_task)
            await asyncio.wait(pending)
        await self._io.close()
        self._files.close()
        self._bounce.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier is closed")

    # -- the interface --------------------------------------------------------------------

    def fits(self, namespace: str, key: str, size_bytes: int) -> bool:
        """Whether write() takes such a record: namespace + key fit the header block, and
        the record fits a region."""
        if not key_fits(namespace.encode(), key.encode(), self._block):
            return False
        return record_bytes(size_bytes, self._block) <= self._layout.region_bytes - self._block

    async def write(self, namespace: str, key: str, version: int,
                    parts: Sequence) -> Locator:
        """Writes the value (the parts' bytes in order) as a record; durable when it returns.
        Raises DiskFull / DiskIOError (the record is then not kept), ValueError when the
        record does not fit (see fits())."""
        self._check_open()
        views = [_byte_view(part) for part in parts]
        size = sum(view.nbytes for view in views)
        if not self.fits(namespace, key, size):
            if not key_fits(namespace.encode(), key.encode(), self._block):
                self._stats["key_too_long"] += 1
            raise ValueError(f"a record of {size} bytes for key {key!r} does not fit the "
                             f"disk tier (namespace + key at most {self._block - 48} bytes "
                             f"in UTF-8, value at most "
                             f"{self._layout.region_bytes - 2 * self._block} bytes)")
        task = self._loop.create_task(self._write(namespace, key, version, views, size))
        return await self._finish(task, cancel_cleanup=self._drop_after_cancel)

    async def read_into(self, locator: Locator, dest) -> None:
        """Reads the value into dest (len(dest) == locator.size_bytes). Raises KeyError when
        the tier holds no such record, DiskCorrupt / DiskIOError (the record is then
        dropped). If cancelled, returns only once the disk no longer writes into dest."""
        self._check_open()
        info = self._index.get(locator)
        if info is None:
            raise KeyError(locator)
        view = _byte_view(dest)
        if view.readonly:
            raise ValueError("read_into needs writable memory")
        if view.nbytes != info.size_bytes:
            raise ValueError(f"read_into: destination of {view.nbytes} bytes for a value of "
                             f"{info.size_bytes}")
        task = self._loop.create_task(self._read(info, view))
        await self._finish(task, cancel_cleanup=None)

    async def read(self, locator: Locator) -> bytes:
        """The value as bytes (for socket replies); raises as read_into does."""
        if locator not in self._index:
            raise KeyError(locator)
        size = locator.size_bytes
        # Page-aligned: whole blocks are read into it directly. Freed with its last view.
        buffer = mmap.mmap(-1, max(pad_to_block(size, self._block), self._block))
        view = memoryview(buffer)[:size]
        await self.read_into(locator, view)
        return bytes(view)

    async def drop(self, locator: Locator) -> None:
        """Marks the record DEAD on disk (durable when it returns); a restart never brings
        it back. Dropping a record the tier no longer holds does nothing. Raises
        DiskIOError when the mark could not be written (the record is forgotten anyway)."""
        self._check_open()
        info = self._index.get(locator)
        if info is None:
            return
        self._stats["drops"] += 1
        task = self._loop.create_task(self._drop_record(info))
        await self._finish(task, cancel_cleanup=None)

    def pin(self, locator: Locator) -> None:
        """Holds the record's region against reclaim until unpin (pins count). KeyError
        when the tier holds no such record."""
        info = self._index[locator]
        info.pins += 1
        self._regions[info.region].pins += 1

    def unpin(self, locator: Locator) -> None:
        info = self._index.get(locator)
        if info is None or info.pins == 0:
            return
        info.pins -= 1
        self._regions[info.region].pins -= 1

    def status(self) -> dict:
        regions = self._regions
        return dict(
            self._stats,
            capacity_bytes=self._layout.capacity_bytes,
            used_bytes=sum(r.append_offset for r in regions
                           if r.state not in (RegionState.FREE, RegionState.FAILED)),
            live_bytes=self._live_bytes,
            live_records=len(self._index),
            free_regions=len(self._free),
            regions=self._layout.regions,
            failed_regions=sum(r.state is RegionState.FAILED for r in regions),
            pinned_regions=sum(1 for r in regions if r.pins),
            region_bytes=self._layout.region_bytes,
            block_bytes=self._block,
            direct_io=self.direct_io,
            direct_io_reason=self.direct_io_reason,
            queue_depth=self._io.queue_depth,
            in_flight=self._io.in_flight,
            write_latency_us=self._write_latency.snapshot(),
            read_latency_us=self._read_latency.snapshot(),
        )

    # -- tasks that outlive a cancelled caller ---------------------------------------------

    async def _finish(self, task: asyncio.Task, cancel_cleanup):
        """Awaits task; a cancelled caller does not cancel it (its I/O is in the kernel):
        the caller waits for it to end, and cancel_cleanup(result) undoes a success."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                await asyncio.wait({task})
            if cancel_cleanup is not None and not task.cancelled() \
                    and task.exception() is None:
                cleanup = self._loop.create_task(cancel_cleanup(task.result()))
                self._tasks.add(cleanup)
                cleanup.add_done_callback(self._tasks.discard)
            raise

    async def _drop_after_cancel(self, locator: Locator) -> None:
        # The writer never learnt of this record: it must not come back at a restart.
        try:
            await self.drop(locator)
        except DiskIOError:
            log.warning("ssd: could not drop a record whose writer was cancelled")

    # -- writing --------------------------------------------------------------------------

    async def _write(self, namespace: str, key: str, version: int, views: list[memoryview],
                     size: int) -> Locator:
        started = time.monotonic_ns()
        value_crc = 0
        for view in views:
            value_crc = crc32c(view, value_crc)
        region, offset = await self._allocate(record_bytes(size, self._block))
        header = RecordHeader(FLAG_LIVE, namespace, key, region.sequence, size, version,
                              value_crc)
        info = RecordInfo(namespace, key, size, version, value_crc, region.index, offset,
                          region.sequence)
        entry = PendingWrite(info, self._loop.create_future())
        region.pending.append(entry)
        try:
            await self._write_record(region, offset, header, views, size)
            await self._io.datasync(region.file_index)
        except OSError as exc:
            self._stats["write_errors"] += 1
            entry.error = self._write_error(exc, "write of a record")
            entry.walkable = await self._mark_dead(region, info)
            log.warning("ssd: a record write failed in region %d: %s", region.index, exc)
        except BaseException as exc:
            # Not the disk's answer (the tier closing under it): what is on disk is unknown,
            # so nothing after it in the region may be reported either.
            entry.error = DiskIOError(f"disk tier write interrupted: {exc!r}")
            entry.walkable = False
            self._seal(region)
            entry.resolved = True
            region.settle(lambda: DiskIOError("an earlier record of its region could not be "
                                              "written"), self._add)
            raise
        if entry.error is not None and region is self._active:
            self._seal(region)  # append elsewhere: this region's walk may stop here
        entry.resolved = True
        region.settle(lambda: DiskIOError("an earlier record of its region could not be "
                                          "written"), self._add)
        outcome = await entry.final
        if outcome is not None:
            raise outcome
        self._stats["writes"] += 1
        self._stats["write_bytes"] += size
        self._write_latency.observe(started)
        return _locator(info)

    def _write_error(self, exc: OSError, what: str) -> Exception:
        if exc.errno in _FULL_ERRNOS:
            return DiskFull(f"disk tier {what}: {exc.strerror}")
        return DiskIOError(f"disk tier {what}: {exc.strerror or exc} [errno {exc.errno}]")

    async def _write_record(self, region: Region, offset: int, header: RecordHeader,
                            views: list[memoryview], size: int) -> None:
        """Writes header block + value (padded), one request per bounce slot or per slot's
        worth of value written straight from its memory (a single aligned part, O_DIRECT);
        raises the first OSError once every request has ended."""
        block = self._block
        total = record_bytes(size, block)
        base = region.file_offset + offset
        pool = self._bounce
        direct = 0  # value bytes written from the caller's memory
        if self.direct_io and len(views) == 1 and size >= block:
            address = buffer_address(views[0])
            if address % DIRECT_ALIGNMENT == 0:
                direct = size // block * block
        staged = [(0, block), (block + direct, total)] if direct else [(0, total)]
        requests = []
        for position in range(0, direct, pool.slot_bytes):
            length = min(pool.slot_bytes, direct - position)
            requests.append(self._io.write(region.file_index, address + position, length,
                                           base + block + position, keep=views[0]))
        for start, end in staged:
            position = start
            while position < end:
                length = min(pool.slot_bytes, end - position)
                slot = await pool.acquire()
                buffer = pool.view(slot)[:length]
                cursor = 0
                if position == 0:
                    encode_record_header(buffer[:block], header)
                    cursor = block
                value_start = position + cursor - block
                value_end = min(size, position + length - block)
                if value_end > value_start:
                    _copy_value(views, value_start,
                                buffer[cursor:cursor + value_end - value_start])
                    cursor += value_end - value_start
                if cursor < length:
                    buffer[cursor:] = bytes(length - cursor)
                request = self._io.write(region.file_index, pool.address(slot), length,
                                         base + position, keep=None)
                request.add_done_callback(lambda _, slot=slot: pool.release(slot))
                requests.append(request)
                position += length
        results = await asyncio.gather(*requests, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _mark_dead(self, region: Region, info: RecordInfo) -> bool:
        """Rewrites a record's header block as DEAD and datasyncs; False when that fails."""
        header = RecordHeader(FLAG_DEAD, info.namespace, info.key, info.sequence,
                              info.size_bytes, info.version, info.value_crc)
        pool = self._bounce
        slot = await pool.acquire()
        try:
            encode_record_header(pool.view(slot)[:self._block], header)
            await self._io.write(region.file_index, pool.address(slot), self._block,
                                 region.file_offset + info.offset)
            await self._io.datasync(region.file_index)
            return True
        except OSError as exc:
            self._stats["write_errors"] += 1
            log.warning("ssd: could not mark a record DEAD in region %d: %s", region.index,
                        exc)
            return False
        finally:
            pool.release(slot)

    # -- regions: allocation, opening, reclaim ---------------------------------------------

    async def _allocate(self, need: int) -> tuple[Region, int]:
        """(region, offset) of `need` bytes appended to the active region, opening a new
        region (and reclaiming one if none is free) when it is full."""
        while True:
            self._check_open()
            active = self._active
            if active is not None and active.append_offset + need <= self._layout.region_bytes:
                offset = active.append_offset
                active.append_offset += need
                return active, offset
            if active is not None:
                self._seal(active)
            if self._opening is not None:
                await self._opening
                continue
            if not self._free:
                if not await self._reclaim_one(1):
                    raise DiskFull(
                        f"disk tier full: all {self._layout.regions} regions hold pinned, "
                        "busy or failed records")
                continue
            region = self._free.popleft()
            opening = self._opening = self._loop.create_future()
            try:
                await self._open_region(region)
            finally:
                self._opening = None
                opening.set_result(None)
            self._active = region
            self._maybe_reclaim()

    def _seal(self, region: Region) -> None:
        if region.state is RegionState.ACTIVE:
            region.state = RegionState.SEALED
        if self._active is region:
            self._active = None

    async def _open_region(self, region: Region) -> None:
        """Gives a free region a new sequence and writes its header (durably)."""
        region.state = RegionState.OPENING
        region.sequence = self._next_sequence
        self._next_sequence += 1
        pool = self._bounce
        slot = await pool.acquire()
        try:
            encode_region_header(pool.view(slot)[:self._block], RegionHeader(
                region.index, self._files.instance_id, region.sequence))
            await self._io.write(region.file_index, pool.address(slot), self._block,
                                 region.file_offset)
            await self._io.datasync(region.file_index)
        except OSError as exc:
            self._stats["write_errors"] += 1
            region.state = RegionState.FAILED
            log.warning("ssd: region %d out of service: its header write failed: %s",
                        region.index, exc)
            raise self._write_error(exc, f"header write of region {region.index}") from None
        finally:
            pool.release(slot)
        region.state = RegionState.ACTIVE
        region.append_offset = self._block

    def _maybe_reclaim(self) -> None:
        if len(self._free) >= self._config.reclaim_free_regions or self._closed \
                or self._reclaim_task is not None:
            return
        self._reclaim_task = self._loop.create_task(self._reclaim_background())

    async def _reclaim_background(self) -> None:
        try:
            while len(self._free) < self._config.reclaim_free_regions and not self._closed:
                if not await self._reclaim_one(self._config.reclaim_free_regions):
                    break
        except Exception:
            log.exception("ssd: reclaim failed")
        finally:
            self._reclaim_task = None

    async def _reclaim_one(self, free_wanted: int) -> bool:
        """Reclaims the oldest sealed region that nothing holds, unless free_wanted regions
        are free already: its records leave the index, its header is erased (durably), its
        live records go to on_reclaim, and it is free. False when no region can be
        reclaimed."""
        async with self._reclaim_lock:
            if len(self._free) >= free_wanted:
                return True  # a reclaim that held the lock before us made the room
            candidates = [r for r in self._regions
                          if r.state is RegionState.SEALED and not r.busy]
            if not candidates:
                return False
            region = min(candidates, key=lambda r: r.sequence)
            region.state = RegionState.RECLAIMING
            records = []
            for info in region.records.values():
                locator = _locator(info)
                del self._index[locator]
                self._live_bytes -= info.size_bytes
                records.append(DiskRecord(info.namespace, info.key, info.size_bytes,
                                          info.version, locator))
            region.records.clear()
            self._stats["reclaimed_regions"] += 1
            self._stats["reclaimed_records"] += len(records)
            # Erase the header (durably) before telling the owner: once it has forgotten
            # these records it will never drop them, so they must not survive a crash.
            erased = await self._erase_region_header(region)
            if records and self._on_reclaim is not None:
                try:
                    result = self._on_reclaim(records)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("ssd: on_reclaim failed")
            if not erased:
                region.state = RegionState.FAILED
                return True  # something changed; the caller looks again
            region.reset()
            self._free.append(region)
            return True

    async def _erase_region_header(self, region: Region) -> bool:
        """Writes a FREE header (with a sequence of its own, so that sequences found at the
        next start still cover every one used) and datasyncs; False when that fails."""
        sequence = self._next_sequence
        self._next_sequence += 1
        pool = self._bounce
        slot = await pool.acquire()
        try:
            encode_region_header(pool.view(slot)[:self._block], RegionHeader(
                region.index, self._files.instance_id, sequence, free=True))
            await self._io.write(region.file_index, pool.address(slot), self._block,
                                 region.file_offset)
            await self._io.datasync(region.file_index)
            return True
        except OSError as exc:
            self._stats["write_errors"] += 1
            log.warning("ssd: region %d out of service: erasing its header failed: %s",
                        region.index, exc)
            return False
        finally:
            pool.release(slot)

    # -- reading and dropping --------------------------------------------------------------

    async def _read(self, info: RecordInfo, dest: memoryview) -> None:
        started = time.monotonic_ns()
        region = self._regions[info.region]
        region.readers += 1
        try:
            await self._read_value(region, info, dest)
        except OSError as exc:
            self._stats["read_errors"] += 1
            log.warning("ssd: a read failed in region %d: %s; the record is dropped",
                        region.index, exc)
            await self._forget_quietly(info)
            raise DiskIOError(f"disk tier read: {exc.strerror or exc} "
                              f"[errno {exc.errno}]") from None
        finally:
            region.readers -= 1
        if crc32c(dest) != info.value_crc:
            self._stats["corrupt_records"] += 1
            log.warning("ssd: a value read from region %d does not match its crc; the record "
                        "is dropped", region.index)
            await self._forget_quietly(info)
            raise DiskCorrupt("disk tier read: the value does not match its crc32c")
        self._stats["reads"] += 1
        self._stats["read_bytes"] += info.size_bytes
        self._read_latency.observe(started)

    async def _read_value(self, region: Region, info: RecordInfo, dest: memoryview) -> None:
        """Reads straight into dest where its memory allows (aligned, whole blocks; any
        memory without O_DIRECT), the rest through bounce slots."""
        size = info.size_bytes
        if size == 0:
            return
        block = self._block
        base = region.file_offset + info.offset + block
        address = buffer_address(dest)
        if not self.direct_io:
            direct = size
        elif address % DIRECT_ALIGNMENT == 0:
            direct = size // block * block
        else:
            direct = 0
        pool = self._bounce
        requests = []
        for position in range(0, direct, pool.slot_bytes):
            length = min(pool.slot_bytes, direct - position)
            requests.append(self._io.read(region.file_index, address + position, length,
                                          base + position, keep=dest))
        for position in range(direct, size, pool.slot_bytes):
            length = min(pool.slot_bytes, size - position)
            requests.append(self._read_bounced(region.file_index, base + position,
                                               dest[position:position + length]))
        results = await asyncio.gather(*requests, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _read_bounced(self, file_index: int, file_offset: int,
                            dest: memoryview) -> None:
        pool = self._bounce
        slot = await pool.acquire()
        try:
            length = pad_to_block(dest.nbytes, self._block)
            await self._io.read(file_index, pool.address(slot), length, file_offset)
            dest[:] = pool.view(slot)[:dest.nbytes]
        finally:
            pool.release(slot)

    def _forget(self, info: RecordInfo) -> bool:
        """Takes a record out of the index; False when it was not there."""
        locator = _locator(info)
        if self._index.get(locator) is not info:
            return False
        del self._index[locator]
        self._live_bytes -= info.size_bytes
        region = self._regions[info.region]
        region.records.pop(info.offset, None)
        region.pins -= info.pins
        info.pins = 0
        return True

    async def _forget_quietly(self, info: RecordInfo) -> None:
        """Forgets a record that could not be read, and marks it DEAD if the disk lets us."""
        if self._forget(info):
            region = self._regions[info.region]
            region.readers += 1
            try:
                await self._mark_dead(region, info)
            finally:
                region.readers -= 1

    async def _drop_record(self, info: RecordInfo) -> None:
        if not self._forget(info):
            return
        region = self._regions[info.region]
        region.readers += 1  # the DEAD mark must land before the region can be reused
        try:
            if not await self._mark_dead(region, info):
                raise DiskIOError("disk tier drop: the DEAD mark could not be written")
        finally:
            region.readers -= 1

    def _add(self, info: RecordInfo) -> None:
        self._index[_locator(info)] = info
        self._regions[info.region].records[info.offset] = info
        self._live_bytes += info.size_bytes

    # -- recovery -------------------------------------------------------------------------

    async def _recover(self, formatted: bool) -> None:
        # Never reuse a sequence: above every one found on disk, and above the clock's
        # nanoseconds (a region erased by a reclaim whose FREE header was torn leaves no
        # trace of its sequence; one opened in an earlier start had a smaller one).
        self._next_sequence = time.time_ns()
        if formatted:
            self._free.extend(self._regions)
            return
        scanned = await recovery.scan(self._io, self._layout, self._files.instance_id)
        newest: dict[tuple[str, str], RecordInfo] = {}
        superseded: list[RecordInfo] = []
        for result in scanned:
            region = self._regions[result.index]
            self._stats["torn_records"] += result.torn
            if result.read_error is not None:
                self._stats["read_errors"] += 1
                region.state = RegionState.FAILED
                log.warning("ssd: region %d out of service: its header cannot be read: %s",
                            region.index, result.read_error)
                continue
            if result.walk_error is not None:
                self._stats["read_errors"] += 1
                log.warning("ssd: region %d: reading its records failed at %d: %s",
                            region.index, result.end_offset, result.walk_error)
            if not result.sequence:
                self._next_sequence = max(self._next_sequence, result.free_sequence + 1)
                self._free.append(region)
                continue
            # Found at start: never appended to again (what lies after its walk's end may
            # be records of this sequence that were never acknowledged).
            region.state = RegionState.SEALED
            region.sequence = result.sequence
            region.append_offset = result.end_offset
            self._next_sequence = max(self._next_sequence, result.sequence + 1)
            for offset, header in result.records:
                if header.flags != FLAG_LIVE:
                    continue
                info = RecordInfo(header.namespace, header.key, header.size_bytes,
                                  header.version, header.value_crc, region.index, offset,
                                  header.sequence)
                name = (header.namespace, header.key)
                other = newest.get(name)
                if other is None or (other.sequence, other.offset) < (info.sequence, offset):
                    if other is not None:
                        superseded.append(other)
                    newest[name] = info
                else:
                    superseded.append(info)
        for info in newest.values():
            self._add(info)
        # An older copy must not come back once the newer one is dropped: mark it DEAD.
        self._stats["superseded_records"] += len(superseded)
        for info in superseded:
            await self._mark_dead(self._regions[info.region], info)
        self.recovered = [DiskRecord(i.namespace, i.key, i.size_bytes, i.version, _locator(i))
                          for i in sorted(newest.values(), key=lambda i: (i.sequence, i.offset))]


def _close_opened_files(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _copy_value(views: list[memoryview], start: int, dest: memoryview) -> None:
    """Copies the value bytes [start, start + len(dest)) of the parts into dest."""
    position = 0
    written = 0
    for view in views:
        end = position + view.nbytes
        if end > start + written:
            begin = max(start + written, position) - position
            count = min(view.nbytes - begin, dest.nbytes - written)
            dest[written:written + count] = view[begin:begin + count]
            written += count
        position = end
        if written == dest.nbytes:
            break
