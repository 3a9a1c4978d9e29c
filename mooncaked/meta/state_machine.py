"""The metadata state machine: segments, objects, replicas, pins, and what waits to be freed.

Pure and deterministic: no I/O, no clock, no randomness of its own; time and seeds come in the
commands (meta/commands.py). Failures raise MooncakedError, which is the command's result.
Read leases are not here: they are the master's, local to it (meta/leases.py).

Invariants it keeps (checked by `check_invariants`, used by the tests):
- no two live ranges overlap in a segment (the allocator's guarantee, never bypassed);
- a pending (being written) version is never what readers see;
- every range is owned by exactly one of: a complete version, a pending version, the deferred
  release list; freeing happens only through `_release`.
"""

from __future__ import annotations

import heapq
from typing import Callable

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.placement import place


class Segment:
    __slots__ = ("segment_id", "name", "node_name", "size_bytes", "allocator", "mounted")

    def __init__(self, segment_id: int, name: str, node_name: str, size_bytes: int,
                 allocator) -> None:
        self.segment_id = segment_id
        self.name = name
        self.node_name = node_name
        self.size_bytes = size_bytes
        self.allocator = allocator
        self.mounted = True

    def allocate(self, size_bytes: int):
        return self.allocator.allocate(size_bytes)

    def free_ratio(self) -> float:
        return self.allocator.free_bytes / self.allocator.capacity_bytes


class Replica:
    __slots__ = ("segment_id", "offset", "handle")

    def __init__(self, segment_id: int, offset: int, handle: int) -> None:
        self.segment_id = segment_id
        self.offset = offset
        self.handle = handle


class Version:
    """One value of an object: its size and the replicas holding its bytes."""
    __slots__ = ("size_bytes", "replicas", "writer_id", "started_ms")

    def __init__(self, size_bytes: int, replicas: list[Replica], writer_id: int,
                 started_ms: int) -> None:
        self.size_bytes = size_bytes
        self.replicas = replicas
        self.writer_id = writer_id
        self.started_ms = started_ms


class ObjectEntry:
    __slots__ = ("complete", "pending", "hard_pin", "soft_pin_ttl_ms", "soft_pin_deadline_ms",
                 "created_ms")

    def __init__(self, hard_pin: bool, created_ms: int) -> None:
        self.complete: Version | None = None  # what readers see
        self.pending: Version | None = None  # a put or upsert being written
        self.hard_pin = hard_pin
        self.soft_pin_ttl_ms: int | None = None  # asked by the pending write
        self.soft_pin_deadline_ms: int | None = None
        self.created_ms = created_ms

    def soft_pinned(self, now_ms: int) -> bool:
        return self.soft_pin_deadline_ms is not None and now_ms < self.soft_pin_deadline_ms


AllocatorFactory = Callable[[int, int, int], object]  # (size, alignment, max_allocations)


