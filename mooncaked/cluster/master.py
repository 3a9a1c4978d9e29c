"""The leader's master: store semantics over the Raft log (the single-node Master's rules).

It builds on `MasterPolicy` (reads, leases, eviction choices) and not on the single node's
`Master`: it has no method that applies a command to the local state. Mutations become log
commands and resolve when applied, on every node alike; a follower's master only reads. What stays local to the leader, as in
the single-node master: read leases and the access order used for eviction. Because a new leader
does not know the leases its predecessor granted, it treats every object as leased for one full
lease TTL after it takes over (`lease_floor_ms`): nothing is removed, evicted or freed for a
lease reason before that (ARCHITECTURE.md invariant 3).

Time: commands carry the cluster clock, which continues from the latest time in the log
(`StateMachine.clock_ms`) when a node becomes leader and then runs at this node's monotonic
rate. Nodes' monotonic clocks have unrelated origins; continuing from the log means a new
leader's clock never jumps ahead of the one that granted the leases, so deadlines in the log
(deferred frees, put timeouts) only ever come late, never early.

A put is one command (ArenaPut), proposed when it ends: its ranges are parts of this leader's
arenas (cluster/arenas.py says why no range is ever written by two writers), handed out while
the leader is sure of its leadership; its key and the limits are checked when it starts,
counting the puts in progress here, and again by the state machine when it commits. A put
refused at the start (its key exists, a quota) is answered only once a command proposed after
it commits, as a write's answer.

A read of a key waits while a command that may end its readable version (PutEnd of an upsert,
Remove, Evict) is in the log: the command's free deadline was computed from the leases known
when it was proposed, so no lease may be granted on that version meanwhile.
"""

from __future__ import annotations

import asyncio
import re

from mooncaked import environment
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.cluster.arenas import LeaderArenas, PendingPut
from mooncaked.meta import commands as c
from mooncaked.meta.master import MasterPolicy, ReplicateConfig
from mooncaked.meta.state_machine import Replica, StateMachine, Version
from mooncaked.raft.types import Role


def monotonic_ms() -> int:
    return environment.monotonic_ns() // 1_000_000


