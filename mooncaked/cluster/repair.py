"""Replica repair: the leader restores `replica_num` after a node is lost.

When a node is declared down (NodeDown), its replicas leave the values' replica lists (kept
aside for its return, meta/state_machine.py DownNode), and values it held have fewer replicas
than their put asked for. Repair does not wait for a return: a returning node's replica is
put back only where the value still lacks one (AddReplicas and NodeReturn both stay within
replica_num, so neither counts twice). The leader queues every readable version
that lacks replicas the cluster could hold now (a node with a segment of the key's pool and no
replica of the value), and copies each one:

1. reserve ranges for the missing copies: a PutStart under RESERVED_NAMESPACE, in the pool of
   the key's namespace, preferring one segment on each node that holds no replica;
2. read the value from a surviving replica and write it into the reserved ranges;
3. propose AddReplicas, which moves the reserved ranges into the version's replicas only if
   the version is still the one copied. If an upsert, remove or eviction came first, nothing
   changes and the reservation is revoked: repair never undoes a newer write.

A reservation left behind by a leader that failed mid-copy is freed by the expiry sweep
(`put_start_release_timeout_ms`), as any unfinished put. Copies are bounded by
`[cluster] repair_bytes_per_s` (bytes written per second; 0 = no repair) and
`repair_concurrency` (values copied at once). A value whose copy failed is tried again after
`node_ttl_ms`, or at once when the membership changes.
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked import environment
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import Segment, StateMachine, Version
from mooncaked.raft.types import Role

log = logging.getLogger(__name__)

# What AddReplicas answers when the version changed under the copy: the copy is not needed.
_SUPERSEDED = frozenset({ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_WRITE,
                         ErrorCode.INVALID_PARAMS})


def repair_targets(state: StateMachine, key: c.ObjectKey,
                   version: Version) -> tuple[int, list[Segment]]:
    """How many replicas the version lacks that the cluster can hold now, and where they
    should go: for each node with no replica of it, that node's emptiest segment of the key's
    pool (emptiest first)."""
    holders = {c.node_of_segment(r.segment_id) for r in version.replicas}
    best: dict[int, Segment] = {}
    for segment in state.pool_segments(state.pool_of(key[0])):
        node = c.node_of_segment(segment.segment_id)
        if not segment.mounted or node in holders:
            continue
        if node not in best or segment.free_ratio() > best[node].free_ratio():
            best[node] = segment
    targets = sorted(best.values(), key=lambda s: (-s.free_ratio(), s.segment_id))
    missing = min(version.replica_num - len(version.replicas), len(targets))
    return max(0, missing), targets


def under_replicated(state: StateMachine) -> list[c.ObjectKey]:
    """Keys whose readable version lacks replicas the cluster can hold now, in table order."""
    found = []
    for key, entry in state.objects.items():
        version = entry.complete
        if key[0] == c.RESERVED_NAMESPACE or version is None \
                or len(version.replicas) >= version.replica_num:
            continue
        if repair_targets(state, key, version)[0] > 0:
            found.append(key)
    return found


class ReplicaRepair:
    """The leader's repair queue and its copying task (one per term in which it leads)."""

    def __init__(self, service) -> None:
        self.service = service
        cc = service.cluster_config
        self.bytes_per_s = cc.repair_bytes_per_s
        self.concurrency = cc.repair_concurrency
        self.retry_s = cc.node_ttl_ms / 1000
        self.queue: dict[c.ObjectKey, None] = {}  # ordered set: keys to copy, oldest first
        self.in_progress = 0
        self._rescan_at: float | None = None  # monotonic time of the next scan of the table
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._term = -1
        self._next_send = 0.0  # the bandwidth bound: when the next copy may start
        self.stats = {"objects_repaired": 0, "replicas_added": 0, "bytes_copied": 0,
                      "superseded": 0, "failures": 0}
        self.last_failure = ""

    # -- control ------------------------------------------------------------------------------

    def start(self, term: int) -> None:
        """This node leads in `term`: scan the table and copy what lacks replicas."""
        if self.bytes_per_s <= 0 or (self._task is not None and not self._task.done()
                                     and self._term == term):
            return
        self._term = term
        self._wake = asyncio.Event()
        self._rescan_at = environment.monotonic()
        self._task = self.service._spawn(self._run(term))

    def state_changed(self) -> None:
        """The membership or the segments changed: scan again (on the leader)."""
        self._rescan_at = environment.monotonic()
        if self._wake is not None:
            self._wake.set()

    def stop(self) -> None:
        """No longer the leader: the task ends at its next step; the queue is the next
        leader's to rebuild."""
        self.queue.clear()
        if self._wake is not None:
            self._wake.set()

    def status(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "concurrency": self.concurrency,
                "queued": len(self.queue), "in_progress": self.in_progress, **self.stats,
                "last_failure": self.last_failure}

    # -- the copying task ---------------------------------------------------------------------

    def _leading(self, term: int) -> bool:
        raft = self.service.raft
        return raft.role == Role.LEADER and raft.core.term == term and self._term == term

    async def _run(self, term: int) -> None:
        try:
            # Act on the whole log: everything earlier leaders committed is applied first.
            await self.service.raft.read_barrier()
        except MooncakedError:
            return
        while self._leading(term):
            now = environment.monotonic()
            if self._rescan_at is not None and now >= self._rescan_at:
                self._rescan_at = None
                for key in under_replicated(self.service.daemon.master.state):
                    self.queue[key] = None
            if not self.queue:
                self._wake.clear()
                timeout = None if self._rescan_at is None else max(0.0, self._rescan_at - now)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            batch = []
            while self.queue and len(batch) < self.concurrency:
                key = next(iter(self.queue))
                del self.queue[key]
                batch.append(key)
            self.in_progress = len(batch)
            results = await asyncio.gather(*(self._repair(term, key) for key in batch),
                                           return_exceptions=True)
            self.in_progress = 0
            for key, result in zip(batch, results):
                if isinstance(result, BaseException):
                    if isinstance(result, asyncio.CancelledError):
                        raise result
                    self.stats["failures"] += 1
                    if isinstance(result, MooncakedError):
                        message = result.message
                        log.info("repair of %r failed: %s; trying again later", key, message)
                    else:
                        message = repr(result)
                        log.error("repair of %r failed", key, exc_info=result)
                    self.last_failure = f"{key[0]}/{key[1]}: {message}"[:300]
                    if self._rescan_at is None:
                        self._rescan_at = environment.monotonic() + self.retry_s
        if self._term == term:
            self.queue.clear()

    async def _throttle(self, size: int) -> None:
        """Wait until `size` more bytes keep the copies under repair_bytes_per_s."""
        now = environment.monotonic()
        start = max(now, self._next_send)
        self._next_send = start + size / self.bytes_per_s
        if start > now:
            await asyncio.sleep(start - now)

    async def _repair(self, term: int, key: c.ObjectKey) -> None:
        service = self.service
        state = service.daemon.master.state
        entry = state.objects.get(key)
        version = entry.complete if entry is not None else None
        if version is None:
            return
        missing, targets = repair_targets(state, key, version)
        if missing <= 0:
            return
        await self._throttle(version.size_bytes * missing)
        if not self._leading(term) or state.objects.get(key) is not entry \
                or entry.complete is not version:
            return  # the value changed while waiting: the next scan sees the new one
        missing, targets = repair_targets(state, key, version)
        if missing <= 0:
            return
        payload = await service.read_replica_bytes(list(version.replicas), version.size_bytes)
        service.put_attempts += 1
        writer_id = (service.node_id << 40) | (service.put_attempts & ((1 << 40) - 1))
        reserved_key = (c.RESERVED_NAMESPACE, f"{key[0]}#repair/{writer_id}")
        master = service.master
        copies = await service.raft.propose(c.PutStart(
            reserved_key, version.size_bytes, missing, tuple(s.name for s in targets), None,
            False, False, writer_id, master.now_ms(), master._rng.getrandbits(32), key[0]))
        holders = {c.node_of_segment(r.segment_id) for r in version.replicas}
        nodes = [c.node_of_segment(r.segment_id) for r in copies]
        if len(set(nodes)) != len(nodes) or holders & set(nodes):
            # Placement fell back to a node that already holds the value: no protection.
            await service.raft.propose(c.PutRevoke(reserved_key, writer_id))
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 "no room on the nodes without a replica")
        try:
            await service.write_replicas(copies, payload)
        except MooncakedError:
            # A write that timed out may still land: hold the ranges, as a revoked put does.
            await service.raft.propose(c.PutRevoke(
                reserved_key, writer_id,
                master.now_ms() + 2 * service.cluster_config.rpc_timeout_ms))
            raise
        try:
            added = await service.raft.propose(c.AddReplicas(
                key, version.writer_id, version.started_ms, reserved_key, writer_id))
        except MooncakedError as exc:
            if exc.code not in _SUPERSEDED:
                raise
            self.stats["superseded"] += 1
            await service.raft.propose(c.PutRevoke(reserved_key, writer_id))
            return
        self.stats["objects_repaired"] += 1
        self.stats["replicas_added"] += added
        self.stats["bytes_copied"] += version.size_bytes * added
