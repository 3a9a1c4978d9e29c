"""Aligned staging memory for disk I/O (O_DIRECT needs block-aligned addresses and sizes).

    pool = BouncePool(total_bytes, slot_bytes)
    slot = await pool.acquire()      # waits while every slot is taken
    pool.view(slot)[...]             # slot_bytes of page-aligned memory
    pool.address(slot)
    pool.release(slot)

One anonymous mapping (page-aligned) cut into equal slots. A caller holds at most one slot at
a time while waiting for another, so waiting can never deadlock.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import deque

from mooncaked._native import buffer_address

SLOT_BYTES = 1 << 20  # one I/O request of a large value moves at most this much
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def slot_size(total_bytes: int, block_bytes: int) -> int:
    """Slots of SLOT_BYTES, or fewer bytes when the pool is small; whole blocks always."""
    size = max(block_bytes, min(SLOT_BYTES, total_bytes))
    return size // block_bytes * block_bytes


class BouncePool:
    def __init__(self, total_bytes: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.slots = max(1, total_bytes // slot_bytes)
        # Populated at once: no page faults on the I/O path.
        self._memory = mmap.mmap(-1, self.slots * slot_bytes,
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        self._view = memoryview(self._memory)
        self._base = buffer_address(self._memory)
        self._free = list(range(self.slots - 1, -1, -1))
        self._waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> int:
        if self._free and not self._waiters:
            return self._free.pop()
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # handed over as we were cancelled
            raise

    def release(self, slot: int) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start:start + self.slot_bytes]

    def address(self, slot: int) -> int:
        return self._base + slot * self.slot_bytes

    def close(self) -> None:
        try:
            self._view.release()
            self._memory.close()
        except BufferError:
            pass  # a slot's view is still referenced (a traceback): freed with it
