"""The metadata commands: every mutation of the object and segment tables is one of these.

A command carries everything its effect depends on (the time, the seed for placement), so
applying the same sequence of commands to two state machines gives the same state. That is what
lets a replicated log carry them: on one node the master applies them at once; in a cluster the
leader proposes them to the Raft log and every node applies them in log order.
"""

from __future__ import annotations

from dataclasses import dataclass

ObjectKey = tuple[str, str]  # (namespace, key)


@dataclass(frozen=True, slots=True)
class MountSegment:
    segment_id: int
    name: str
    node_name: str
    size_bytes: int
    alignment_bytes: int
    max_allocations: int


@dataclass(frozen=True, slots=True)
class UnmountSegment:
    segment_id: int


@dataclass(frozen=True, slots=True)
class PutStart:
    object_key: ObjectKey
    size_bytes: int
    replica_num: int
    preferred_segments: tuple[str, ...]
    soft_pin_ttl_ms: int | None  # None: no soft pin
    hard_pin: bool
    upsert: bool
    writer_id: int
    now_ms: int
    seed: int


@dataclass(frozen=True, slots=True)
class PutEnd:
    object_key: ObjectKey
    writer_id: int
    now_ms: int
    replaced_release_at_ms: int  # an upsert's old bytes are reused only after this


@dataclass(frozen=True, slots=True)
class PutRevoke:
    object_key: ObjectKey
    writer_id: int


@dataclass(frozen=True, slots=True)
class Remove:
    object_key: ObjectKey
    release_at_ms: int  # the object's memory is reused only after this (its read lease's end)


@dataclass(frozen=True, slots=True)
class Evict:
    object_keys: tuple[ObjectKey, ...]


@dataclass(frozen=True, slots=True)
class ReleaseExpired:
    """Free what waits for a deadline: released ranges and unfinished puts past their timeout."""
    now_ms: int