class StateMachine:
    def __init__(self, allocator_factory: AllocatorFactory, *, max_objects: int,
                 put_start_discard_timeout_ms: int, put_start_release_timeout_ms: int,
                 allocation_strategy: str = "random") -> None:
        self._allocator_factory = allocator_factory
        self.max_objects = max_objects
        self.discard_timeout_ms = put_start_discard_timeout_ms
        self.release_timeout_ms = put_start_release_timeout_ms
        self.allocation_strategy = allocation_strategy
        self.segments: dict[int, Segment] = {}
        self.segment_list: list[Segment] = []
        self.objects: dict[c.ObjectKey, ObjectEntry] = {}
        # Unfinished writes in start order (the clock is monotonic), for the release sweep.
        self.pending_order: dict[c.ObjectKey, int] = {}
        # Ranges waiting for a deadline before reuse: heap of (release_at_ms, seq, replicas).
        self._deferred: list[tuple[int, int, list[Replica]]] = []
        self._deferred_seq = 0
        self.deferred_bytes = 0
        self._apply = {
            c.MountSegment: self._mount_segment,
            c.UnmountSegment: self._unmount_segment,
            c.PutStart: self._put_start,
            c.PutEnd: self._put_end,
            c.PutRevoke: self._put_revoke,
            c.Remove: self._remove,
            c.Evict: self._evict,
            c.ReleaseExpired: self._release_expired,
        }

    def apply(self, command):
        return self._apply[type(command)](command)

    # -- segments ---------------------------------------------------------------------------

    def _mount_segment(self, cmd: c.MountSegment) -> None:
        if cmd.segment_id in self.segments:
            raise MooncakedError(ErrorCode.SEGMENT_ALREADY_EXISTS, f"segment {cmd.segment_id}")
        allocator = self._allocator_factory(cmd.size_bytes, cmd.alignment_bytes,
                                            cmd.max_allocations)
        segment = Segment(cmd.segment_id, cmd.name, cmd.node_name, cmd.size_bytes, allocator)
        self.segments[cmd.segment_id] = segment
        self.segment_list.append(segment)

    def _unmount_segment(self, cmd: c.UnmountSegment) -> int:
        """Drop the segment and every replica on it; objects left without one are erased."""
        segment = self.segments.pop(cmd.segment_id, None)
        if segment is None:
            return 0
        segment.mounted = False
        self.segment_list.remove(segment)
        lost = 0
        for key, entry in list(self.objects.items()):
            for version in (entry.complete, entry.pending):
                if version is not None:
                    version.replicas = [r for r in version.replicas
                                        if r.segment_id != cmd.segment_id]
            if entry.complete is not None and not entry.complete.replicas:
                entry.complete = None
            if entry.pending is not None and not entry.pending.replicas:
                entry.pending = None
                self.pending_order.pop(key, None)
            if entry.complete is None and entry.pending is None:
                del self.objects[key]
                lost += 1
        kept = []
        for release_at, seq, replicas in self._deferred:
            replicas = [r for r in replicas if r.segment_id != cmd.segment_id]
            if replicas:
                kept.append((release_at, seq, replicas))
        heapq.heapify(kept)
        self._deferred = kept
        self.deferred_bytes = sum(self._size_of(rs) for _, _, rs in kept)
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
        placed = place(self.segment_list, cmd.size_bytes, cmd.replica_num,
                       cmd.preferred_segments, self.allocation_strategy, cmd.seed)
        if not placed:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"no segment has {cmd.size_bytes} free bytes")
        if entry is not None and entry.pending is not None:
            # Preempt the unfinished write: its writer may still be copying into its ranges, so
            # they are reused only after the release timeout, as in Mooncake Store.
            self._defer(entry.pending.replicas,
                        entry.pending.started_ms + self.release_timeout_ms)
            entry.pending = None
            del self.pending_order[key]
        if entry is None:
            entry = ObjectEntry(cmd.hard_pin, cmd.now_ms)
            self.objects[key] = entry
        replicas = [Replica(segment.segment_id, offset, handle)
                    for segment, offset, handle in placed]
        entry.pending = Version(cmd.size_bytes, replicas, cmd.writer_id, cmd.now_ms)
        entry.soft_pin_ttl_ms = cmd.soft_pin_ttl_ms
        self.pending_order[key] = cmd.now_ms
        return replicas

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
        entry = self._owned_pending(cmd.object_key, cmd.writer_id)
        replaced = entry.complete
        if replaced is not None:
            # The old bytes may be under a read lease; the master says until when.
            self._defer(replaced.replicas, cmd.replaced_release_at_ms)
        entry.complete, entry.pending = entry.pending, None
        del self.pending_order[cmd.object_key]
        if entry.soft_pin_ttl_ms is not None:
            entry.soft_pin_deadline_ms = cmd.now_ms + entry.soft_pin_ttl_ms
            entry.soft_pin_ttl_ms = None
        return replaced

    def _put_revoke(self, cmd: c.PutRevoke) -> None:
        entry = self._owned_pending(cmd.object_key, cmd.writer_id)
        self._drop_pending(cmd.object_key, entry)

    def _drop_pending(self, key: c.ObjectKey, entry: ObjectEntry) -> None:
        self._release(entry.pending.replicas)
        entry.pending = None
        del self.pending_order[key]
        if entry.complete is None:
            del self.objects[key]

    # -- removal ----------------------------------------------------------------------------

    def _remove(self, cmd: c.Remove) -> Version:
        entry = self.objects.get(cmd.object_key)
        if entry is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        if entry.complete is None:
            raise MooncakedError(ErrorCode.REPLICA_IS_NOT_READY, "the object is being written")
        removed = entry.complete
        self._defer(removed.replicas, cmd.release_at_ms)
        if entry.pending is not None:  # an upsert in flight: its write loses its key too
            self._drop_pending(cmd.object_key, entry)
        del self.objects[cmd.object_key]
        return removed

    def _evict(self, cmd: c.Evict) -> int:
        """Drop the complete versions of the given keys; returns the bytes freed."""
        freed = 0
        for key in cmd.object_keys:
            entry = self.objects.get(key)
            if entry is None or entry.complete is None:
                continue
            freed += self._release(entry.complete.replicas)
            entry.complete = None
            if entry.pending is None:
                del self.objects[key]
        return freed

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
        return released

    # -- ranges -----------------------------------------------------------------------------

    def _defer(self, replicas: list[Replica], release_at_ms: int) -> None:
        self._deferred_seq += 1
        heapq.heappush(self._deferred, (release_at_ms, self._deferred_seq, replicas))
        self.deferred_bytes += self._size_of(replicas)

    def _size_of(self, replicas: list[Replica]) -> int:
        return sum(self.segments[r.segment_id].allocator.allocation_size(r.handle)
                   for r in replicas if r.segment_id in self.segments)

    def _release(self, replicas: list[Replica]) -> int:
        freed = 0
        for replica in replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is not None:
                freed += segment.allocator.free(replica.handle)
        return freed

    # -- queries ----------------------------------------------------------------------------

    def readable(self, key: c.ObjectKey) -> Version | None:
        entry = self.objects.get(key)
        return entry.complete if entry is not None else None

    def used_bytes(self) -> int:
        return sum(s.allocator.used_bytes for s in self.segment_list)

    def capacity_bytes(self) -> int:
        return sum(s.allocator.capacity_bytes for s in self.segment_list)

    def check_invariants(self) -> None:
        """Every live range is owned exactly once and the allocators agree (tests use this)."""
        owned: dict[int, list[tuple[int, int]]] = {sid: [] for sid in self.segments}
        for key, entry in self.objects.items():
            assert entry.complete is not None or entry.pending is not None, key
            assert (entry.pending is not None) == (key in self.pending_order), key
            for version in (entry.complete, entry.pending):
                if version is not None:
                    segment_ids = [r.segment_id for r in version.replicas]
                    assert len(set(segment_ids)) == len(segment_ids), key
                    for r in version.replicas:
                        owned[r.segment_id].append((r.offset, r.handle))
        for _, _, replicas in self._deferred:
            for r in replicas:
                owned[r.segment_id].append((r.offset, r.handle))
        for segment_id, ranges in owned.items():
            allocator = self.segments[segment_id].allocator
            assert allocator.allocation_count == len(ranges), (
                segment_id, allocator.allocation_count, len(ranges))
            spans = sorted((offset, offset + allocator.allocation_size(handle))
                           for offset, handle in ranges)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert end <= start, f"overlapping ranges in segment {segment_id}"
            assert allocator.used_bytes == sum(e - s for s, e in spans)
