"""Helpers for the transfer-layer tests: an asyncio loop on a thread of its own (so a test can
block on a subprocess while the endpoint keeps serving), and memory with guard bands."""

from __future__ import annotations

import asyncio
import ctypes
import threading


LOOP_KINDS = ["asyncio", "uring"]


def loop_usable(kind: str) -> tuple[bool, str]:
    if kind == "asyncio":
        return True, ""
    from mooncaked.io import uring
    return uring.usable()


class LoopThread:
    """kind: "asyncio" (stdlib) or "uring" (the daemon's io_uring loop)."""

    def __init__(self, kind: str = "asyncio") -> None:
        if kind == "uring":
            from mooncaked.io import uring
            self.loop = uring.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


GUARD = b"\xa5"


class GuardedMemory:
    """`length` bytes at `address` with `guard` bytes of 0xa5 on both sides, all in one
    allocation: only [address, address + length) is meant to be registered, and
    guards_intact() says whether anything wrote around it."""

    def __init__(self, length: int, guard: int = 4096) -> None:
        self.length, self.guard = length, guard
        self._raw = ctypes.create_string_buffer(GUARD * (length + 2 * guard), length + 2 * guard)
        self.address = ctypes.addressof(self._raw) + guard
        ctypes.memset(self.address, 0, length)

    def write(self, offset: int, data: bytes) -> None:
        assert 0 <= offset and offset + len(data) <= self.length
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.address + offset, length)

    def view(self, offset: int, length: int) -> memoryview:
        assert 0 <= offset and offset + length <= self.length
        return memoryview((ctypes.c_char * length).from_address(self.address + offset)).cast("B")

    def guards_intact(self) -> bool:
        start = ctypes.addressof(self._raw)
        return (ctypes.string_at(start, self.guard) == GUARD * self.guard and
                ctypes.string_at(self.address + self.length, self.guard) == GUARD * self.guard)


def pattern(length: int, seed: int) -> bytes:
    """Bytes that differ at every offset and between seeds."""
    return bytes((i * 7 + seed * 31 + (i >> 8)) & 0xFF for i in range(length))
