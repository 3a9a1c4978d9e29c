"""The leader's arenas: where a put's replicas go without a log command of their own.

A put in a cluster is one log command (meta/commands.py ArenaPut). Its ranges are parts of
arenas: large ranges the leader took through the log (ReserveArena) for its term, which it
hands out here, each part to one put, by moving a cursor (a part is never handed out twice,
even after its put failed). Followers know nothing of a put until its ArenaPut.

Why no range is ever written by two writers:
- the replicated allocator gives an arena's range to nothing else while the arena lives;
- inside an arena, only the leader of the arena's term hands out parts, and each part once;
  a later leader hands out parts of its own arenas only (the first arena command of its term
  closes every older one). A leader hands out a part only after a read barrier (its
  check-quorum lease or a heartbeat round, as for a linearizable read), so a leader that has
  lost its quorum, and may have been replaced, hands out nothing: every part of an arena was
  handed out before a later term closed it;
- a closed arena returns to the allocator only once no object uses a part of it and `hold_ms`
  has passed since it closed; the hold (four times the RPC timeout) is the time a part handed
  out just before the close may take to reach its writer (one RPC timeout), plus its write's
  timeout, plus the bound on late replica writes the put path already uses for a revoked put
  (twice the RPC timeout), and every part of the arena was handed out before it closed. An arena this leader closes after every put it handed a part
  to has ended (committed or failed after its writes finished) needs no hold.
- segment generations still fence writes aimed at a node that registered again.

What is local to the leader and lost with its leadership: the open arenas' cursors and the
puts in progress (a put_end that reaches a new leader fails, and the put is tried again).
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.placement import candidate_order

log = logging.getLogger(__name__)


class OpenArena:
    __slots__ = ("arena_id", "segment_id", "cursor", "end", "in_flight", "late_writes")

    def __init__(self, arena_id: int, segment_id: int, offset: int, size_bytes: int) -> None:
        self.arena_id = arena_id
        self.segment_id = segment_id
        self.cursor = offset  # the next part starts here
        self.end = offset + size_bytes
        self.in_flight = 0  # puts with a part here that have not ended
        self.late_writes = False  # a put with a part here was revoked: a write may be late


class PendingPut:
    """A put between put_start and put_end, known to this leader alone."""
    __slots__ = ("writer_id", "size_bytes", "replica_num", "parts", "soft_pin_ttl_ms",
                 "hard_pin", "upsert", "started_ms", "charged_bytes", "new_object", "namespace")

    def __init__(self, writer_id: int, size_bytes: int, replica_num: int,
                 soft_pin_ttl_ms: int | None, hard_pin: bool, upsert: bool, started_ms: int,
                 charged_bytes: int, new_object: bool, namespace: str) -> None:
        self.writer_id = writer_id
        self.size_bytes = size_bytes
        self.replica_num = replica_num
        # (arena, offset) of each replica, once handed out
        self.parts: list[tuple[OpenArena, int]] | None = None
        self.soft_pin_ttl_ms = soft_pin_ttl_ms
        self.hard_pin = hard_pin
        self.upsert = upsert
        self.started_ms = started_ms
        self.charged_bytes = charged_bytes
        self.new_object = new_object
        self.namespace = namespace


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class LeaderArenas:
    def __init__(self, state, propose, now_ms, arena_bytes: int, hold_ms: int) -> None:
        self.state = state
        self._propose = propose  # command -> future of its result
        self.now_ms = now_ms  # the cluster clock
        self.arena_bytes = arena_bytes
        self.hold_ms = hold_ms
        self.term = 0
        self._open: dict[int, OpenArena] = {}  # segment id -> the arena parts come from
        self._retiring: dict[int, OpenArena] = {}  # full, closed once their puts ended
        self._reserving: dict[int, asyncio.Future] = {}  # segment id -> ReserveArena
        self.pending: dict[c.ObjectKey, dict[int, PendingPut]] = {}
        self.pending_bytes: dict[str, int] = {}  # by charged namespace
        self.pending_objects: dict[str, int] = {}  # keys that are new, by namespace
        self.pending_new = 0

    def reset(self, term: int) -> None:
        """A new leadership: nothing of an earlier one is handed out again."""
        self.term = term
        self._open.clear()
        self._retiring.clear()
        self._reserving.clear()
        self.pending.clear()
        self.pending_bytes.clear()
        self.pending_objects.clear()
        self.pending_new = 0

    # -- puts in progress ---------------------------------------------------------------------

    def add_pending(self, key: c.ObjectKey, put: PendingPut) -> None:
        self.pending.setdefault(key, {})[put.writer_id] = put
        ns = put.namespace
        self.pending_bytes[ns] = self.pending_bytes.get(ns, 0) + put.charged_bytes
        if put.new_object:
            self.pending_objects[ns] = self.pending_objects.get(ns, 0) + 1
            self.pending_new += 1

    def take_pending(self, key: c.ObjectKey, writer_id: int) -> PendingPut | None:
        puts = self.pending.get(key)
        put = puts.pop(writer_id, None) if puts else None
        if puts is not None and not puts:
            del self.pending[key]
        return put

    def end_pending(self, put: PendingPut, writes_done: bool) -> None:
        """The put ended (`writes_done`: no write of it can still land) or was dropped."""
        ns = put.namespace
        self.pending_bytes[ns] -= put.charged_bytes
        if not self.pending_bytes[ns]:
            del self.pending_bytes[ns]
        if put.new_object:
            self.pending_objects[ns] -= 1
            if not self.pending_objects[ns]:
                del self.pending_objects[ns]
            self.pending_new -= 1
        for arena, _ in put.parts or ():
            arena.in_flight -= 1
            if not writes_done:
                arena.late_writes = True
            if arena.in_flight == 0 and self._retiring.pop(arena.arena_id, None) is not None:
                self._close(arena)

    def expire(self) -> None:
        """Forget puts older than the release timeout (their writer is gone or too late)."""
        deadline = self.now_ms() - self.state.release_timeout_ms
        for key in [k for k, puts in self.pending.items()
                    if any(p.started_ms < deadline for p in puts.values())]:
            for writer_id in [w for w, p in self.pending[key].items() if p.started_ms < deadline]:
                self.end_pending(self.take_pending(key, writer_id), writes_done=False)

    # -- parts --------------------------------------------------------------------------------

    async def place(self, key: c.ObjectKey, size_bytes: int, replica_num: int,
                    preferred: tuple[str, ...], seed: int) -> list[tuple[OpenArena, int]]:
        """Hand out parts on up to `replica_num` distinct segments of the key's pool; [] when
        no segment has room. Each part is (arena, offset)."""
        state = self.state
        segments = state.pool_segments(state.pool_of(key[0]))
        order = candidate_order(segments, preferred, state.allocation_strategy, seed)
        parts = []
        for segment in order:
            if len(parts) == replica_num:
                break
            need = _round_up(size_bytes, segment.allocator.alignment_bytes)
            part = self._take(segment.segment_id, need)
            if part is None:
                part = await self._reserve(segment.segment_id, need)
            if part is not None and segment.segment_id in state.segments:
                parts.append(part)
        return parts

    def _take(self, segment_id: int, need: int):
        arena = self._open.get(segment_id)
        if arena is None:
            return None
        live = self.state.arenas.get(arena.arena_id)
        if live is None or live.closed_ms is not None:  # its segment went, or a new term
            del self._open[segment_id]
            return None
        if arena.cursor + need > arena.end:
            del self._open[segment_id]  # full: closed once its puts have ended
            self._retire(arena)
            return None
        offset = arena.cursor
        arena.cursor += need
        arena.in_flight += 1
        return arena, offset

    async def _reserve(self, segment_id: int, need: int):
        """A new arena on the segment (one at a time per segment; a put that waited for
        another's reservation takes a part of it), and a part of it; None if no room."""
        while True:
            reserving = self._reserving.get(segment_id)
            if reserving is None:
                break
            await asyncio.wait([reserving])
            part = self._take(segment_id, need)
            if part is not None:
                return part
        shared = need <= self.arena_bytes // 4  # larger values get an arena of their own
        size = self.arena_bytes if shared else need
        future = self._propose(c.ReserveArena(segment_id, size, self.term, self.hold_ms,
                                              self.now_ms()))
        self._reserving[segment_id] = future
        try:
            arena_id, offset = await future
        except MooncakedError as exc:
            if exc.code not in (ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.SEGMENT_NOT_FOUND):
                raise
            if shared and exc.code == ErrorCode.NO_AVAILABLE_HANDLE:
                # No arena's worth of room in one range: one just for this value may fit.
                self._reserving.pop(segment_id, None)
                return await self._reserve_exact(segment_id, need)
            return None
        finally:
            if self._reserving.get(segment_id) is future:
                del self._reserving[segment_id]
        return self._open_arena(segment_id, arena_id, offset, need, shared)

    async def _reserve_exact(self, segment_id: int, need: int):
        try:
            arena_id, offset = await self._propose(c.ReserveArena(
                segment_id, need, self.term, self.hold_ms, self.now_ms()))
        except MooncakedError as exc:
            if exc.code not in (ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.SEGMENT_NOT_FOUND):
                raise
            return None
        return self._open_arena(segment_id, arena_id, offset, need, False)

    def _open_arena(self, segment_id: int, arena_id: int, offset: int, need: int,
                    shared: bool):
        live = self.state.arenas.get(arena_id)
        if live is None:  # dropped with its segment meanwhile
            return None
        arena = OpenArena(arena_id, segment_id, offset, live.size_bytes)
        arena.cursor += need
        arena.in_flight = 1
        if shared:
            old = self._open.get(segment_id)
            if old is not None:
                self._retire(old)
            self._open[segment_id] = arena
        else:
            self._retire(arena)  # its one part is handed out
        return arena, offset

    def _retire(self, arena: OpenArena) -> None:
        if arena.in_flight:
            self._retiring[arena.arena_id] = arena
        else:
            self._close(arena)

    def _close(self, arena: OpenArena) -> None:
        """Close an arena none of whose puts is in progress; it needs the hold only if a
        write of a revoked put may still land in it."""
        hold_ms = self.hold_ms if arena.late_writes else 0
        future = self._propose(c.CloseArenas(self.term, (arena.arena_id,), hold_ms,
                                             self.now_ms()))
        future.add_done_callback(_log_failure)

    def close_older_terms(self) -> None:
        """Close the arenas of earlier leaders (the first arena command of this term does it
        anyway; this makes it happen when no put comes)."""
        if any(a.term < self.term and a.closed_ms is None for a in self.state.arenas.values()):
            self._propose(c.CloseArenas(self.term, (), self.hold_ms, self.now_ms())
                          ).add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.info("closing arenas: %s", future.exception())
