"""The metadata state machine: segments, objects, replicas, pins, and what waits to be freed.

Pure and deterministic: no I/O, no clock, no randomness of its own; time and seeds come in the
commands (meta/commands.py). Failures raise MooncakedError, which is the command's result.
Read leases are not here: they are the master's, local to it (meta/leases.py).

Invariants it keeps (checked by `check_invariants`, used by the tests):
- no two live ranges overlap in a segment (the allocator's guarantee, never bypassed);
- a pending (being written) version is never what readers see;
- every range is owned by exactly one of: a complete version, a pending version, the deferred
  release list; freeing happens only through `_release`;
- a preempted upsert (`PreemptedWrite`) owns nothing: its ranges wait in the deferred list,
  and its record lives exactly as long as they may (until their release deadline);
- the segments of a node declared down that the log keeps for its return (`down_nodes`) are
  in neither `segments` nor `segment_list`, and nothing else names them: every live range of
  theirs is owned by exactly one of the record's parked replicas and held ranges;
- `usage` is, per namespace, the sum over its objects' complete and pending versions of size x
  replicas (reservations count against the namespace of the connection holding them) and the
  number of its objects; quotas (`SetQuota`) bound what a put may add to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
from typing import Callable

import msgpack

from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.placement import place


class Segment:
    __slots__ = ("segment_id", "name", "node_name", "size_bytes", "allocator", "mounted",
                 "pool_namespace")

    def __init__(self, segment_id: int, name: str, node_name: str, size_bytes: int,
                 allocator, pool_namespace: str = c.SHARED_POOL) -> None:
        self.segment_id = segment_id
        self.name = name
        self.node_name = node_name
        self.size_bytes = size_bytes
        self.allocator = allocator
        self.mounted = True
        self.pool_namespace = pool_namespace  # c.SHARED_POOL or the namespace it belongs to

    def allocate(self, size_bytes: int):
        return self.allocator.allocate(size_bytes)

    def free_ratio(self) -> float:
        return self.allocator.free_bytes / self.allocator.capacity_bytes


class Node:
    __slots__ = ("node_id", "name", "client_address", "peer_address", "up")

    def __init__(self, node_id: int, name: str, client_address: str, peer_address: str) -> None:
        self.node_id = node_id
        self.name = name
        self.client_address = client_address
        self.peer_address = peer_address
        self.up = True


class Replica:
    __slots__ = ("segment_id", "offset", "handle")

    def __init__(self, segment_id: int, offset: int, handle: int) -> None:
        self.segment_id = segment_id
        self.offset = offset
        self.handle = handle


class Arena:
    """A range of a segment that one leader hands out in parts, each to one put (see
    meta/commands.py ReserveArena). A replica in a part has handle -arena_id (the allocator's
    handles are >= 0) and is freed by dropping its count in `live`, not by the allocator."""
    __slots__ = ("arena_id", "segment_id", "handle", "offset", "size_bytes", "term", "hold_ms",
                 "closed_ms", "live")

    def __init__(self, arena_id: int, segment_id: int, handle: int, offset: int,
                 size_bytes: int, term: int, hold_ms: int) -> None:
        self.arena_id = arena_id
        self.segment_id = segment_id
        self.handle = handle  # of the whole arena, in the segment's allocator
        self.offset = offset
        self.size_bytes = size_bytes
        self.term = term
        self.hold_ms = hold_ms
        self.closed_ms: int | None = None  # None: its leader may still hand out parts
        self.live = 0  # replicas (complete, pending or deferred) in parts of it

    def release_at_ms(self) -> int | None:
        """When it returns to the allocator: closed, unused, and held long enough."""
        if self.closed_ms is None or self.live:
            return None
        return self.closed_ms + self.hold_ms


class DiskReplica:
    """A copy of a version's bytes in one node's disk tier (mooncaked/ssd): where the record
    is (region, offset), its size and the version it was written under."""
    __slots__ = ("node_id", "region", "offset", "size_bytes", "disk_version")

    def __init__(self, node_id: int, region: int, offset: int, size_bytes: int,
                 disk_version: int) -> None:
        self.node_id = node_id
        self.region = region
        self.offset = offset
        self.size_bytes = size_bytes
        self.disk_version = disk_version


class Version:
    """One value of an object: its size, the replicas holding its bytes, and how many replicas
    its put asked for (what repair restores after a node is lost). A readable version may
    have a disk copy (`disk`) as well; it stays readable while it has a DRAM replica or that
    copy (a disk-only version has no replicas). A pending version never has one."""
    __slots__ = ("size_bytes", "replicas", "writer_id", "started_ms", "replica_num", "disk")

    def __init__(self, size_bytes: int, replicas: list[Replica], writer_id: int,
                 started_ms: int, replica_num: int, disk: DiskReplica | None = None) -> None:
        self.size_bytes = size_bytes
        self.replicas = replicas
        self.writer_id = writer_id
        self.started_ms = started_ms
        self.replica_num = replica_num
        self.disk = disk


class ParkedReplica:
    """A replica a node declared down held of a readable version, named by that version."""
    __slots__ = ("key", "writer_id", "started_ms", "size_bytes", "replica")

    def __init__(self, key: c.ObjectKey, writer_id: int, started_ms: int, size_bytes: int,
                 replica: Replica) -> None:
        self.key = key
        self.writer_id = writer_id
        self.started_ms = started_ms
        self.size_bytes = size_bytes
        self.replica = replica


class DownNode:
    """What a node declared down held, kept for its return (NodeDown keep_until_ms).

    Reconciliation: the node may have been cut off, not lost, and come back with its memory.
    Its segments leave placement and reads at once (as if unmounted), but their allocators are
    kept with every range still allocated, so nothing is placed in memory that still holds its
    values. `parked`: its replicas of readable versions, which a NodeReturn puts back where the
    version is still the readable one and lacks replicas; `held`: ranges of unfinished writes
    and of deferred releases, (release_at_ms, replica), freed no earlier than their deadline.
    A NodeUp of the node (a restart: new memory), a NodeDown without keep, or ReleaseDownNode
    drops it all, as a plain NodeDown always did.
    """
    __slots__ = ("node_id", "generation", "keep_until_ms", "segments", "parked", "held",
                 "arenas")

    def __init__(self, node_id: int, generation: int, keep_until_ms: int) -> None:
        self.node_id = node_id
        self.generation = generation  # of its segments when it went down
        self.keep_until_ms = keep_until_ms
        self.segments: list[Segment] = []  # in the order they had in segment_list
        self.parked: list[ParkedReplica] = []
        self.held: list[tuple[int, Replica]] = []
        # Arenas on its segments: their parts are among `parked` and `held` (their `live`
        # counts them); they come back closed with the segments.
        self.arenas: list[Arena] = []


class ObjectEntry:
    __slots__ = ("complete", "pending", "pending_upsert", "hard_pin", "soft_pin_ttl_ms",
                 "soft_pin_deadline_ms", "created_ms")

    def __init__(self, hard_pin: bool, created_ms: int) -> None:
        self.complete: Version | None = None  # what readers see
        self.pending: Version | None = None  # a put or upsert being written
        self.pending_upsert = False  # whether `pending` is an upsert's
        self.hard_pin = hard_pin
        self.soft_pin_ttl_ms: int | None = None  # asked by the pending write
        self.soft_pin_deadline_ms: int | None = None
        self.created_ms = created_ms

    def soft_pinned(self, now_ms: int) -> bool:
        return self.soft_pin_deadline_ms is not None and now_ms < self.soft_pin_deadline_ms


class PreemptedWrite:
    """An unfinished upsert that a later upsert of its key preempted (`_put_start`).

    Last writer wins and both upserts succeed: when its writer ends it, it takes effect then
    (its ranges are taken back from the deferred list), unless a later-started upsert of the
    key has completed meanwhile (`superseded`): then it succeeds without change, as if done
    just before that one. Records of a key are kept in start order. Kept until its ranges' release deadline; forgotten earlier when the key
    is removed or its writer revokes it or starts again.
    """
    __slots__ = ("size_bytes", "started_ms", "soft_pin_ttl_ms", "hard_pin", "deferred_seq",
                 "release_at_ms", "replica_num", "superseded")

    def __init__(self, size_bytes: int, started_ms: int, soft_pin_ttl_ms: int | None,
                 hard_pin: bool, deferred_seq: int, release_at_ms: int, replica_num: int,
                 superseded: bool = False) -> None:
        self.replica_num = replica_num  # what its put asked for (repair restores it)
        self.size_bytes = size_bytes
        self.started_ms = started_ms
        self.soft_pin_ttl_ms = soft_pin_ttl_ms
        self.hard_pin = hard_pin
        self.deferred_seq = deferred_seq  # its ranges' entry in the deferred list
        self.release_at_ms = release_at_ms
        self.superseded = superseded


class NamespaceUsage:
    """What a namespace holds: value bytes x replicas of its complete and pending versions
    (reservations included), and objects (keys with a version; reservations are none)."""
    __slots__ = ("bytes", "objects")

    def __init__(self) -> None:
        self.bytes = 0
        self.objects = 0


UNLIMITED = (0, 0)


def _version_bytes(version: Version | None) -> int:
    return 0 if version is None else version.size_bytes * len(version.replicas)


AllocatorFactory = Callable[[int, int, int], object]  # (size, alignment, max_allocations)

_STORE_KEYS = {f.name: f.metadata for f in dataclasses.fields(StoreConfig)}


def store_settings_problem(settings: c.SetStoreSettings) -> str | None:
    """What is wrong with store settings (bounds and choices of their `[store]` keys), or None."""
    for field in dataclasses.fields(settings):
        value, meta = getattr(settings, field.name), _STORE_KEYS[field.name]
        if meta["choices"] is not None:
            if value not in meta["choices"]:
                return f"{field.name} must be one of {', '.join(meta['choices'])}"
        elif type(value) is not int or not meta["min"] <= value <= meta["max"]:
            return f"{field.name} must be an int in {meta['min']}..{meta['max']}"
    if settings.put_start_discard_timeout_ms > settings.put_start_release_timeout_ms:
        return "put_start_discard_timeout_ms must not exceed put_start_release_timeout_ms"
    return None


class StateMachine:
    def __init__(self, allocator_factory: AllocatorFactory, *, max_objects: int,
                 put_start_discard_timeout_ms: int, put_start_release_timeout_ms: int,
                 allocation_strategy: str = "random") -> None:
        self._allocator_factory = allocator_factory
        # The settings it decides by: these until a SetStoreSettings command sets them (a
        # cluster builds every node's with the same built-in defaults, and its log sets them).
        self._built_settings = c.SetStoreSettings(max_objects, put_start_discard_timeout_ms,
                                                  put_start_release_timeout_ms,
                                                  allocation_strategy)
        self._install_settings(self._built_settings)
        self.store_settings_from_log = False  # whether a SetStoreSettings set them
        # The mount generation of each node's latest NodeUp (meta/commands.py segment_id_of):
        # kept when the node goes down, so its next registration gets a new one.
        self.generations: dict[int, int] = {}
        self.segments: dict[int, Segment] = {}
        self.segment_list: list[Segment] = []
        # Nodes declared down whose segments are kept for their return, by node id.
        self.down_nodes: dict[int, DownNode] = {}
        # Namespaces with a pool of their own (a mounted segment whose pool_namespace they
        # are): their objects are placed in it alone, everyone else's in the shared pool.
        self.pool_namespaces: set[str] = set()
        self.objects: dict[c.ObjectKey, ObjectEntry] = {}
        self.nodes: dict[int, Node] = {}
        # The latest time any applied command carried: the cluster's clock, which a new leader
        # continues from, since its own monotonic clock has an unrelated origin.
        self.clock_ms = 0
        # Unfinished writes in start order (the clock is monotonic), for the release sweep.
        self.pending_order: dict[c.ObjectKey, int] = {}
        # Ranges waiting for a deadline before reuse: heap of (release_at_ms, seq, replicas).
        self._deferred: list[tuple[int, int, list[Replica]]] = []
        self._deferred_seq = 0
        self.deferred_bytes = 0
        # Preempted upserts by key and writer id, in the order they were preempted.
        self.preempted: dict[c.ObjectKey, dict[int, PreemptedWrite]] = {}
        # Replicated limits by namespace (c.QUOTA_DEFAULT: everyone else's), as
        # (max_bytes, max_objects), 0 = unlimited; and what each namespace holds (derived from
        # the objects, kept up to date on every path that adds or drops a version or a key).
        self.quotas: dict[str, tuple[int, int]] = {}
        self.usage: dict[str, NamespaceUsage] = {}
        # Arenas by id (ReserveArena), the last id given, and the latest term of an arena
        # command: arenas of earlier terms are closed.
        self.arenas: dict[int, Arena] = {}
        self.arena_seq = 0
        self.arena_term = 0
        self._apply = {
            c.MountSegment: self._mount_segment,
            c.UnmountSegment: self._unmount_segment,
            c.PutStart: self._put_start,
            c.PutEnd: self._put_end,
            c.PutRevoke: self._put_revoke,
            c.PutCommit: self._put_commit,
            c.Remove: self._remove,
            c.Evict: self._evict,
            c.ReleaseExpired: self._release_expired,
            c.NodeUp: self._node_up,
            c.NodeDown: self._node_down,
            c.NodeReturn: self._node_return,
            c.ReleaseDownNode: self._release_down_node,
            c.SetQuota: self._set_quota,
            c.AddReplicas: self._add_replicas,
            c.MoveCommit: self._move_commit,
            c.SetStoreSettings: self._set_store_settings,
            c.ReserveArena: self._reserve_arena,
            c.CloseArenas: self._close_arenas,
            c.ArenaPut: self._arena_put,
            c.AddDiskReplica: self._add_disk_replica,
            c.DropDiskReplica: self._drop_disk_replica,
            c.Batch: self._batch,
        }

    def apply(self, command):
        now_ms = getattr(command, "now_ms", 0)
        if now_ms > self.clock_ms:
            self.clock_ms = now_ms
        return self._apply[type(command)](command)

    # -- nodes ------------------------------------------------------------------------------

    def _node_up(self, cmd: c.NodeUp) -> int:
        """Register a node that (re)starts with fresh memory: segments it had are dropped.
        Returns its new mount generation, under which its segments are mounted next."""
        generation = self.generations.get(cmd.node_id, 0) + 1
        if generation > c.MAX_GENERATION:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"node {cmd.node_id} has registered {c.MAX_GENERATION} times; "
                                 f"give it another node id")
        self._node_down(c.NodeDown(cmd.node_id))
        self.nodes[cmd.node_id] = Node(cmd.node_id, cmd.name, cmd.client_address,
                                       cmd.peer_address)
        self.generations[cmd.node_id] = generation
        return generation

    def _node_down(self, cmd: c.NodeDown) -> int:
        """Mark the node down and take its segments out of placement and reads: dropped, or
        with keep_until_ms kept aside for its return (DownNode). Returns the objects left
        with no replica."""
        node = self.nodes.get(cmd.node_id)
        if node is not None:
            node.up = False
        # Its disk copies leave reads (it comes back with them through AddDiskReplica
        # recovered, if its disk kept them).
        for key, _ in list(self.disk_copies(cmd.node_id)):
            self._forget_disk(key, self.objects[key])
        own = [s for s in self.segment_list if c.node_of_segment(s.segment_id) == cmd.node_id]
        keep = None
        if not cmd.keep_until_ms:
            self.down_nodes.pop(cmd.node_id, None)  # dropped with their allocators
        elif node is not None and own and cmd.node_id not in self.down_nodes:
            generations = {c.generation_of_segment(s.segment_id) for s in own}
            if len(generations) == 1 and None not in generations:
                keep = DownNode(cmd.node_id, generations.pop(), cmd.keep_until_ms)
        lost = 0
        for segment in own:
            lost += self._unmount_segment(c.UnmountSegment(segment.segment_id), keep)
        if keep is not None:
            self.down_nodes[cmd.node_id] = keep
        return lost

    def _node_return(self, cmd: c.NodeReturn) -> int:
        """The node is back with its memory (c.NodeReturn): its kept segments are mounted
        again under its next generation and its replicas of still readable versions restored.
        Returns the new generation, or 0 (nothing kept for it: nothing changes)."""
        kept = self.down_nodes.get(cmd.node_id)
        node = self.nodes.get(cmd.node_id)
        generation = cmd.generation + 1
        if kept is None and node is not None and node.up \
                and self.generations.get(cmd.node_id) == generation:
            # Up under the next generation already: this return was applied before (a retry
            # after an unknown outcome), or the node registered anew since. Either way the
            # log's view of the node's memory is right: nothing changes.
            return generation
        if kept is None or node is None or kept.generation != cmd.generation \
                or self.generations.get(cmd.node_id) != cmd.generation:
            return 0
        if generation > c.MAX_GENERATION:
            return 0
        del self.down_nodes[cmd.node_id]
        self.generations[cmd.node_id] = generation
        node.up = True
        renamed: dict[int, int] = {}
        for old in kept.segments:
            # A new Segment over the kept allocator: whoever still holds the old one (a repair
            # task's targets) sees it unmounted, under its old id.
            new_id = c.segment_id_of(cmd.node_id, c.slot_of_segment(old.segment_id),
                                     generation)
            renamed[old.segment_id] = new_id
            segment = Segment(new_id, old.name, old.node_name, old.size_bytes, old.allocator,
                              old.pool_namespace)
            self.segments[new_id] = segment
            self.segment_list.append(segment)
        self._index_pools()
        for arena in kept.arenas:
            # Back closed: the leader that handed out its parts may be gone, so no part of it
            # is handed out again; it returns to its segment once nothing uses it.
            arena.segment_id = renamed[arena.segment_id]
            if arena.closed_ms is None:
                arena.closed_ms = cmd.now_ms
            self.arenas[arena.arena_id] = arena

        def moved(replica: Replica) -> Replica:
            return Replica(renamed[replica.segment_id], replica.offset, replica.handle)

        released: list[Replica] = []
        for parked in kept.parked:
            replica = moved(parked.replica)
            entry = self.objects.get(parked.key)
            version = entry.complete if entry is not None else None
            if version is not None and version.writer_id == parked.writer_id \
                    and version.started_ms == parked.started_ms \
                    and version.size_bytes == parked.size_bytes \
                    and len(version.replicas) < version.replica_num \
                    and self.segments[replica.segment_id].pool_namespace \
                    == self.pool_of(parked.key[0]) \
                    and all(r.segment_id != replica.segment_id for r in version.replicas):
                # A new list: readers in flight keep the replica list they were given.
                version.replicas = version.replicas + [replica]
                self._charge(parked.key, version.size_bytes)
            else:
                # Its version ended (upsert, remove, eviction) or was repaired to its
                # replica_num meanwhile: a surplus copy, freed once no lease can cover it.
                released.append(replica)
        if released:
            self._defer(released, cmd.release_at_ms)
        by_deadline: dict[int, list[Replica]] = {}
        for release_at_ms, replica in kept.held:
            by_deadline.setdefault(max(release_at_ms, cmd.now_ms), []).append(moved(replica))
        for release_at_ms, replicas in by_deadline.items():
            self._defer(replicas, release_at_ms)
        return generation

    def _release_down_node(self, cmd: c.ReleaseDownNode) -> bool:
        """Drop what is kept for a node declared down (c.ReleaseDownNode); whether it was."""
        kept = self.down_nodes.get(cmd.node_id)
        if kept is None or kept.generation != cmd.generation:
            return False
        del self.down_nodes[cmd.node_id]
        return True

    def kept_replicas(self, node_id: int) -> int:
        """Replicas the log keeps for a node declared down, for its return."""
        kept = self.down_nodes.get(node_id)
        return len(kept.parked) if kept is not None else 0

    # -- segments ---------------------------------------------------------------------------

    def _mount_segment(self, cmd: c.MountSegment) -> None:
        if cmd.segment_id in self.segments:
            raise MooncakedError(ErrorCode.SEGMENT_ALREADY_EXISTS, f"segment {cmd.segment_id}")
        node_id = c.node_of_segment(cmd.segment_id)
        generation = c.generation_of_segment(cmd.segment_id)
        kept = self.down_nodes.get(node_id)
        if kept is not None and generation == kept.generation:
            # A late mount of the registration whose segments are kept for the node's return:
            # the node is down, and its return mounts exactly the kept ones.
            raise MooncakedError(ErrorCode.SEGMENT_ALREADY_EXISTS,
                                 f"segment {cmd.segment_id}: node {node_id} is down, its "
                                 f"mount generation {generation} kept for its return")
        current = self.generations.get(node_id)
        if generation is not None and current is not None and generation != current:
            # A mount of an earlier registration, committed after a later NodeUp of the node.
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"segment {cmd.segment_id}: node {node_id} is at mount "
                                 f"generation {current}, not {generation}")
        allocator = self._allocator_factory(cmd.size_bytes, cmd.alignment_bytes,
                                            cmd.max_allocations)
        segment = Segment(cmd.segment_id, cmd.name, cmd.node_name, cmd.size_bytes, allocator,
                          cmd.pool_namespace)
        self.segments[cmd.segment_id] = segment
        self.segment_list.append(segment)
        self._index_pools()

    def _index_pools(self) -> None:
        self.pool_namespaces = {s.pool_namespace for s in self.segment_list} - {c.SHARED_POOL}

    def pool_of(self, namespace: str) -> str:
        """The pool that holds a namespace's objects: its own, or the shared one."""
        return namespace if namespace in self.pool_namespaces else c.SHARED_POOL

    def pool_segments(self, pool: str) -> list[Segment]:
        if not self.pool_namespaces:
            return self.segment_list  # no namespace pools: every segment is shared
        return [s for s in self.segment_list if s.pool_namespace == pool]

    def _unmount_segment(self, cmd: c.UnmountSegment, keep: DownNode | None = None) -> int:
        """Drop the segment and every replica on it; objects left without one are erased.

        With `keep`, the same for everything else, but the segment and its ranges go into
        `keep` (still allocated) instead of being forgotten."""
        segment = self.segments.pop(cmd.segment_id, None)
        if segment is None:
            return 0
        segment.mounted = False
        self.segment_list.remove(segment)
        self._index_pools()
        if keep is not None:
            keep.segments.append(segment)
        lost = 0
        for key, entry in list(self.objects.items()):
            for version in (entry.complete, entry.pending):
                if version is not None:
                    if keep is not None:
                        for r in version.replicas:
                            if r.segment_id != cmd.segment_id:
                                continue
                            if version is entry.complete:
                                keep.parked.append(ParkedReplica(
                                    key, version.writer_id, version.started_ms,
                                    version.size_bytes, r))
                            else:  # its writer may still be copying into it
                                keep.held.append(
                                    (version.started_ms + self.release_timeout_ms, r))
                    before = _version_bytes(version)
                    version.replicas = [r for r in version.replicas
                                        if r.segment_id != cmd.segment_id]
                    self._charge(key, _version_bytes(version) - before)
            if entry.complete is not None and not entry.complete.replicas \
                    and entry.complete.disk is None:
                entry.complete = None
            if entry.pending is not None and not entry.pending.replicas:
                entry.pending = None
                entry.pending_upsert = False
                self.pending_order.pop(key, None)
            if entry.complete is None and entry.pending is None:
                self._drop_object(key)
                lost += 1
        kept = []
        for release_at, seq, replicas in self._deferred:
            if keep is not None:
                keep.held.extend((release_at, r) for r in replicas
                                 if r.segment_id == cmd.segment_id)
            replicas = [r for r in replicas if r.segment_id != cmd.segment_id]
            if replicas:
                kept.append((release_at, seq, replicas))
        heapq.heapify(kept)
        self._deferred = kept
        self.deferred_bytes = sum(self._size_of(rs) for _, _, rs in kept)
        for arena_id in [a for a, arena in self.arenas.items()
                         if arena.segment_id == cmd.segment_id]:
            arena = self.arenas.pop(arena_id)
            if keep is not None:
                keep.arenas.append(arena)
        return lost

    # -- puts -------------------------------------------------------------------------------

    def _put_start(self, cmd: c.PutStart) -> list[Replica]:
        key = cmd.object_key
        entry = self.objects.get(key)
        if entry is not None and not cmd.upsert:
            if entry.complete is not None:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS, "the key exists")
            if cmd.now_ms - entry.pending.started_ms < self.discard_timeout_ms:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS,
                                     "the key is being written")
        if entry is None and len(self.objects) >= self.max_objects:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"the object table is full ({self.max_objects} objects)")
        owner = key[0] if cmd.owner_namespace is None else cmd.owner_namespace
        pool = self.pool_of(owner)
        segments = self.pool_segments(pool)
        # Charged for the replicas asked (placement may land fewer, never more), less an
        # unfinished write of the key that this one preempts.
        preempted = _version_bytes(entry.pending) if entry is not None else 0
        self._check_quota(key, cmd.size_bytes * min(cmd.replica_num, len(segments))
                          - preempted,
                          1 if entry is None and key[0] != c.RESERVED_NAMESPACE else 0)
        placed = place(segments, cmd.size_bytes, cmd.replica_num,
                       cmd.preferred_segments, self.allocation_strategy, cmd.seed)
        if not placed:
            where = f"the pool of namespace {pool!r}" if pool else "the shared pool"
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"no segment of {where} has {cmd.size_bytes} free bytes")
        if entry is not None and entry.pending is not None:
            self._preempt_pending(key, entry, cmd.upsert, cmd.writer_id)
        self._forget_preempted(key, cmd.writer_id)  # its writer starts anew
        if entry is None:
            entry = ObjectEntry(cmd.hard_pin, cmd.now_ms)
            self._add_object(key, entry)
        replicas = [Replica(segment.segment_id, offset, handle)
                    for segment, offset, handle in placed]
        entry.pending = Version(cmd.size_bytes, replicas, cmd.writer_id, cmd.now_ms,
                                cmd.replica_num)
        entry.pending_upsert = cmd.upsert
        self._charge(key, _version_bytes(entry.pending))
        entry.soft_pin_ttl_ms = cmd.soft_pin_ttl_ms
        self.pending_order[key] = cmd.now_ms
        return replicas

    def _preempt_pending(self, key: c.ObjectKey, entry: ObjectEntry, upsert: bool,
                         writer_id: int) -> None:
        """Preempt the key's unfinished write: its writer may still be copying into its
        ranges, so they are reused only after the release timeout, as in Mooncake Store."""
        pending = entry.pending
        release_at = pending.started_ms + self.release_timeout_ms
        seq = self._defer(pending.replicas, release_at)
        if upsert and entry.pending_upsert and pending.writer_id != writer_id:
            # Upsert over upsert: the earlier one may still end (PreemptedWrite).
            self.preempted.setdefault(key, {})[pending.writer_id] = PreemptedWrite(
                pending.size_bytes, pending.started_ms, entry.soft_pin_ttl_ms,
                entry.hard_pin, seq, release_at, pending.replica_num)
        self._charge(key, -_version_bytes(pending))
        entry.pending = None
        entry.pending_upsert = False
        del self.pending_order[key]

    def _owned_pending(self, key: c.ObjectKey, writer_id: int) -> ObjectEntry:
        entry = self.objects.get(key)
        if entry is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        if entry.pending is None:
            raise MooncakedError(ErrorCode.INVALID_WRITE, "no write in progress for this key")
        if entry.pending.writer_id != writer_id:
            raise MooncakedError(ErrorCode.ILLEGAL_CLIENT, "another client is writing this key")
        return entry

    def _put_end(self, cmd: c.PutEnd) -> Version | None:
        """Make the pending version readable; returns the version it replaced (upsert)."""
        key = cmd.object_key
        entry = self.objects.get(key)
        if entry is None or entry.pending is None or entry.pending.writer_id != cmd.writer_id:
            record = self.preempted.get(key, {}).get(cmd.writer_id)
            if record is not None:
                return self._end_preempted(cmd, entry, record)
        entry = self._owned_pending(key, cmd.writer_id)
        replaced = entry.complete
        if replaced is not None:
            # The old bytes may be under a read lease; the master says until when.
            self._defer(replaced.replicas, cmd.replaced_release_at_ms)
            self._charge(key, -_version_bytes(replaced))
        if entry.pending_upsert:
            # Every preempted upsert of the key started before this one: superseded.
            for record in self.preempted.get(key, {}).values():
                record.superseded = True
        entry.complete, entry.pending = entry.pending, None
        entry.pending_upsert = False
        del self.pending_order[key]
        if entry.soft_pin_ttl_ms is not None:
            entry.soft_pin_deadline_ms = cmd.now_ms + entry.soft_pin_ttl_ms
            entry.soft_pin_ttl_ms = None
        return replaced

    def _end_preempted(self, cmd: c.PutEnd, entry: ObjectEntry | None,
                       record: PreemptedWrite) -> Version | None:
        """The end of a preempted upsert: a no-op success if a later upsert of the key has
        completed since (superseded); else its value becomes readable now, over whatever is."""
        key = cmd.object_key
        if record.superseded:
            self._forget_preempted(key, cmd.writer_id)
            return None
        index = next((i for i, item in enumerate(self._deferred)
                      if item[1] == record.deferred_seq), None)
        if index is None:  # every replica's segment was unmounted meanwhile
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "the ranges of this write were lost with their segments")
        replicas = self._deferred[index][2]
        if entry is None and len(self.objects) >= self.max_objects:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"the object table is full ({self.max_objects} objects)")
        size = record.size_bytes * len(replicas)
        replaced = entry.complete if entry is not None else None
        self._check_quota(key, size - _version_bytes(replaced), 1 if entry is None else 0)
        # Checked: take the ranges back from the deferred list (the heap is rebuilt the same
        # way on every node).
        last = self._deferred.pop()
        if index < len(self._deferred):
            self._deferred[index] = last
            heapq.heapify(self._deferred)
        self.deferred_bytes -= self._size_of(replicas)
        # Upserts preempted before this one started before it (records are kept in start
        # order): a later upsert has now completed over them.
        for writer_id, earlier in self.preempted[key].items():
            if writer_id == cmd.writer_id:
                break
            earlier.superseded = True
        self._forget_preempted(key, cmd.writer_id)
        if entry is None:
            entry = ObjectEntry(record.hard_pin, cmd.now_ms)
            self._add_object(key, entry)
        if replaced is not None:
            self._defer(replaced.replicas, cmd.replaced_release_at_ms)
            self._charge(key, -_version_bytes(replaced))
        entry.complete = Version(record.size_bytes, replicas, cmd.writer_id, record.started_ms,
                                 record.replica_num)
        self._charge(key, size)
        if record.soft_pin_ttl_ms is not None:
            entry.soft_pin_deadline_ms = cmd.now_ms + record.soft_pin_ttl_ms
        return replaced

    def _forget_preempted(self, key: c.ObjectKey, writer_id: int) -> None:
        records = self.preempted.get(key)
        if records is not None and records.pop(writer_id, None) is not None and not records:
            del self.preempted[key]

    def _put_commit(self, cmd: c.PutCommit) -> None:
        """Move a pending reservation to `object_key` and make it readable (put then end)."""
        reserved = self._owned_pending(cmd.reserved_key, cmd.writer_id)
        version = reserved.pending
        if reserved.complete is not None or cmd.reserved_key[0] != c.RESERVED_NAMESPACE:
            raise MooncakedError(ErrorCode.INVALID_WRITE, "not a reservation")
        if version.size_bytes != cmd.size_bytes:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"the reserved range has {version.size_bytes} bytes, "
                                 f"the value {cmd.size_bytes}")
        key = cmd.object_key
        pool = self.pool_of(key[0])
        if any(self.segments[r.segment_id].pool_namespace != pool for r in version.replicas):
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "the reserved range is not in the pool of the key's namespace")
        entry = self.objects.get(key)
        if entry is not None:
            if entry.complete is not None:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS, "the key exists")
            if cmd.now_ms - entry.pending.started_ms < self.discard_timeout_ms:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS,
                                     "the key is being written")
        # The reserved bytes already count against the namespace that reserved them; they
        # move if the key's namespace is another. A preempted stale put of the key stops
        # counting.
        moved = 0 if c.charged_namespace(key) == c.charged_namespace(cmd.reserved_key) \
            else _version_bytes(version)
        self._check_quota(key, moved - (_version_bytes(entry.pending) if entry else 0),
                          1 if entry is None else 0)
        if entry is not None:
            # A stale unfinished put of the key is preempted, as by PutStart; its writer may
            # still be copying, so its ranges wait for the release timeout.
            self._defer(entry.pending.replicas,
                        entry.pending.started_ms + self.release_timeout_ms)
            self._charge(key, -_version_bytes(entry.pending))
            del self.pending_order[key]
            self._drop_object(key)
        del self.pending_order[cmd.reserved_key]
        self._charge(cmd.reserved_key, -_version_bytes(version))
        self._drop_object(cmd.reserved_key)
        committed = ObjectEntry(cmd.hard_pin, cmd.now_ms)
        committed.complete = Version(version.size_bytes, version.replicas, cmd.writer_id,
                                     cmd.now_ms, version.replica_num)
        if cmd.soft_pin_ttl_ms is not None:
            committed.soft_pin_deadline_ms = cmd.now_ms + cmd.soft_pin_ttl_ms
        self._add_object(key, committed)
        self._charge(key, _version_bytes(committed.complete))

    def _add_replicas(self, cmd: c.AddReplicas) -> int:
        """Move a repair's reservation into the replicas of the version it copied; returns the
        replicas added. Refused, changing nothing, unless that version is still readable."""
        reserved = self._owned_pending(cmd.reserved_key, cmd.reservation_writer_id)
        copies = reserved.pending
        if reserved.complete is not None or cmd.reserved_key[0] != c.RESERVED_NAMESPACE:
            raise MooncakedError(ErrorCode.INVALID_WRITE, "not a reservation")
        key = cmd.object_key
        entry = self.objects.get(key)
        version = entry.complete if entry is not None else None
        if version is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "the object has no readable value")
        if version.writer_id != cmd.writer_id or version.started_ms != cmd.started_ms:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "the object has another value than the one copied")
        if copies.size_bytes != version.size_bytes:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"the reserved ranges have {copies.size_bytes} bytes, the "
                                 f"value {version.size_bytes}")
        used = {r.segment_id for r in version.replicas}
        if any(r.segment_id in used for r in copies.replicas):
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "a copy is on a segment that already holds the value")
        if len(version.replicas) + len(copies.replicas) > version.replica_num:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 f"the value was put with {version.replica_num} replicas")
        pool = self.pool_of(key[0])
        if any(self.segments[r.segment_id].pool_namespace != pool for r in copies.replicas):
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "the reserved ranges are not in the pool of the key's namespace")
        del self.pending_order[cmd.reserved_key]
        self._charge(cmd.reserved_key, -_version_bytes(copies))
        self._drop_object(cmd.reserved_key)
        # A new list: readers in flight keep the replica list they were given.
        version.replicas = version.replicas + copies.replicas
        self._charge(key, _version_bytes(copies))
        return len(copies.replicas)

    def _move_commit(self, cmd: c.MoveCommit) -> bool:
        """A conditional replacement of a version's replicas (c.MoveCommit)."""
        reserved = self._owned_pending(cmd.reserved_key, cmd.writer_id)
        copy = reserved.pending
        if reserved.complete is not None or cmd.reserved_key[0] != c.RESERVED_NAMESPACE:
            raise MooncakedError(ErrorCode.INVALID_WRITE, "not a reservation")
        key = cmd.object_key
        pool = self.pool_of(key[0])
        if any(self.segments[r.segment_id].pool_namespace != pool for r in copy.replicas):
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 "the reserved range is not in the pool of the key's namespace")
        entry = self.objects.get(key)
        current = entry.complete if entry is not None else None
        if current is None or current.writer_id != cmd.version_writer_id \
                or current.started_ms != cmd.version_started_ms \
                or current.size_bytes != copy.size_bytes:
            self._drop_pending(cmd.reserved_key, reserved)  # not the version copied
            return False
        self._defer(current.replicas, cmd.replaced_release_at_ms)
        self._charge(key, -_version_bytes(current))
        del self.pending_order[cmd.reserved_key]
        self._charge(cmd.reserved_key, -_version_bytes(copy))
        self._drop_object(cmd.reserved_key)
        entry.complete = Version(current.size_bytes, copy.replicas, current.writer_id,
                                 current.started_ms, current.replica_num, current.disk)
        self._charge(key, _version_bytes(entry.complete))
        return True

    def _put_revoke(self, cmd: c.PutRevoke) -> None:
        entry = self.objects.get(cmd.object_key)
        if (entry is None or entry.pending is None or entry.pending.writer_id != cmd.writer_id) \
                and cmd.writer_id in self.preempted.get(cmd.object_key, {}):
            # Preempted: its ranges already wait for their release deadline.
            self._forget_preempted(cmd.object_key, cmd.writer_id)
            return
        entry = self._owned_pending(cmd.object_key, cmd.writer_id)
        if cmd.release_at_ms:
            self._defer(entry.pending.replicas, cmd.release_at_ms)
            self._charge(cmd.object_key, -_version_bytes(entry.pending))
            entry.pending = None
            entry.pending_upsert = False
            del self.pending_order[cmd.object_key]
            if entry.complete is None:
                self._drop_object(cmd.object_key)
            return
        self._drop_pending(cmd.object_key, entry)

    def _drop_pending(self, key: c.ObjectKey, entry: ObjectEntry) -> None:
        self._release(entry.pending.replicas)
        self._charge(key, -_version_bytes(entry.pending))
        entry.pending = None
        entry.pending_upsert = False
        del self.pending_order[key]
        if entry.complete is None:
            self._drop_object(key)

    # -- removal ----------------------------------------------------------------------------

    def _remove(self, cmd: c.Remove) -> Version:
        entry = self.objects.get(cmd.object_key)
        if entry is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        if entry.complete is None:
            raise MooncakedError(ErrorCode.REPLICA_IS_NOT_READY, "the object is being written")
        removed = entry.complete
        self._defer(removed.replicas, cmd.release_at_ms)
        self._charge(cmd.object_key, -_version_bytes(removed))
        if entry.pending is not None:
            # An upsert in flight loses its key too. Its writer may still be copying into its
            # ranges, so they are reused only after the release timeout, as when preempted.
            self._defer(entry.pending.replicas,
                        entry.pending.started_ms + self.release_timeout_ms)
            self._charge(cmd.object_key, -_version_bytes(entry.pending))
            del self.pending_order[cmd.object_key]
        # Upserts preempted before the removal fail when they end (their value never was).
        self.preempted.pop(cmd.object_key, None)
        self._drop_object(cmd.object_key)
        return removed

    def _evict(self, cmd: c.Evict) -> int:
        """Drop the complete versions of the given keys; returns the bytes freed. A version
        with a disk copy loses its DRAM replicas only, and stays readable from disk (one
        that has none left is not touched: eviction frees DRAM)."""
        freed = 0
        for key in cmd.object_keys:
            entry = self.objects.get(key)
            if entry is None or entry.complete is None:
                continue
            version = entry.complete
            if version.disk is not None:
                if version.replicas:
                    freed += self._release(version.replicas)
                    self._charge(key, -_version_bytes(version))
                    version.replicas = []  # a new list: readers in flight keep theirs
                continue
            freed += self._release(version.replicas)
            self._charge(key, -_version_bytes(version))
            entry.complete = None
            if entry.pending is None:
                self._drop_object(key)
        return freed

    # -- the disk tier ----------------------------------------------------------------------

    def _add_disk_replica(self, cmd: c.AddDiskReplica) -> bool:
        """Give the readable version its disk copy (c.AddDiskReplica); whether it did."""
        if cmd.size_bytes <= 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a disk copy has at least 1 byte")
        key = cmd.object_key
        disk = DiskReplica(cmd.node_id, cmd.region, cmd.offset, cmd.size_bytes,
                           cmd.disk_version)
        entry = self.objects.get(key)
        if cmd.recovered:
            if entry is not None or key[0] == c.RESERVED_NAMESPACE:
                return False
            if len(self.objects) >= self.max_objects:
                return False
            node = self.nodes.get(cmd.node_id)
            if node is not None and not node.up:
                return False
            entry = ObjectEntry(False, cmd.started_ms)
            entry.complete = Version(cmd.size_bytes, [], cmd.writer_id, cmd.started_ms, 1, disk)
            self._add_object(key, entry)
            return True
        version = entry.complete if entry is not None else None
        if version is None or version.writer_id != cmd.writer_id \
                or version.started_ms != cmd.started_ms \
                or version.size_bytes != cmd.size_bytes or version.disk is not None:
            return False
        node = self.nodes.get(cmd.node_id)
        if node is not None and not node.up:
            return False
        version.disk = disk
        return True

    def _drop_disk_replica(self, cmd: c.DropDiskReplica) -> bool:
        """Forget a readable version's disk copy (c.DropDiskReplica); whether it did."""
        key = cmd.object_key
        entry = self.objects.get(key)
        version = entry.complete if entry is not None else None
        disk = version.disk if version is not None else None
        if disk is None or disk.node_id != cmd.node_id or disk.region != cmd.region \
                or disk.offset != cmd.offset:
            return False
        self._forget_disk(key, entry)
        return True

    def _forget_disk(self, key: c.ObjectKey, entry: ObjectEntry) -> None:
        """Drop the disk copy of the entry's readable version; a version left with no
        replica is gone, and the object with it unless a write of it is in progress."""
        entry.complete.disk = None
        if not entry.complete.replicas:
            entry.complete = None
            if entry.pending is None:
                self._drop_object(key)

    def disk_copies(self, node_id: int):
        """(key, version) of every readable version with a disk copy on `node_id`."""
        for key, entry in self.objects.items():
            version = entry.complete
            if version is not None and version.disk is not None \
                    and version.disk.node_id == node_id:
                yield key, version

    def _release_expired(self, cmd: c.ReleaseExpired) -> int:
        """Free deferred ranges and revoke unfinished puts whose deadline passed."""
        released = 0
        deadline = cmd.now_ms - self.release_timeout_ms
        while self.pending_order:
            key, started_ms = next(iter(self.pending_order.items()))
            if started_ms > deadline:
                break
            entry = self.objects[key]
            self._drop_pending(key, entry)
            released += 1
        while self._deferred and self._deferred[0][0] <= cmd.now_ms:
            _, _, replicas = heapq.heappop(self._deferred)
            self.deferred_bytes -= self._release(replicas)
            released += 1
        for arena in [a for a in self.arenas.values()
                      if a.release_at_ms() is not None and a.release_at_ms() <= cmd.now_ms]:
            self.segments[arena.segment_id].allocator.free(arena.handle)
            del self.arenas[arena.arena_id]
            released += 1
        # Preempted upserts whose ranges' deadline passed: their write is void.
        for key in [k for k, records in self.preempted.items()
                    if any(r.release_at_ms <= cmd.now_ms for r in records.values())]:
            records = self.preempted[key]
            for writer_id in [w for w, r in records.items() if r.release_at_ms <= cmd.now_ms]:
                del records[writer_id]
            if not records:
                del self.preempted[key]
        return released

    def _batch(self, cmd: c.Batch) -> list:
        """Each command's result, or the MooncakedError it failed with (c.Batch)."""
        results = []
        for command in cmd.commands:
            try:
                results.append(self.apply(command))
            except MooncakedError as exc:
                results.append(exc)
        return results

    # -- arenas (meta/commands.py ReserveArena) ----------------------------------------------

    def _arena_fence(self, term: int, now_ms: int) -> None:
        """Refuse a command of a term before the latest arena command's; a later term closes
        every arena of the earlier ones (their leader's writers may still be filling parts)."""
        if term < self.arena_term:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 f"term {term} is over: the leader of term {self.arena_term} "
                                 "has taken arenas since")
        if term > self.arena_term:
            self.arena_term = term
            for arena in self.arenas.values():
                if arena.term < term and arena.closed_ms is None:
                    arena.closed_ms = now_ms

    def _reserve_arena(self, cmd: c.ReserveArena) -> tuple[int, int]:
        if cmd.size_bytes <= 0 or cmd.hold_ms < 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "an arena needs a size and a hold")
        self._arena_fence(cmd.term, cmd.now_ms)
        segment = self.segments.get(cmd.segment_id)
        if segment is None:
            raise MooncakedError(ErrorCode.SEGMENT_NOT_FOUND, f"segment {cmd.segment_id}")
        allocation = segment.allocate(cmd.size_bytes)
        if allocation is None:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"segment {segment.name} has no {cmd.size_bytes} free bytes "
                                 "in one range")
        offset, handle = allocation
        self.arena_seq += 1
        self.arenas[self.arena_seq] = Arena(self.arena_seq, cmd.segment_id, handle, offset,
                                            segment.allocator.allocation_size(handle),
                                            cmd.term, cmd.hold_ms)
        return self.arena_seq, offset

    def _close_arenas(self, cmd: c.CloseArenas) -> int:
        """Returns how many arenas it closed."""
        if cmd.hold_ms < 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a hold is >= 0")
        self._arena_fence(cmd.term, cmd.now_ms)
        closed = 0
        for arena_id in cmd.arena_ids:
            arena = self.arenas.get(arena_id)
            if arena is not None and arena.closed_ms is None:
                arena.closed_ms = cmd.now_ms
                arena.hold_ms = min(arena.hold_ms, cmd.hold_ms)
                closed += 1
        return closed

    def _arena_put(self, cmd: c.ArenaPut) -> Version | None:
        """Record a whole put (c.ArenaPut); returns the version it replaced (an upsert's)."""
        self._arena_fence(cmd.term, cmd.now_ms)
        if cmd.size_bytes <= 0 or cmd.replica_num < 1 or not cmd.replicas:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a put needs a size and replicas")
        if cmd.now_ms - cmd.started_ms > self.release_timeout_ms:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 f"the put started {cmd.now_ms - cmd.started_ms} ms ago, more "
                                 f"than put_start_release_timeout_ms ({self.release_timeout_ms})")
        key = cmd.object_key
        pool = self.pool_of(key[0])
        replicas, segment_ids = [], set()
        for arena_id, offset in cmd.replicas:
            arena = self.arenas.get(arena_id)
            if arena is None or arena.term != cmd.term:
                raise MooncakedError(ErrorCode.INVALID_WRITE,
                                     f"arena {arena_id} is not one of term {cmd.term}'s (its "
                                     "segment was dropped, or it was freed)")
            if not arena.offset <= offset <= arena.offset + arena.size_bytes - cmd.size_bytes:
                raise MooncakedError(ErrorCode.INVALID_WRITE,
                                     f"{cmd.size_bytes} bytes at {offset} are not in arena "
                                     f"{arena_id}")
            if arena.segment_id in segment_ids \
                    or self.segments[arena.segment_id].pool_namespace != pool:
                raise MooncakedError(ErrorCode.INVALID_WRITE,
                                     "two replicas on one segment, or one outside the pool of "
                                     "the key's namespace")
            segment_ids.add(arena.segment_id)
            replicas.append(Replica(arena.segment_id, offset, -arena_id))
        entry = self.objects.get(key)
        if entry is not None and not cmd.upsert:
            if entry.complete is not None:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS, "the key exists")
            if cmd.now_ms - entry.pending.started_ms < self.discard_timeout_ms:
                raise MooncakedError(ErrorCode.OBJECT_ALREADY_EXISTS,
                                     "the key is being written")
        if cmd.upsert and entry is not None and entry.complete is not None \
                and entry.complete.started_ms > cmd.started_ms:
            return None  # a later-started upsert completed first: it wins
        if entry is None and len(self.objects) >= self.max_objects:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"the object table is full ({self.max_objects} objects)")
        replaced = entry.complete if entry is not None else None
        preempted = _version_bytes(entry.pending) if entry is not None else 0
        self._check_quota(key, cmd.size_bytes * len(replicas) - _version_bytes(replaced)
                          - preempted, 1 if entry is None else 0)
        # Checked: apply.
        if entry is not None and entry.pending is not None:
            self._preempt_pending(key, entry, cmd.upsert, cmd.writer_id)
        self._forget_preempted(key, cmd.writer_id)
        for record in self.preempted.get(key, {}).values():
            if record.started_ms <= cmd.started_ms:
                record.superseded = True  # started before this one, which completed
        if entry is None:
            entry = ObjectEntry(cmd.hard_pin, cmd.now_ms)
            self._add_object(key, entry)
        if replaced is not None:
            self._defer(replaced.replicas, cmd.replaced_release_at_ms)
            self._charge(key, -_version_bytes(replaced))
        entry.complete = Version(cmd.size_bytes, replicas, cmd.writer_id, cmd.started_ms,
                                 cmd.replica_num)
        self._charge(key, _version_bytes(entry.complete))
        for replica in replicas:
            self.arenas[-replica.handle].live += 1
        if cmd.soft_pin_ttl_ms is not None:
            entry.soft_pin_deadline_ms = cmd.now_ms + cmd.soft_pin_ttl_ms
        return replaced

    # -- store settings -----------------------------------------------------------------------

    def _set_store_settings(self, cmd: c.SetStoreSettings) -> None:
        problem = store_settings_problem(cmd)
        if problem is not None:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, f"store settings: {problem}")
        self._install_settings(cmd)
        self.store_settings_from_log = True

    def _install_settings(self, settings: c.SetStoreSettings) -> None:
        self.max_objects = settings.max_objects
        self.discard_timeout_ms = settings.put_start_discard_timeout_ms
        self.release_timeout_ms = settings.put_start_release_timeout_ms
        self.allocation_strategy = settings.allocation_strategy

    def store_settings(self) -> c.SetStoreSettings:
        """The settings it decides by now, by their `[store]` names."""
        return c.SetStoreSettings(self.max_objects, self.discard_timeout_ms,
                                  self.release_timeout_ms, self.allocation_strategy)

    # -- quotas -------------------------------------------------------------------------------

    def _set_quota(self, cmd: c.SetQuota) -> None:
        if not (cmd.namespace == c.QUOTA_DEFAULT or c.valid_namespace(cmd.namespace)):
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"{cmd.namespace!r:.80} is not a namespace (1-255 characters "
                                 f"of [A-Za-z0-9._:/-]) nor {c.QUOTA_DEFAULT!r}")
        for name in ("max_bytes", "max_objects"):
            value = getattr(cmd, name)
            if type(value) is not int or value < 0:
                raise MooncakedError(ErrorCode.INVALID_PARAMS, f"{name} must be an int >= 0")
        self.quotas[cmd.namespace] = (cmd.max_bytes, cmd.max_objects)

    def quota_of(self, namespace: str) -> tuple[int, int]:
        """(max_bytes, max_objects) that apply to a namespace; 0 = unlimited."""
        if namespace == c.RESERVED_NAMESPACE:
            return UNLIMITED
        quota = self.quotas.get(namespace)
        if quota is None:
            quota = self.quotas.get(c.QUOTA_DEFAULT, UNLIMITED)
        return quota

    def _check_quota(self, key: c.ObjectKey, add_bytes: int, add_objects: int) -> None:
        """QUOTA_EXCEEDED if adding this much would take the key's namespace over a limit."""
        namespace = c.charged_namespace(key)
        max_bytes, max_objects = self.quota_of(namespace)
        if not max_bytes and not max_objects:
            return
        usage = self.usage.get(namespace) or NamespaceUsage()
        if max_bytes and add_bytes > 0 and usage.bytes + add_bytes > max_bytes:
            raise MooncakedError(ErrorCode.QUOTA_EXCEEDED,
                                 f"namespace {namespace!r} holds {usage.bytes} bytes; "
                                 f"{add_bytes} more would pass its quota of {max_bytes} bytes")
        if max_objects and add_objects > 0 and usage.objects + add_objects > max_objects:
            raise MooncakedError(ErrorCode.QUOTA_EXCEEDED,
                                 f"namespace {namespace!r} holds {usage.objects} objects, its "
                                 f"quota is {max_objects} objects")

    def _charge(self, key: c.ObjectKey, delta_bytes: int) -> None:
        if delta_bytes:
            self._usage_of(c.charged_namespace(key)).bytes += delta_bytes
            self._forget_empty(c.charged_namespace(key))

    def _add_object(self, key: c.ObjectKey, entry: ObjectEntry) -> None:
        self.objects[key] = entry
        if key[0] != c.RESERVED_NAMESPACE:
            self._usage_of(key[0]).objects += 1

    def _drop_object(self, key: c.ObjectKey) -> None:
        del self.objects[key]
        if key[0] != c.RESERVED_NAMESPACE:
            self._usage_of(key[0]).objects -= 1
            self._forget_empty(key[0])

    def _usage_of(self, namespace: str) -> NamespaceUsage:
        usage = self.usage.get(namespace)
        if usage is None:
            usage = self.usage[namespace] = NamespaceUsage()
        return usage

    def _forget_empty(self, namespace: str) -> None:
        usage = self.usage.get(namespace)
        if usage is not None and usage.bytes == 0 and usage.objects == 0:
            del self.usage[namespace]

    def count_usage(self) -> dict[str, tuple[int, int]]:
        """Usage recounted from the objects, {namespace: (bytes, objects)} (what `usage` must
        equal; restore rebuilds it with this)."""
        counted: dict[str, list[int]] = {}
        for key, entry in self.objects.items():
            namespace = c.charged_namespace(key)
            row = counted.setdefault(namespace, [0, 0])
            row[0] += _version_bytes(entry.complete) + _version_bytes(entry.pending)
            if key[0] != c.RESERVED_NAMESPACE:
                row[1] += 1
        return {ns: (b, o) for ns, (b, o) in counted.items() if b or o}

    def namespaces_over_quota(self) -> dict[str, tuple[int, int]]:
        """{namespace: (bytes over, objects over)} for every namespace above a limit (a quota
        lowered below what the namespace holds)."""
        over = {}
        for namespace, usage in self.usage.items():
            max_bytes, max_objects = self.quota_of(namespace)
            bytes_over = usage.bytes - max_bytes if max_bytes else 0
            objects_over = usage.objects - max_objects if max_objects else 0
            if bytes_over > 0 or objects_over > 0:
                over[namespace] = (max(0, bytes_over), max(0, objects_over))
        return over

    # -- ranges -----------------------------------------------------------------------------

    def _defer(self, replicas: list[Replica], release_at_ms: int) -> int:
        """Hold ranges until a deadline; returns the entry's sequence number."""
        self._deferred_seq += 1
        heapq.heappush(self._deferred, (release_at_ms, self._deferred_seq, replicas))
        self.deferred_bytes += self._size_of(replicas)
        return self._deferred_seq

    def _size_of(self, replicas: list[Replica]) -> int:
        """Allocator bytes of ranges (a part of an arena counts none: the arena holds them)."""
        return sum(self.segments[r.segment_id].allocator.allocation_size(r.handle)
                   for r in replicas if r.handle >= 0 and r.segment_id in self.segments)

    def _release(self, replicas: list[Replica]) -> int:
        """Free ranges; returns the allocator bytes freed (a part of an arena frees none: its
        arena is freed later, once closed, unused and held, by ReleaseExpired)."""
        freed = 0
        for replica in replicas:
            if replica.handle < 0:
                arena = self.arenas.get(-replica.handle)
                if arena is not None:
                    arena.live -= 1
                continue
            segment = self.segments.get(replica.segment_id)
            if segment is not None:
                freed += segment.allocator.free(replica.handle)
        return freed

    # -- queries ----------------------------------------------------------------------------

    def expiry_due(self, now_ms: int) -> bool:
        """Whether ReleaseExpired(now_ms) would free something (a sweep with nothing to do
        need not go through the log)."""
        if self.pending_order:
            oldest = next(iter(self.pending_order.values()))
            if oldest <= now_ms - self.release_timeout_ms:
                return True
        if any(r.release_at_ms <= now_ms
               for records in self.preempted.values() for r in records.values()):
            return True
        if any(a.release_at_ms() is not None and a.release_at_ms() <= now_ms
               for a in self.arenas.values()):
            return True
        return bool(self._deferred) and self._deferred[0][0] <= now_ms

    def readable(self, key: c.ObjectKey) -> Version | None:
        entry = self.objects.get(key)
        return entry.complete if entry is not None else None

    def used_bytes(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segment_list)

    def capacity_bytes(self) -> int:
        return sum(s.allocator.capacity_bytes for s in self.segment_list)

    def pools(self) -> list[str]:
        """Every pool with a mounted segment (SHARED_POOL first, if it has one)."""
        return sorted({s.pool_namespace for s in self.segment_list})

    def owned_bytes(self, segment_id: int) -> int:
        """Bytes of the segment's ranges that the state owns: complete and pending versions,
        deferred releases and arenas (whose parts count with their arena). The allocator's
        free bytes are the segment's size minus this; anything else is space leaked."""
        segment = self.segments[segment_id]
        size_of = segment.allocator.allocation_size
        owned = 0
        for entry in self.objects.values():
            for version in (entry.complete, entry.pending):
                if version is not None:
                    owned += sum(size_of(r.handle) for r in version.replicas
                                 if r.segment_id == segment_id and r.handle >= 0)
        for _, _, replicas in self._deferred:
            owned += sum(size_of(r.handle) for r in replicas
                         if r.segment_id == segment_id and r.handle >= 0)
        owned += sum(size_of(a.handle) for a in self.arenas.values()
                     if a.segment_id == segment_id)
        return owned

    def check_invariants(self) -> None:
        """Every live range is owned exactly once and the allocators agree (tests use this)."""
        owned: dict[int, list[tuple[int, int]]] = {sid: [] for sid in self.segments}
        parts: dict[int, list[tuple[int, int, int]]] = {}  # arena id -> (segment, offset, size)
        for key, entry in self.objects.items():
            assert entry.complete is not None or entry.pending is not None, key
            assert (entry.pending is not None) == (key in self.pending_order), key
            assert entry.pending is not None or not entry.pending_upsert, key
            # A readable version has a DRAM replica or a disk copy; a pending one, replicas.
            assert entry.complete is None or entry.complete.replicas \
                or entry.complete.disk is not None, key
            assert entry.pending is None or (entry.pending.replicas
                                             and entry.pending.disk is None), key
            disk = entry.complete.disk if entry.complete is not None else None
            assert disk is None or (disk.size_bytes == entry.complete.size_bytes
                                    and (disk.node_id not in self.nodes
                                         or self.nodes[disk.node_id].up)), key
            for version in (entry.complete, entry.pending):
                if version is not None:
                    segment_ids = [r.segment_id for r in version.replicas]
                    assert len(set(segment_ids)) == len(segment_ids), key
                    if key[0] != c.RESERVED_NAMESPACE:  # no object outside its pool
                        pool = self.pool_of(key[0])
                        assert all(self.segments[sid].pool_namespace == pool
                                   for sid in segment_ids), key
                    for r in version.replicas:
                        if r.handle < 0:
                            parts.setdefault(-r.handle, []).append(
                                (r.segment_id, r.offset, version.size_bytes))
                        else:
                            owned[r.segment_id].append((r.offset, r.handle))
        for _, _, replicas in self._deferred:
            for r in replicas:
                if r.handle < 0:
                    parts.setdefault(-r.handle, []).append((r.segment_id, r.offset, 0))
                else:
                    owned[r.segment_id].append((r.offset, r.handle))
        for arena_id, arena in self.arenas.items():
            assert arena.arena_id == arena_id and 0 < arena_id <= self.arena_seq, arena_id
            assert arena.term <= self.arena_term, arena_id
            assert arena.closed_ms is not None or arena.term == self.arena_term, arena_id
            owned[arena.segment_id].append((arena.offset, arena.handle))
            mine = parts.pop(arena_id, [])
            assert arena.live == len(mine), (arena_id, arena.live, len(mine))
            spans = sorted((offset, offset + size) for sid, offset, size in mine)
            assert all(sid == arena.segment_id for sid, _, _ in mine), arena_id
            assert all(arena.offset <= start and end <= arena.offset + arena.size_bytes
                       for start, end in spans), arena_id
            live_spans = [span for span in spans if span[1] > span[0]]  # deferred: size unknown
            for (_, end), (start, _) in zip(live_spans, live_spans[1:]):
                assert end <= start, f"overlapping parts in arena {arena_id}"
        assert not parts, f"replicas in arenas that do not exist: {sorted(parts)}"
        for segment_id, ranges in owned.items():
            allocator = self.segments[segment_id].allocator
            assert allocator.allocation_count == len(ranges), (
                segment_id, allocator.allocation_count, len(ranges))
            spans = sorted((offset, offset + allocator.allocation_size(handle))
                           for offset, handle in ranges)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert end <= start, f"overlapping ranges in segment {segment_id}"
            assert allocator.used_bytes == sum(e - s for s, e in spans)
        for node_id, kept in self.down_nodes.items():
            node = self.nodes.get(node_id)
            assert node is not None and not node.up, node_id
            assert self.generations.get(node_id) == kept.generation, node_id
            ranges_of: dict[int, list[tuple[int, int]]] = {}
            for segment in kept.segments:
                assert segment.segment_id not in self.segments, segment.segment_id
                assert c.node_of_segment(segment.segment_id) == node_id
                ranges_of[segment.segment_id] = []
            kept_parts = {arena.arena_id: 0 for arena in kept.arenas}
            for arena in kept.arenas:
                assert arena.arena_id not in self.arenas, arena.arena_id
                ranges_of[arena.segment_id].append((arena.offset, arena.handle))
            for r in [p.replica for p in kept.parked] + [r for _, r in kept.held]:
                if r.handle < 0:
                    kept_parts[-r.handle] += 1
                else:
                    ranges_of[r.segment_id].append((r.offset, r.handle))
            assert all(arena.live == kept_parts[arena.arena_id] for arena in kept.arenas), \
                node_id
            for segment in kept.segments:
                allocator = segment.allocator
                ranges = ranges_of[segment.segment_id]
                assert allocator.allocation_count == len(ranges), segment.segment_id
                assert len({h for _, h in ranges}) == len(ranges), segment.segment_id
                assert all(allocator.allocation_offset(h) == o for o, h in ranges)
        usage = {ns: (u.bytes, u.objects) for ns, u in self.usage.items()}
        assert usage == self.count_usage(), (usage, self.count_usage())
        for key, records in self.preempted.items():
            assert records, key
            entry = self.objects.get(key)
            for writer_id, record in records.items():
                assert 0 < record.deferred_seq <= self._deferred_seq, (key, writer_id)
                assert entry is None or entry.pending is None \
                    or entry.pending.writer_id != writer_id, (key, writer_id)

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as msgpack bytes, for Raft log compaction; `restore` takes it back.

        Holds everything later commands depend on, in the orders they are iterated in:
        segments with their allocators' exact internal state (OffsetAllocator.dump), nodes,
        objects with both versions (each with the replica_num it was put with) and pins, the
        pending order, the deferred heap as laid out, its sequence counter and byte count, the
        clock, the namespace quotas (usage is derived from the objects, and recounted by
        `restore`), the preempted upserts, the store settings it decides by and whether the log
        set them, each node's mount generation, and what is kept for nodes declared down
        (their segments with allocators, parked replicas, held ranges). The same state always
        gives the same bytes.
        """
        def replicas(rs):
            return [[r.segment_id, r.offset, r.handle] for r in rs]

        def version(v):
            if v is None:
                return None
            disk = v.disk
            return [v.size_bytes, v.writer_id, v.started_ms, replicas(v.replicas),
                    v.replica_num,
                    None if disk is None else [disk.node_id, disk.region, disk.offset,
                                               disk.size_bytes, disk.disk_version]]

        def arena_row(a):
            return [a.arena_id, a.segment_id, a.handle, a.offset, a.size_bytes, a.term,
                    a.hold_ms, a.closed_ms, a.live]

        def segment_row(s):
            return [s.segment_id, s.name, s.node_name, s.size_bytes, bool(s.mounted),
                    s.allocator.dump(), s.pool_namespace]

        state = {
            "format": 5,
            "arenas": [arena_row(a) for a in self.arenas.values()],
            "arena_seq": self.arena_seq,
            "arena_term": self.arena_term,
            "config": [self.max_objects, self.discard_timeout_ms, self.release_timeout_ms,
                       self.allocation_strategy],
            "settings_from_log": self.store_settings_from_log,
            "generations": [[node_id, generation]
                            for node_id, generation in self.generations.items()],
            "clock_ms": self.clock_ms,
            "segments": [segment_row(s) for s in self.segments.values()],
            "segment_list": [s.segment_id for s in self.segment_list],
            "nodes": [[n.node_id, n.name, n.client_address, n.peer_address, bool(n.up)]
                      for n in self.nodes.values()],
            "objects": [[ns, name, bool(e.hard_pin), e.soft_pin_ttl_ms, e.soft_pin_deadline_ms,
                         e.created_ms, version(e.complete), version(e.pending),
                         bool(e.pending_upsert)]
                        for (ns, name), e in self.objects.items()],
            "pending_order": [[ns, name, started] for (ns, name), started
                              in self.pending_order.items()],
            "deferred": [[release_at, seq, replicas(rs)] for release_at, seq, rs in self._deferred],
            "deferred_seq": self._deferred_seq,
            "deferred_bytes": self.deferred_bytes,
            "quotas": [[ns, max_bytes, max_objects]
                       for ns, (max_bytes, max_objects) in self.quotas.items()],
            "preempted": [[ns, name, writer_id, r.size_bytes, r.started_ms, r.soft_pin_ttl_ms,
                           bool(r.hard_pin), r.deferred_seq, r.release_at_ms, r.replica_num,
                           bool(r.superseded)]
                          for (ns, name), records in self.preempted.items()
                          for writer_id, r in records.items()],
            "down_nodes": [[d.node_id, d.generation, d.keep_until_ms,
                            [segment_row(s) for s in d.segments],
                            [[p.key[0], p.key[1], p.writer_id, p.started_ms, p.size_bytes,
                              replicas([p.replica])[0]] for p in d.parked],
                            [[release_at, replicas([r])[0]] for release_at, r in d.held],
                            [arena_row(a) for a in d.arenas]]
                           for d in self.down_nodes.values()],
        }
        return msgpack.packb(state, use_bin_type=True)

    def digest(self) -> bytes:
        """A 32-byte hash of the whole state (that of `snapshot`, config included).

        Two state machines that applied the same commands have equal digests; any difference
        in objects, replicas, allocator internals, deferred ranges, nodes or orders shows.
        """
        return hashlib.blake2b(self.snapshot(), digest_size=32).digest()

    def restore(self, data: bytes) -> None:
        """Replace the whole state with a `snapshot`'s; the allocator factory stays.

        A snapshot of format 1, 2 or 3 keeps nothing for nodes declared down. One of format 1
        or 2 (before store settings and generations were replicated)
        records the config of the node that took it: the instance's built settings apply
        instead, and no node has a generation yet (their segment ids are of the old layout,
        which no new id equals).

        Everything is checked before anything changes: the shape and types of every field,
        each allocator dump (OffsetAllocator.load), that replicas name existing segments, and
        that every live allocation is owned exactly once, as `check_invariants` requires.
        Raises ValueError on bad data, leaving the state as it was.
        """
        from mooncaked._native import OffsetAllocator

        def fail(what):
            raise ValueError(f"state snapshot: {what}")

        def need(condition, what):
            if not condition:
                fail(what)

        def is_int(v):
            return type(v) is int

        def is_opt_int(v):
            return v is None or type(v) is int

        def is_str(v):
            return type(v) is str

        def row(v, n, what):
            need(type(v) is tuple and len(v) == n, f"bad {what} {v!r:.80}")
            return v

        def seq_of(v, what):
            need(type(v) is tuple, f"{what} is not an array")
            return v

        if not isinstance(data, (bytes, bytearray, memoryview)):
            fail(f"expected bytes, got {type(data).__name__}")
        try:
            top = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for bad bytes
            raise ValueError(f"state snapshot: not msgpack ({exc})") from None
        fields = ("format", "config", "clock_ms", "segments", "segment_list", "nodes", "objects",
                  "pending_order", "deferred", "deferred_seq", "deferred_bytes")
        need(type(top) is dict, "not a map")
        # Format 1 is format 2 without quotas (snapshots taken before quotas existed); format 3
        # adds the preempted upserts (and objects' pending_upsert flags), the store settings'
        # origin and the nodes' mount generations; format 4 the arenas and what is kept for
        # nodes declared down (none in older ones); format 5 the versions' disk copies (a
        # sixth field of each version; none in older ones).
        need(top.get("format") in (1, 2, 3, 4, 5) and type(top.get("format")) is int,
             f"unsupported format {top.get('format')!r:.40}")
        if top["format"] >= 2:
            fields += ("quotas",)
        if top["format"] >= 3:
            fields += ("preempted", "settings_from_log", "generations")
        if top["format"] >= 4:
            fields += ("arenas", "arena_seq", "arena_term", "down_nodes")
        need(set(top) == set(fields), f"fields {sorted(map(str, top))} != {sorted(fields)}")
        config = row(top["config"], 4, "config")
        need(all(map(is_int, config[:3])) and is_str(config[3]), "bad config")
        settings, settings_from_log = self._built_settings, False
        generations: dict[int, int] = {}
        if top["format"] >= 3:
            settings = c.SetStoreSettings(*config)
            problem = store_settings_problem(settings)
            need(problem is None, f"bad config: {problem}")
            settings_from_log = top["settings_from_log"]
            need(type(settings_from_log) is bool, "bad settings_from_log")
            for item in seq_of(top["generations"], "generations"):
                node_id, generation = row(item, 2, "generation")
                need(is_int(node_id) and is_int(generation)
                     and 1 <= generation <= c.MAX_GENERATION and node_id not in generations,
                     f"bad generation {item!r:.80}")
                generations[node_id] = generation
        for name in ("clock_ms", "deferred_seq", "deferred_bytes"):
            need(is_int(top[name]), f"bad {name}")

        def parse_segment(item) -> Segment:
            # Six fields in snapshots written before namespace pools (all segments shared).
            if type(item) is tuple and len(item) == 6:
                item = item + (c.SHARED_POOL,)
            sid, name, node_name, size_bytes, mounted, dump, pool = row(item, 7, "segment")
            need(is_int(sid) and is_str(name) and is_str(node_name) and is_int(size_bytes)
                 and type(mounted) is bool and type(dump) is bytes and is_str(pool),
                 f"bad segment {sid!r:.40}")
            try:
                allocator = OffsetAllocator.load(dump)
            except (ValueError, MemoryError) as exc:
                fail(f"segment {sid}: {exc}")
            segment = Segment(sid, name, node_name, size_bytes, allocator, pool)
            segment.mounted = mounted
            return segment

        segments: dict[int, Segment] = {}
        for item in seq_of(top["segments"], "segments"):
            segment = parse_segment(item)
            need(segment.segment_id not in segments, f"segment {segment.segment_id} twice")
            segments[segment.segment_id] = segment
        order = seq_of(top["segment_list"], "segment_list")
        need(all(map(is_int, order)) and len(order) == len(segments)
             and set(order) == set(segments), "segment_list does not list the segments")
        segment_list = [segments[sid] for sid in order]

        nodes: dict[int, Node] = {}
        for item in seq_of(top["nodes"], "nodes"):
            node_id, name, client_address, peer_address, up = row(item, 5, "node")
            need(is_int(node_id) and is_str(name) and is_str(client_address)
                 and is_str(peer_address) and type(up) is bool, f"bad node {node_id!r:.40}")
            need(node_id not in nodes, f"node {node_id} twice")
            node = Node(node_id, name, client_address, peer_address)
            node.up = up
            nodes[node_id] = node

        owned: dict[int, dict[int, int]] = {sid: {} for sid in segments}  # handle -> offset
        arenas: dict[int, Arena] = {}
        for name in ("arena_seq", "arena_term"):
            need(is_int(top.get(name, 0)) and top.get(name, 0) >= 0, f"bad {name}")
        arena_seq, arena_term = top.get("arena_seq", 0), top.get("arena_term", 0)
        for item in seq_of(top.get("arenas", ()), "arenas"):
            arena_id, sid, handle, offset, size_bytes, term, hold_ms, closed_ms, live = \
                row(item, 9, "arena")
            need(all(map(is_int, (arena_id, sid, handle, offset, size_bytes, term, hold_ms,
                                  live))) and is_opt_int(closed_ms)
                 and 0 < arena_id <= arena_seq and arena_id not in arenas and sid in segments
                 and handle >= 0 and handle not in owned[sid] and term <= arena_term
                 and (closed_ms is not None or term == arena_term), f"bad arena {item!r:.80}")
            owned[sid][handle] = offset
            arena = Arena(arena_id, sid, handle, offset, size_bytes, term, hold_ms)
            arena.closed_ms = closed_ms
            arena.live = live
            arenas[arena_id] = arena
        parts: dict[int, int] = {arena_id: 0 for arena_id in arenas}  # replicas in each

        def parse_replicas(value, what):
            replicas = []
            for item in seq_of(value, what):
                sid, offset, handle = row(item, 3, f"replica of {what}")
                need(is_int(sid) and is_int(offset) and is_int(handle), f"bad replica of {what}")
                need(sid in segments, f"{what}: replica on unknown segment {sid}")
                if handle < 0:  # a part of an arena
                    arena = arenas.get(-handle)
                    need(arena is not None and arena.segment_id == sid
                         and arena.offset <= offset < arena.offset + arena.size_bytes,
                         f"{what}: replica in no arena of its segment")
                    parts[-handle] += 1
                else:
                    need(handle not in owned[sid], f"{what}: range {handle} owned twice")
                    owned[sid][handle] = offset
                replicas.append(Replica(sid, offset, handle))
            return replicas

        def parse_version(value, what, readable):
            if value is None:
                return None
            # Four fields in snapshots written before versions kept their replica_num: the
            # replicas they have count as the ones asked for. Five before disk copies.
            if type(value) is tuple and len(value) == 4:
                value = value + (len(value[3]) if type(value[3]) is tuple else 0,)
            if type(value) is tuple and len(value) == 5:
                value = value + (None,)
            size_bytes, writer_id, started_ms, replicas, replica_num, disk_row = \
                row(value, 6, what)
            need(is_int(size_bytes) and is_int(writer_id) and is_int(started_ms)
                 and is_int(replica_num) and replica_num >= 0, f"bad {what}")
            replicas = parse_replicas(replicas, what)
            sids = [r.segment_id for r in replicas]
            need(len(set(sids)) == len(sids), f"{what}: two replicas on one segment")
            disk = None
            if disk_row is not None:
                need(readable, f"{what}: a version being written has a disk copy")
                node_id, region, offset, disk_size, disk_version = \
                    row(disk_row, 5, f"disk copy of {what}")
                need(all(map(is_int, disk_row)) and disk_size == size_bytes
                     and (node_id not in nodes or nodes[node_id].up),
                     f"bad disk copy of {what}")
                disk = DiskReplica(node_id, region, offset, disk_size, disk_version)
            need(replicas or disk is not None, f"{what}: no replica and no disk copy")
            return Version(size_bytes, replicas, writer_id, started_ms, replica_num, disk)

        objects: dict[c.ObjectKey, ObjectEntry] = {}
        for item in seq_of(top["objects"], "objects"):
            if top["format"] < 3 and type(item) is tuple and len(item) == 8:
                item = item + (False,)
            ns, name, hard_pin, ttl, deadline, created_ms, complete, pending, pending_upsert = \
                row(item, 9, "object")
            need(is_str(ns) and is_str(name) and type(hard_pin) is bool and is_opt_int(ttl)
                 and is_opt_int(deadline) and is_int(created_ms)
                 and type(pending_upsert) is bool, f"bad object {name!r:.40}")
            key = (ns, name)
            need(key not in objects, f"object {key!r:.60} twice")
            entry = ObjectEntry(hard_pin, created_ms)
            entry.soft_pin_ttl_ms = ttl
            entry.soft_pin_deadline_ms = deadline
            entry.complete = parse_version(complete, f"object {key!r:.60}", True)
            entry.pending = parse_version(pending, f"object {key!r:.60}", False)
            entry.pending_upsert = pending_upsert and entry.pending is not None
            need(entry.complete is not None or entry.pending is not None,
                 f"object {key!r:.60} has no version")
            objects[key] = entry

        pending_order: dict[c.ObjectKey, int] = {}
        for item in seq_of(top["pending_order"], "pending_order"):
            ns, name, started_ms = row(item, 3, "pending_order entry")
            need(is_str(ns) and is_str(name) and is_int(started_ms), "bad pending_order entry")
            need((ns, name) not in pending_order, "pending_order lists a key twice")
            pending_order[(ns, name)] = started_ms
        need(set(pending_order) == {k for k, e in objects.items() if e.pending is not None},
             "pending_order does not match the pending versions")

        deferred = []
        seqs = set()
        for item in seq_of(top["deferred"], "deferred"):
            release_at, seq, replicas = row(item, 3, "deferred entry")
            need(is_int(release_at) and is_int(seq) and 0 < seq <= top["deferred_seq"]
                 and seq not in seqs, "bad deferred entry")
            seqs.add(seq)
            deferred.append((release_at, seq, parse_replicas(replicas, "deferred entry")))
        for i in range(1, len(deferred)):
            need(deferred[(i - 1) // 2][:2] <= deferred[i][:2], "deferred is not a heap")

        quotas: dict[str, tuple[int, int]] = {}
        for item in seq_of(top.get("quotas", ()), "quotas"):
            ns, max_bytes, max_objects = row(item, 3, "quota")
            need((ns == c.QUOTA_DEFAULT or c.valid_namespace(ns)) and is_int(max_bytes)
                 and max_bytes >= 0 and is_int(max_objects) and max_objects >= 0,
                 f"bad quota {item!r:.80}")
            need(ns not in quotas, f"quota of {ns!r:.60} twice")
            quotas[ns] = (max_bytes, max_objects)

        preempted: dict[c.ObjectKey, dict[int, PreemptedWrite]] = {}
        for item in seq_of(top.get("preempted", ()), "preempted"):
            (ns, name, writer_id, size_bytes, started_ms, ttl, hard_pin, seq, release_at,
             replica_num, superseded) = row(item, 11, "preempted upsert")
            need(is_str(ns) and is_str(name) and is_int(writer_id) and is_int(size_bytes)
                 and is_int(started_ms) and is_opt_int(ttl) and type(hard_pin) is bool
                 and is_int(seq) and 0 < seq <= top["deferred_seq"] and is_int(release_at)
                 and is_int(replica_num) and replica_num >= 1 and type(superseded) is bool,
                 f"bad preempted upsert {item!r:.80}")
            records = preempted.setdefault((ns, name), {})
            need(writer_id not in records, "a preempted upsert twice")
            pending = objects.get((ns, name))
            need(pending is None or pending.pending is None
                 or pending.pending.writer_id != writer_id,
                 "a preempted upsert of the writer of the key's pending version")
            records[writer_id] = PreemptedWrite(size_bytes, started_ms, ttl, hard_pin, seq,
                                                release_at, replica_num, superseded)

        need(all(arenas[arena_id].live == count for arena_id, count in parts.items()),
             "an arena's count of replicas does not match its replicas")

        down_nodes: dict[int, DownNode] = {}
        kept_segments: dict[int, Segment] = {}

        kept_arenas: dict[int, Arena] = {}
        kept_parts: dict[int, int] = {}

        def parse_kept_replica(value, what):
            sid, offset, handle = row(value, 3, f"replica of {what}")
            need(is_int(sid) and is_int(offset) and is_int(handle), f"bad replica of {what}")
            need(sid in kept_segments and c.node_of_segment(sid) == node_id,
                 f"{what}: replica on a segment not kept for node {node_id}")
            if handle < 0:  # a part of a kept arena
                arena = kept_arenas.get(-handle)
                need(arena is not None and arena.segment_id == sid
                     and arena.offset <= offset < arena.offset + arena.size_bytes,
                     f"{what}: replica in no kept arena of its segment")
                kept_parts[-handle] += 1
            else:
                need(handle not in owned[sid], f"{what}: range {handle} owned twice")
                owned[sid][handle] = offset
            return Replica(sid, offset, handle)

        for item in seq_of(top.get("down_nodes", ()), "down_nodes"):
            node_id, generation, keep_until_ms, kept, parked, held, kept_arena_rows = \
                row(item, 7, "down node")
            need(is_int(node_id) and node_id in nodes and not nodes[node_id].up
                 and node_id not in down_nodes and is_int(generation)
                 and generations.get(node_id) == generation
                 and is_int(keep_until_ms) and keep_until_ms > 0, f"bad down node {node_id!r:.40}")
            record = DownNode(node_id, generation, keep_until_ms)
            for segment_item in seq_of(kept, "kept segments"):
                segment = parse_segment(segment_item)
                sid = segment.segment_id
                need(sid not in segments and sid not in kept_segments
                     and c.node_of_segment(sid) == node_id
                     and c.generation_of_segment(sid) == generation and not segment.mounted,
                     f"bad kept segment {sid}")
                kept_segments[sid] = segment
                owned[sid] = {}
                record.segments.append(segment)
            for arena_item in seq_of(kept_arena_rows, "kept arenas"):
                arena_id, sid, handle, offset, size_bytes, term, hold_ms, closed_ms, live = \
                    row(arena_item, 9, "kept arena")
                need(all(map(is_int, (arena_id, sid, handle, offset, size_bytes, term,
                                      hold_ms, live))) and is_opt_int(closed_ms)
                     and 0 < arena_id <= arena_seq and arena_id not in arenas
                     and arena_id not in kept_arenas and sid in {s.segment_id for s in record.segments}
                     and handle >= 0 and handle not in owned[sid] and term <= arena_term,
                     f"bad kept arena {arena_item!r:.80}")
                owned[sid][handle] = offset
                arena = Arena(arena_id, sid, handle, offset, size_bytes, term, hold_ms)
                arena.closed_ms = closed_ms
                arena.live = live
                kept_arenas[arena_id] = arena
                kept_parts[arena_id] = 0
                record.arenas.append(arena)
            for parked_item in seq_of(parked, "parked replicas"):
                ns, name, writer_id, started_ms, size_bytes, replica = \
                    row(parked_item, 6, "parked replica")
                need(is_str(ns) and is_str(name) and is_int(writer_id) and is_int(started_ms)
                     and is_int(size_bytes), "bad parked replica")
                record.parked.append(ParkedReplica(
                    (ns, name), writer_id, started_ms, size_bytes,
                    parse_kept_replica(replica, "parked replica")))
            for held_item in seq_of(held, "held ranges"):
                release_at, replica = row(held_item, 2, "held range")
                need(is_int(release_at), "bad held range")
                record.held.append((release_at, parse_kept_replica(replica, "held range")))
            down_nodes[node_id] = record
        need(all(kept_arenas[arena_id].live == count for arena_id, count in kept_parts.items()),
             "a kept arena's count of replicas does not match its replicas")

        for sid, ranges in owned.items():
            allocator = (segments.get(sid) or kept_segments[sid]).allocator
            need(allocator.allocation_count == len(ranges),
                 f"segment {sid}: {allocator.allocation_count} live ranges, {len(ranges)} owned")
            for handle, offset in ranges.items():
                try:
                    live_offset = allocator.allocation_offset(handle)
                except (ValueError, TypeError):
                    fail(f"segment {sid}: replica handle {handle} is not a live range")
                need(live_offset == offset, f"segment {sid}: replica offset {offset} != "
                                            f"{live_offset}")

        # Checked: install. Containers are refilled in place, so references to them stay valid.
        self.segments.clear()
        self.segments.update(segments)
        self.segment_list[:] = segment_list
        self._index_pools()
        self.nodes.clear()
        self.nodes.update(nodes)
        self.objects.clear()
        self.objects.update(objects)
        self.pending_order.clear()
        self.pending_order.update(pending_order)
        self._deferred = deferred
        self._deferred_seq = top["deferred_seq"]
        self.deferred_bytes = top["deferred_bytes"]
        self.clock_ms = top["clock_ms"]
        self.quotas.clear()
        self.quotas.update(quotas)
        self.preempted.clear()
        self.preempted.update(preempted)
        self._install_settings(settings)
        self.store_settings_from_log = settings_from_log
        self.generations.clear()
        self.generations.update(generations)
        self.down_nodes.clear()
        self.down_nodes.update(down_nodes)
        self.arenas.clear()
        self.arenas.update(arenas)
        self.arena_seq, self.arena_term = arena_seq, arena_term
        self.usage.clear()
        for ns, (used_bytes, used_objects) in self.count_usage().items():
            usage = self._usage_of(ns)
            usage.bytes, usage.objects = used_bytes, used_objects
