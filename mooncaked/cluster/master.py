"""The leader's master: store semantics over the Raft log (the single-node Master's rules).

Mutations become log commands and resolve when applied. What stays local to the leader, as in
the single-node master: read leases and the access order used for eviction. Because a new leader
does not know the leases its predecessor granted, it treats every object as leased for one full
lease TTL after it takes over (`lease_floor_ms`): nothing is removed, evicted or freed for a
lease reason before that (ARCHITECTURE.md invariant 3).

Time: commands carry the cluster clock, which continues from the latest time in the log
(`StateMachine.clock_ms`) when a node becomes leader and then runs at this node's monotonic
rate. Nodes' monotonic clocks have unrelated origins; continuing from the log means a new
leader's clock never jumps ahead of the one that granted the leases, so deadlines in the log
(deferred frees, put timeouts) only ever come late, never early.

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
from mooncaked.meta import commands as c
from mooncaked.meta.master import Master, ReplicateConfig
from mooncaked.meta.state_machine import Replica, StateMachine, Version


def monotonic_ms() -> int:
    return environment.monotonic_ns() // 1_000_000


class ReplicatedMaster(Master):
    def __init__(self, state: StateMachine, store_config: StoreConfig, raft, seed: int) -> None:
        super().__init__(state, store_config, seed)
        self.raft = raft
        self.clock_offset_ms = 0
        self.lease_floor_ms = 0
        self._ending: dict[c.ObjectKey, asyncio.Future] = {}  # keys whose version may end

    # -- leadership ---------------------------------------------------------------------------

    def now_ms(self) -> int:
        return monotonic_ms() + self.clock_offset_ms

    def become_leader(self) -> None:
        self.clock_offset_ms = self.state.clock_ms - monotonic_ms()
        now = self.now_ms()
        self.lease_floor_ms = now + self.lease_ttl_ms
        # Every readable object becomes an eviction candidate again, oldest first, and counts
        # as leased until the floor passes.
        self.access = {key: self.lease_floor_ms for key, entry in self.state.objects.items()
                       if entry.complete is not None}

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
        return [Master.get(self, key, now) for key in keys]

    # -- writes -------------------------------------------------------------------------------

    async def put_start_async(self, key: c.ObjectKey, size_bytes: int, config: ReplicateConfig,
                              upsert: bool, writer_id: int) -> list[Replica]:
        if size_bytes <= 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a value must have at least 1 byte")
        self.check_replicate_config(config)
        command = c.PutStart(key, size_bytes, config.replica_num, config.preferred_segments,
                             config.soft_pin_ttl_ms, config.hard_pin, upsert, writer_id,
                             self.now_ms(), self._rng.getrandbits(32))
        try:
            return await self._propose(command)
        except MooncakedError as exc:
            if exc.code != ErrorCode.NO_AVAILABLE_HANDLE:
                raise
        await self.evict_async(self.now_ms(), need_bytes=size_bytes * config.replica_num,
                               need_objects=1)
        return await self._propose(command)

    async def put_end_async(self, key: c.ObjectKey, writer_id: int) -> None:
        now = self.now_ms()
        await self._propose(c.PutEnd(key, writer_id, now, max(now, self.lease_end_ms(key))),
                            ending=key)
        self.access.pop(key, None)
        self.access[key] = now

    async def put_revoke_async(self, key: c.ObjectKey, writer_id: int,
                               hold_ms: int = 0) -> None:
        """hold_ms: keep the ranges this long (a replica write may still be in flight)."""
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