class ReplicatedMaster(MasterPolicy):
    def __init__(self, state: StateMachine, store_config: StoreConfig, raft, seed: int, *,
                 arena_bytes: int = 4 << 20, late_write_ms: int = 10_000) -> None:
        """raft: the RaftNode that carries the commands (None until the cluster service has
        opened the log, `attach`). arena_bytes: the size of the arenas puts take parts of;
        late_write_ms: how late a replica write that timed out may still land (an arena that
        may receive one is held this long after it closes)."""
        super().__init__(state, store_config, seed)
        self.raft = raft
        self.clock_offset_ms = 0
        self.lease_floor_ms = 0
        self._ending: dict[c.ObjectKey, asyncio.Future] = {}  # keys whose version may end
        self.arenas = LeaderArenas(state, lambda command: self.raft.propose(command),
                                   self.now_ms, arena_bytes, late_write_ms)

    def attach(self, raft) -> None:
        self.raft = raft

    # -- leadership ---------------------------------------------------------------------------

    def now_ms(self) -> int:
        return monotonic_ms() + self.clock_offset_ms

    def become_leader(self) -> None:
        self.arenas.reset(self.raft.core.term)
        self.clock_offset_ms = self.state.clock_ms - monotonic_ms()
        now = self.now_ms()
        self.lease_floor_ms = now + self.lease_ttl_ms
        # Every readable object becomes an eviction candidate again, oldest first, and counts
        # as leased until the floor passes.
        self.access = {key: self.lease_floor_ms for key, entry in self.state.objects.items()
                       if entry.complete is not None}

    def puts_in_progress(self) -> int:
        """Those in the log (reservations) and, on the leader, those not yet in it."""
        in_log = super().puts_in_progress()
        if self.raft is None or self.raft.role != Role.LEADER:
            return in_log
        return in_log + sum(len(puts) for puts in self.arenas.pending.values())

    def leased(self, key: c.ObjectKey, now_ms: int) -> bool:
        return now_ms < self.lease_floor_ms or super().leased(key, now_ms)

    def lease_end_ms(self, key: c.ObjectKey) -> int:
        return max(self.lease_floor_ms, super().lease_end_ms(key))

    # -- proposals ----------------------------------------------------------------------------

    async def _propose(self, command, ending: c.ObjectKey | None = None):
        future = self.raft.propose(command)
        if ending is not None:
            self._ending[ending] = future
            future.add_done_callback(lambda f, key=ending: self._ending.get(key) is f
                                     and self._ending.pop(key, None))
        return await future

    async def _settled(self, key: c.ObjectKey) -> None:
        while True:
            pending = self._ending.get(key)
            if pending is None:
                return
            await asyncio.wait([pending])

    # -- reads --------------------------------------------------------------------------------

    async def read(self, keys: list[c.ObjectKey]) -> list[Version | None]:
        """Linearizable reads of some keys, each readable version leased for one TTL."""
        for key in keys:
            await self._settled(key)
        await self.raft.read_barrier()
        # A command that may end a key's version can have been proposed while the barrier
        # was out: its free deadline did not count the lease this read would grant. Read
        # after it instead (it is committed by then, so reading later stays linearizable).
        while True:
            pending = next((key for key in keys if key in self._ending), None)
            if pending is None:
                break
            await self._settled(pending)
        now = self.now_ms()
        return [self.get(key, now) for key in keys]

    # -- writes -------------------------------------------------------------------------------

    async def put_start_async(self, key: c.ObjectKey, size_bytes: int, config: ReplicateConfig,
                              upsert: bool, writer_id: int) -> list[Replica]:
        """Hand out the put's ranges: parts of this leader's arenas (cluster/arenas.py), with
        no log command unless an arena must be reserved. The put is this leader's alone until
        put_end commits it (one ArenaPut); limits are checked here counting the puts in
        progress, and again when it commits."""
        if size_bytes <= 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a value must have at least 1 byte")
        self.check_replicate_config(config)
        if key[0] == c.RESERVED_NAMESPACE:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "not a key a client can write")
        # Parts are handed out by a leader sure of its leadership (its check-quorum lease, or
        # a heartbeat round): a leader cut off from the others, which may have been replaced
        # already, hands out none. With it, every part of an arena was handed out before a
        # later term closed the arena, which is what the arena's hold counts from.
        if not self.raft.leads_now():
            await self.raft.read_barrier()
        try:
            put = self._new_put(key, size_bytes, config, upsert, writer_id)
        except MooncakedError as exc:
            if exc.code not in (ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.QUOTA_EXCEEDED):
                raise
            # A refusal is a put's answer, given as a write's is: once a command proposed
            # after it commits (so never by a leader cut off from the others, even within
            # its lease), with every command before it applied, after any command in the log
            # that may end the key's version. Refusals proposed together share one entry.
            await self._settled(key)
            await self._propose(c.ReleaseExpired(self.now_ms()))
            put = self._new_put(key, size_bytes, config, upsert, writer_id)
        state, arenas = self.state, self.arenas
        if put.new_object and len(state.objects) + arenas.pending_new >= state.max_objects:
            await self._make_room(self.now_ms(), 0, 1)
            if len(state.objects) + arenas.pending_new >= state.max_objects:
                raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                     f"the object table is full ({state.max_objects} objects)")
        previous = arenas.take_pending(key, writer_id)
        if previous is not None:  # its writer starts anew
            arenas.end_pending(previous, writes_done=False)
        arenas.add_pending(key, put)  # before any await: a second put of the key sees it
        try:
            parts = await arenas.place(key, size_bytes, config.replica_num,
                                       config.preferred_segments, self._rng.getrandbits(32))
            if not parts:
                await self._make_room(self.now_ms(), size_bytes * config.replica_num, 0)
                parts = await arenas.place(key, size_bytes, config.replica_num,
                                           config.preferred_segments, self._rng.getrandbits(32))
        except BaseException:
            if arenas.take_pending(key, writer_id) is put:
                arenas.end_pending(put, writes_done=True)
            raise
        put.parts = parts
        if arenas.pending.get(key, {}).get(writer_id) is not put:
            arenas.end_pending(put, writes_done=False)  # dropped meanwhile (new leadership)
            raise MooncakedError(ErrorCode.NO_LEADER, "leadership changed during the put")
        if not parts:
            arenas.take_pending(key, writer_id)
            arenas.end_pending(put, writes_done=True)
            where = f"the pool of namespace {key[0]!r}" if state.pool_of(key[0]) \
                else "the shared pool"
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"no segment of {where} has {size_bytes} free bytes")
        return [Replica(arena.segment_id, offset, -arena.arena_id) for arena, offset in parts]

    def _new_put(self, key: c.ObjectKey, size_bytes: int, config: ReplicateConfig,
                 upsert: bool, writer_id: int) -> PendingPut:
        """The put to start, or why not (the key exists or is being written, a quota)."""
        state, arenas = self.state, self.arenas
        now = self.now_ms()
        entry = state.objects.get(key)
        mine = arenas.pending.get(key, {})
        if not upsert:
            if entry is not None and entry.complete is not None:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS, "the key exists")
            if any(now - started < state.discard_timeout_ms for started in
                   [p.started_ms for p in mine.values()]
                   + ([entry.pending.started_ms] if entry is not None and entry.pending else [])):
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS, "the key is being written")
        # Upserts of a key in start order, one ms apart at least (the last to start wins),
        # and after the version they replace.
        started = max([now] + [p.started_ms + 1 for p in mine.values()])
        if entry is not None and entry.complete is not None:
            started = max(started, entry.complete.started_ms + 1)
        new_object = entry is None and not mine
        segments = len(state.pool_segments(state.pool_of(key[0])))
        charged = size_bytes * min(config.replica_num, segments)
        put = PendingPut(writer_id, size_bytes, config.replica_num, config.soft_pin_ttl_ms,
                         config.hard_pin, upsert, started, charged, new_object,
                         c.charged_namespace(key))
        self._check_limits(put)
        return put

    def _check_limits(self, put: PendingPut) -> None:
        """The namespace's quota, counting its puts in progress here."""
        state = self.state
        max_bytes, max_objects = state.quota_of(put.namespace)
        usage = state.usage.get(put.namespace)
        used_bytes = (usage.bytes if usage else 0) + self.arenas.pending_bytes.get(
            put.namespace, 0)
        used_objects = (usage.objects if usage else 0) + self.arenas.pending_objects.get(
            put.namespace, 0)
        if max_bytes and used_bytes + put.charged_bytes > max_bytes:
            raise MooncakedError(ErrorCode.QUOTA_EXCEEDED,
                                 f"namespace {put.namespace!r} holds {used_bytes} bytes (puts "
                                 f"in progress included); {put.charged_bytes} more would pass "
                                 f"its quota of {max_bytes} bytes")
        if max_objects and put.new_object and used_objects + 1 > max_objects:
            raise MooncakedError(ErrorCode.QUOTA_EXCEEDED,
                                 f"namespace {put.namespace!r} holds {used_objects} objects "
                                 f"(puts in progress included), its quota is {max_objects} "
                                 "objects")

    async def _make_room(self, now_ms: int, need_bytes: int, need_objects: int) -> None:
        """Evict for a put, then free what that released (an emptied arena, once closed and
        held, returns to its segment's allocator only through ReleaseExpired). The
        ReleaseExpired is proposed even when nothing is due: applied, it also means that every
        command proposed before it is (a segment mount in flight, say)."""
        await self.evict_async(now_ms, need_bytes=need_bytes, need_objects=need_objects)
        await self._propose(c.ReleaseExpired(self.now_ms()))

    async def put_end_async(self, key: c.ObjectKey, writer_id: int) -> None:
        """Commit a put whose writes have finished: one ArenaPut."""
        put = self.arenas.take_pending(key, writer_id)
        if put is None or put.parts is None:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "no write in progress for this key on this leader (it started "
                                 "under an earlier leader or longer than "
                                 "put_start_release_timeout_ms ago): put it again")
        try:
            now = self.now_ms()
            await self._propose(c.ArenaPut(
                key, put.size_bytes, put.replica_num,
                tuple((arena.arena_id, offset) for arena, offset in put.parts),
                put.soft_pin_ttl_ms, put.hard_pin, put.upsert, writer_id, put.started_ms, now,
                max(now, self.lease_end_ms(key)), self.arenas.term), ending=key)
        finally:
            self.arenas.end_pending(put, writes_done=True)
        self.access.pop(key, None)
        self.access[key] = now

    async def put_revoke_async(self, key: c.ObjectKey, writer_id: int,
                               hold_ms: int = 0) -> None:
        """hold_ms: keep the ranges this long (a replica write may still be in flight).
        A put of this leader's is dropped here, without the log; a reservation (a PutStart
        under RESERVED_NAMESPACE) is revoked through it."""
        put = self.arenas.take_pending(key, writer_id)
        if put is not None:
            self.arenas.end_pending(put, writes_done=not hold_ms)
            return
        if key[0] != c.RESERVED_NAMESPACE:
            return  # started under an earlier leader, or expired: nothing of it is here
        release_at = self.now_ms() + hold_ms if hold_ms else 0
        await self._propose(c.PutRevoke(key, writer_id, release_at))

    async def remove_async(self, key: c.ObjectKey, force: bool) -> None:
        now = self.now_ms()
        entry = self.state.objects.get(key)
        if entry is not None and entry.complete is not None and not force \
                and self.leased(key, now):
            raise MooncakedError(ErrorCode.OBJECT_HAS_LEASE, "the object has a read lease")
        await self._propose(c.Remove(key, max(now, self.lease_end_ms(key))), ending=key)
        self.access.pop(key, None)

    async def remove_matching_async(self, namespace: str | None, pattern: re.Pattern | None,
                                    force: bool) -> int:
        now = self.now_ms()
        selected = [key for key, entry in self.state.objects.items()
                    if entry.complete is not None
                    and (namespace is None or key[0] == namespace)
                    and (pattern is None or pattern.search(key[1]))
                    and (force or not self.leased(key, now))]
        removed = 0
        for key in selected:
            try:
                await self._propose(c.Remove(key, max(now, self.lease_end_ms(key))), ending=key)
                removed += 1
            except MooncakedError as exc:
                if exc.code != ErrorCode.OBJECT_NOT_FOUND:
                    raise
            self.access.pop(key, None)
        return removed

    async def move_start_async(self, key: c.ObjectKey, size_bytes: int,
                               segments: tuple[str, ...], writer_id: int) -> tuple:
        """Reserve one range for a copy of `key`'s value, in its namespace's pool, preferring
        `segments`; returns (the reservation's key, its replicas). No eviction makes room."""
        reserved_key = (c.RESERVED_NAMESPACE, f"{key[0]}#move/{writer_id}")
        command = c.PutStart(reserved_key, size_bytes, 1, segments, None, False, False,
                             writer_id, self.now_ms(), self._rng.getrandbits(32), key[0])
        return reserved_key, await self._propose(command)

    async def move_commit_async(self, reserved_key: c.ObjectKey, key: c.ObjectKey,
                                writer_id: int, version: Version) -> bool:
        """Make the copy `key`'s replicas if its readable version is still `version`
        (c.MoveCommit); False when the key was written or removed since."""
        now = self.now_ms()
        return await self._propose(
            c.MoveCommit(reserved_key, key, writer_id, version.writer_id, version.started_ms,
                         now, max(now, self.lease_end_ms(key))), ending=key)

    # -- eviction and expiry ------------------------------------------------------------------

    async def sweep(self) -> None:
        """The leader's periodic sweep: deadlines, then eviction above the high watermark."""
        now = self.now_ms()
        self.arenas.expire()
        self.arenas.close_older_terms()
        if self.state.expiry_due(now):
            await self._propose(c.ReleaseExpired(now))
        await self.evict_async(now)

    async def evict_async(self, now_ms: int, need_bytes: int = 0, need_objects: int = 0) -> int:
        if now_ms < self.lease_floor_ms:
            return 0  # every object counts as leased until a full TTL after the election
        chosen = self.choose_evictions(now_ms, need_bytes, need_objects)
        if not chosen:
            return 0
        future = self.raft.propose(c.Evict(tuple(chosen)))
        for key in chosen:
            self._ending[key] = future
            self.access.pop(key, None)
        try:
            freed_bytes = await future
        finally:
            for key in chosen:
                if self._ending.get(key) is future:
                    del self._ending[key]
        self.evictions.runs += 1
        self.evictions.objects += len(chosen)
        self.evictions.bytes += freed_bytes
        return len(chosen)
