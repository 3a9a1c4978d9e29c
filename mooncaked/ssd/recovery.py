"""The disk tier's scan at start: which regions hold records, and which records.

Each region's header block is read; a region with a valid header (this directory's instance
id, crc right) is walked from its first record: a record is taken when its header is intact
and carries the region's sequence, and the walk stops at the first block that is not such a
header (the never-written or torn tail; a header that is only partly there is counted torn).
Values are not read here: every read checks the value's crc.
"""

from __future__ import annotations

import asyncio
import mmap
from dataclasses import dataclass, field

from mooncaked._native import buffer_address
from mooncaked.ssd.disk_io import DiskIO
from mooncaked.ssd.layout import Layout
from mooncaked.ssd.records import (RecordHeader, TornHeader, decode_record_header,
                                   decode_region_header, record_bytes)

WINDOW_BYTES = 256 * 1024   # read ahead while walking records of small values
SCANNERS = 8                # regions scanned at once at most


@dataclass
class ScannedRegion:
    index: int
    sequence: int = 0           # 0: no region header, or a FREE one (the region is free)
    free_sequence: int = 0      # the sequence of a FREE header
    end_offset: int = 0         # where the walk stopped (region-relative)
    records: list[tuple[int, RecordHeader]] = field(default_factory=list)
    torn: int = 0
    read_error: OSError | None = None   # the scan could not read the header (out of service)
    walk_error: OSError | None = None   # a read failed while walking: records after are lost


async def scan(io: DiskIO, layout: Layout, instance_id: int) -> list[ScannedRegion]:
    results = [ScannedRegion(index) for index in range(layout.regions)]
    pending = iter(results)
    window = max(layout.block_bytes, min(WINDOW_BYTES, layout.region_bytes)
                 // layout.block_bytes * layout.block_bytes)

    async def scanner() -> None:
        buffer = mmap.mmap(-1, window)
        try:
            for result in pending:
                await _scan_region(io, layout, instance_id, result, buffer, window)
        finally:
            buffer.close()

    await asyncio.gather(*(scanner() for _ in range(min(SCANNERS, io.queue_depth,
                                                         layout.regions))))
    return results


async def _scan_region(io: DiskIO, layout: Layout, instance_id: int, result: ScannedRegion,
                       buffer: mmap.mmap, window: int) -> None:
    block = layout.block_bytes
    file_index, base = layout.region_place(result.index)
    address = buffer_address(buffer)
    with memoryview(buffer) as view:
        try:
            await io.read(file_index, address, block, base, keep=buffer)
        except OSError as exc:
            result.read_error = exc
            return
        header = decode_region_header(view[:block])
        if header is None or header.instance_id != instance_id or header.region != result.index:
            return
        if header.free:
            result.free_sequence = header.sequence
            return
        result.sequence = header.sequence
        offset = block
        window_start = window_end = 0
        while offset + block <= layout.region_bytes:
            if not window_start <= offset < window_end:
                size = min(window, layout.region_bytes - offset)
                try:
                    await io.read(file_index, address, size, base + offset, keep=buffer)
                except OSError as exc:
                    result.walk_error = exc
                    break
                window_start, window_end = offset, offset + size
            at = offset - window_start
            try:
                record = decode_record_header(view[at:at + block], header.sequence)
            except TornHeader:
                result.torn += 1
                break
            if record is None:
                break
            size_on_disk = record_bytes(record.size_bytes, block)
            if offset + size_on_disk > layout.region_bytes:
                result.torn += 1  # an intact header cannot say this: count it as damage
                break
            result.records.append((offset, record))
            offset += size_on_disk
        result.end_offset = offset
