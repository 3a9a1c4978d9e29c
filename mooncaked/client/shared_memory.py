"""A local client's view of the daemon's segments (wire/PROTOCOL.md section 5.2).

The daemon's segments are shared-memory files; a client on the same node maps them and moves
values with one memcpy (GIL released) between its own buffers and segment memory.
"""

from __future__ import annotations

import mmap
import os
import threading

from mooncaked._native import buffer_address, copy_memory
from mooncaked.errors import ErrorCode, error_for


class SharedSegments:
    def __init__(self, descriptions: list[dict]) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._bases: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._close_lock = threading.Lock()
        try:
            for segment in descriptions:
                # A prefaulted segment's pages all exist: map them all now, so copies take no
                # page faults (without it, every first touch of a 4 KiB page faults).
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if segment.get("prefaulted") else 0)
                fd = os.open(segment["shm_path"], os.O_RDWR)
                try:
                    mapped = mmap.mmap(fd, segment["size_bytes"], flags,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self._maps[segment["id"]] = mapped
                self._bases[segment["id"]] = buffer_address(mapped)
                self._sizes[segment["id"]] = segment["size_bytes"]
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self._maps)

    def address(self, segment_id: int, offset: int, size_bytes: int) -> int:
        """The address of a range the daemon handed out; checked against the mapping."""
        base = self._bases.get(segment_id)
        if base is None:
            raise error_for(ErrorCode.SEGMENT_NOT_FOUND,
                            f"segment {segment_id} is not mapped by this client")
        if offset < 0 or offset + size_bytes > self._sizes[segment_id]:
            raise ValueError(f"range {offset}+{size_bytes} is outside segment {segment_id}")
        return base + offset

    def write(self, segment_id: int, offset: int, source_address: int, size_bytes: int) -> None:
        copy_memory(self.address(segment_id, offset, size_bytes), source_address, size_bytes)

    def read(self, segment_id: int, offset: int, target_address: int, size_bytes: int) -> None:
        copy_memory(target_address, self.address(segment_id, offset, size_bytes), size_bytes)

    def close(self) -> None:
        """Unmap every segment; safe to call twice and from two threads at once. The caller
        makes sure no copy is using the mapping."""
        with self._close_lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._bases.clear()
        for mapped in maps:
            try:
                mapped.close()
            except BufferError:
                pass
