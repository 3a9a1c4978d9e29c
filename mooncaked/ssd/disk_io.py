"""The disk tier's I/O on the event loop: its own io_uring, woken through an eventfd.

    io = DiskIO(loop, queue_depth, files=fds)
    moved = await io.write(file_index, address, size_bytes, offset, keep=buffer)
    await io.datasync(file_index)        # joins the file's next fdatasync batch
    await io.close()

Requests are queued and handed to the kernel in one io_uring_submit per loop iteration (a
call_soon flush), at most queue_depth reads and writes in flight (the rest wait in order). The
ring's eventfd is registered with loop.add_reader, so this works on the io_uring loop and on
stdlib asyncio alike, with no thread. datasync() does not issue an fdatasync per caller: the
callers that ask while none is in flight for that file share the next one, which is submitted
after their writes completed, so it covers them.

Results: read/write resolve to the bytes moved, or raise OSError with the request's errno (a
short transfer is an EIO). The buffer passed as `keep` is referenced until the kernel is done
with the memory, even if the awaiting task is cancelled.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
from collections import deque

from mooncaked._native import DiskRing

_READ, _WRITE, _FSYNC = 0, 1, 2


class _Op:
    __slots__ = ("kind", "file_index", "address", "size_bytes", "offset", "keep", "future",
                 "waiters")

    def __init__(self, kind, file_index, address, size_bytes, offset, keep, future):
        self.kind = kind
        self.file_index = file_index
        self.address = address
        self.size_bytes = size_bytes
        self.offset = offset
        self.keep = keep
        self.future = future
        self.waiters: list[asyncio.Future] = []  # an fsync's batch of datasync callers


class DiskIO:
    def __init__(self, loop: asyncio.AbstractEventLoop, queue_depth: int, fds: list[int]):
        self._loop = loop
        self._fds = list(fds)
        self.queue_depth = queue_depth
        # Room for every read/write in flight plus one fsync per file.
        self._ring = DiskRing(min(32768, 1 << (queue_depth + len(fds) + 1).bit_length()))
        self._tokens = itertools.count(1)
        self._ops: dict[int, _Op] = {}        # submitted, not completed
        self._waiting: deque[_Op] = deque()   # reads/writes beyond queue_depth, in order
        self._sync_waiters: list[list[asyncio.Future]] = [[] for _ in fds]
        self._sync_in_flight = [False] * len(fds)
        self.in_flight = 0                     # reads and writes submitted, not completed
        self._flush_scheduled = False
        self._idle: asyncio.Future | None = None
        self._closed = False
        loop.add_reader(self._ring.eventfd, self._on_completions)

    # -- requests -------------------------------------------------------------------------

    def read(self, file_index: int, address: int, size_bytes: int, offset: int,
             keep=None) -> asyncio.Future:
        return self._queue(_READ, file_index, address, size_bytes, offset, keep)

    def write(self, file_index: int, address: int, size_bytes: int, offset: int,
              keep=None) -> asyncio.Future:
        return self._queue(_WRITE, file_index, address, size_bytes, offset, keep)

    def datasync(self, file_index: int) -> asyncio.Future:
        """An fdatasync of the file issued after this call; resolves to 0 or raises."""
        self._check_open()
        future = self._loop.create_future()
        self._sync_waiters[file_index].append(future)
        self._schedule_flush()
        return future

    def _queue(self, kind, file_index, address, size_bytes, offset, keep) -> asyncio.Future:
        self._check_open()
        future = self._loop.create_future()
        self._waiting.append(_Op(kind, file_index, address, size_bytes, offset, keep, future))
        self._schedule_flush()
        return future

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier's I/O is closed")

    # -- submission -----------------------------------------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Move what waits into the ring (within queue_depth) and submit it in one call."""
        self._flush_scheduled = False
        ring = self._ring
        while self._waiting and self.in_flight < self.queue_depth:
            op = self._waiting.popleft()
            if op.future.cancelled() and op.kind == _READ:
                continue  # nobody waits for it and nothing on disk depends on it
            token = next(self._tokens)
            fd = self._fds[op.file_index]
            if op.kind == _READ:
                ring.prep_read(fd, op.address, op.size_bytes, op.offset, token)
            else:
                ring.prep_write(fd, op.address, op.size_bytes, op.offset, token)
            self._ops[token] = op
            self.in_flight += 1
        for file_index, waiters in enumerate(self._sync_waiters):
            if waiters and not self._sync_in_flight[file_index]:
                token = next(self._tokens)
                op = _Op(_FSYNC, file_index, 0, 0, 0, None, None)
                op.waiters = waiters
                self._sync_waiters[file_index] = []
                self._sync_in_flight[file_index] = True
                ring.prep_fsync(self._fds[file_index], True, token)
                self._ops[token] = op
        try:
            ring.submit()
        except OSError as exc:  # the ring itself failed: fail what it holds
            self._fail_all(exc)
            return
        if ring.queued:
            self._schedule_flush()  # the kernel took part of them (busy): the rest next

    def _fail_all(self, exc: OSError) -> None:
        for op in self._ops.values():
            for future in ([op.future] if op.future is not None else op.waiters):
                if not future.done():
                    future.set_exception(OSError(exc.errno, exc.strerror))
        self._ops.clear()
        self.in_flight = 0
        self._sync_in_flight = [False] * len(self._fds)
        self._check_idle()

    # -- completions ----------------------------------------------------------------------

    def _on_completions(self) -> None:
        for token, result in self._ring.reap():
            op = self._ops.pop(token, None)
            if op is None:
                continue
            if op.kind == _FSYNC:
                self._sync_in_flight[op.file_index] = False
                for future in op.waiters:
                    _resolve(future, result, 0)
                if self._sync_waiters[op.file_index]:
                    self._schedule_flush()
                continue
            self.in_flight -= 1
            _resolve(op.future, result, op.size_bytes)
        if self._waiting:
            self._schedule_flush()
        self._check_idle()

    def _check_idle(self) -> None:
        if self._idle is not None and not self._ops and not self._waiting \
                and not any(self._sync_waiters) and not self._idle.done():
            self._idle.set_result(None)

    async def close(self) -> None:
        """Wait for every queued and in-flight request, then close the ring."""
        if self._closed:
            return
        if self._ops or self._waiting or any(self._sync_waiters):
            self._idle = self._loop.create_future()
            self._schedule_flush()
            await self._idle
        self._closed = True
        self._loop.remove_reader(self._ring.eventfd)
        self._ring.close()


def _resolve(future: asyncio.Future | None, result: int, expected: int) -> None:
    if future is None or future.done():
        return
    if result < 0:
        future.set_exception(OSError(-result, os.strerror(-result)))
    elif expected and result != expected:
        future.set_exception(OSError(errno.EIO, f"short transfer: {result} of {expected} "
                                     "bytes"))
    else:
        future.set_result(result)
