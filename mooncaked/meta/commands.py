"""The metadata commands: every mutation of the object and segment tables is one of these.

A command carries everything its effect depends on (the time, the seed for placement), so
applying the same sequence of commands to two state machines gives the same state. That is what
lets a replicated log carry them: on one node the master applies them at once; in a cluster the
leader proposes them to the Raft log and every node applies them in log order.
"""

from __future__ import annotations

from dataclasses import dataclass

ObjectKey = tuple[str, str]  # (namespace, key)

# The namespace of reservations: segment ranges granted to a local connection ahead of its puts
# (wire/PROTOCOL.md 5.2). A reservation is a PutStart under a key of this namespace, which no
# client can name ('#' is outside the namespace alphabet), and PutCommit moves it to a real key.
RESERVED_NAMESPACE = "#reserved"

# The pool of segments shared by every namespace that has no pool of its own
# (`[segments] namespace_pools`): a segment's `pool_namespace` is this, or the one namespace
# whose objects alone it holds.
SHARED_POOL = ""

# A cluster segment id is node_id << 40 | generation << 8 | index: the node id (16 bits), a
# mount generation (32 bits) and the segment's index on its node (8 bits). The log numbers the
# registrations of each node (every NodeUp of it: 1, 2, 3, ...; StateMachine.generations, kept
# across NodeDown and in snapshots), and the node mounts its segments under the generation its
# NodeUp got. So a node that registers again (restarted, or declared down and back) never
# mounts an id it had before, and a late write or read aimed at a range of an earlier mount
# names a segment that no longer exists and is refused, never landing in memory that was
# reallocated meanwhile. 2^32 registrations of one node do not happen in practice; the state
# machine refuses the one after.
# Ids below 1 << 40 are a single node's (node 0), or a cluster's in the layout of logs written
# before: node_id << 16 | 8-bit generation << 8 | index. They still decode (node and index);
# they name no generation, and no cluster writes new ones.
SEGMENT_SLOT_BITS = 8
SEGMENT_SLOT_MASK = (1 << SEGMENT_SLOT_BITS) - 1
SEGMENT_GENERATION_BITS = 32
MAX_GENERATION = (1 << SEGMENT_GENERATION_BITS) - 1
SEGMENT_NODE_SHIFT = SEGMENT_SLOT_BITS + SEGMENT_GENERATION_BITS
_LEGACY_NODE_SHIFT = 16


def segment_id_of(node_id: int, index: int, generation: int = 0) -> int:
    if not 0 <= generation <= MAX_GENERATION or not 0 <= index <= SEGMENT_SLOT_MASK:
        raise ValueError(f"segment id: generation {generation} or index {index} out of range")
    return (node_id << SEGMENT_NODE_SHIFT) | (generation << SEGMENT_SLOT_BITS) | index


def node_of_segment(segment_id: int) -> int:
    node_id = segment_id >> SEGMENT_NODE_SHIFT
    return node_id if node_id else segment_id >> _LEGACY_NODE_SHIFT


def slot_of_segment(segment_id: int) -> int:
    """The segment's index on its node (which of the node's segment memories holds it)."""
    return segment_id & SEGMENT_SLOT_MASK


def generation_of_segment(segment_id: int) -> int | None:
    """The mount generation a cluster segment id names; None for an id of the old layout or a
    single node's, which name none."""
    if segment_id >> SEGMENT_NODE_SHIFT == 0:
        return None
    return (segment_id >> SEGMENT_SLOT_BITS) & MAX_GENERATION


@dataclass(frozen=True, slots=True)
class MountSegment:
    segment_id: int
    name: str
    node_name: str
    size_bytes: int
    alignment_bytes: int
    max_allocations: int
    # SHARED_POOL, or the namespace whose pool this segment is: it holds that namespace's
    # objects and no other's. Last, with a default, so entries written before it still decode.
    pool_namespace: str = SHARED_POOL


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
    # The namespace whose pool receives the ranges; None = the key's own. A reservation's key
    # is in RESERVED_NAMESPACE, its ranges in the pool of the connection's namespace.
    owner_namespace: str | None = None


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
    # 0: the ranges are free at once. Else reused only after this: a replica write that timed
    # out may still land (a stalled node), and must not land in another object's range.
    release_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class PutCommit:
    """Make a writer's pending reservation the readable value of `object_key`, in one step.

    Fails without change if the key exists (readable, or being written and younger than the
    discard timeout): the reservation stays the writer's. A stale unfinished put of the key is
    preempted as by PutStart.
    """
    reserved_key: ObjectKey
    object_key: ObjectKey
    size_bytes: int  # must be the reservation's size
    soft_pin_ttl_ms: int | None  # None: no soft pin
    hard_pin: bool
    writer_id: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class AddReplicas:
    """Give an object's readable version the replicas a repair copied its bytes into.

    The copies were written into the ranges of a reservation (a PutStart under
    RESERVED_NAMESPACE, in the pool of the object's namespace); this moves those ranges into the
    version's replicas. Applied only while the version is still the one copied (same writer_id
    and started_ms), the reservation holds as many bytes on segments the version does not use,
    and the replicas stay within the replica_num it was put with. Otherwise nothing changes:
    an upsert or remove that came first is never undone, and the reservation stays its
    writer's to revoke.
    """
    object_key: ObjectKey
    writer_id: int  # of the version copied
    started_ms: int  # of the version copied
    reserved_key: ObjectKey
    reservation_writer_id: int


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


@dataclass(frozen=True, slots=True)
class NodeUp:
    """A node joined or came back: where its clients and peers reach it.

    Its result is the node's new mount generation (see segment_id_of): its segments are mounted
    under that one, and requests naming an earlier one are refused."""
    node_id: int
    name: str
    client_address: str  # host:port of its client listener
    peer_address: str  # host:port of its peer listener (Raft messages and replica bytes)


@dataclass(frozen=True, slots=True)
class NodeDown:
    """A node left or went silent past its TTL: its segments leave placement and reads.

    keep_until_ms 0: its segments and their replicas are dropped. Otherwise (a silent member,
    which may come back with its memory: `[cluster] node_return_grace_ms`) what it held is
    kept aside until then, its ranges still allocated, for a NodeReturn (StateMachine
    `down_nodes`). Last, with a default, so entries written before it still decode."""
    node_id: int
    keep_until_ms: int = 0


@dataclass(frozen=True, slots=True)
class NodeReturn:
    """A node declared down is back with the memory it had: the same process, which still
    holds the mount generation its segments had when it was declared down.

    Applied only while the log keeps that node's segments for that generation (NodeDown with
    keep_until_ms, no NodeUp or ReleaseDownNode since). The segments are mounted again under a
    new generation (the node's next, as for a NodeUp: a request naming the old one stays
    refused), and each replica it held goes back into its value if that version is still the
    readable one and has fewer replicas than its replica_num; every other range it held is
    freed after `release_at_ms` (read leases granted before it went down). Result: the new
    generation, or 0 when nothing was kept (the node registers anew, with a NodeUp). A repeat
    (the node asks again after an unknown outcome) finds the node up under the next
    generation: it answers that generation and changes nothing (what the log says the
    node's segments hold is right whether the first one or a NodeUp got there)."""
    node_id: int
    generation: int  # the one its segments had: proves it is the same process
    now_ms: int
    release_at_ms: int


@dataclass(frozen=True, slots=True)
class ReleaseDownNode:
    """A node declared down did not return in time (or is no member any more): what the log
    kept for it (NodeDown keep_until_ms) is dropped, as a NodeDown without keep would have.
    Applied only if what is kept is for `generation`."""
    node_id: int
    generation: int


# Namespace quotas (wire/PROTOCOL.md 5.3, README "Quotas"). A namespace is what a client names
# in hello; QUOTA_DEFAULT stands for every namespace with no quota of its own.
QUOTA_DEFAULT = "*"
_NAMESPACE_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                "0123456789._:/-")


def valid_namespace(value) -> bool:
    """A namespace a client may name: 1-255 characters of [A-Za-z0-9._:/-]."""
    return (type(value) is str and 1 <= len(value) <= 255
            and all(ch in _NAMESPACE_ALPHABET for ch in value))


def reservation_name(namespace: str, connection_id: int, number: int) -> str:
    """The key name of a reservation, under RESERVED_NAMESPACE: it carries the namespace of the
    connection that holds it, which the reserved bytes count against ('#' is outside the
    namespace alphabet, so the split is unambiguous)."""
    return f"{namespace}#{connection_id}/{number}"


def charged_namespace(key: ObjectKey) -> str:
    """The namespace whose quota an object's or reservation's bytes count against."""
    if key[0] == RESERVED_NAMESPACE:
        namespace, sep, _ = key[1].partition("#")
        return namespace if sep else RESERVED_NAMESPACE
    return key[0]


@dataclass(frozen=True, slots=True)
class SetQuota:
    """Set a namespace's limits (QUOTA_DEFAULT: those of every namespace without its own).

    0 = unlimited. Limits bound what new puts may add; what is stored stays (eviction takes
    from a namespace over its quota first).
    """
    namespace: str
    max_bytes: int
    max_objects: int


@dataclass(frozen=True, slots=True)
class MoveCommit:
    """Give `object_key`'s readable version the writer's reserved ranges (a copy of its bytes),
    only if that version is still the one copied: the same writer, start time and size.

    Result True: moved, the old ranges are reused only after `replaced_release_at_ms` (their
    read leases). False: the key was written, removed or lost since the copy; the reservation
    is dropped and its ranges are free at once (the mover commits after its writes finished).
    A write in progress of the key is left alone either way.
    """
    reserved_key: ObjectKey
    object_key: ObjectKey
    writer_id: int  # the reservation's
    version_writer_id: int  # the copied version's
    version_started_ms: int
    now_ms: int
    replaced_release_at_ms: int


@dataclass(frozen=True, slots=True)
class SetStoreSettings:
    """The `[store]` values the state machine decides by, the same on every node (a cluster's
    come from its log, not from each node's config). Names and bounds as in `[store]`."""
    max_objects: int
    put_start_discard_timeout_ms: int
    put_start_release_timeout_ms: int
    allocation_strategy: str


# Arenas: how a cluster's put takes one log command (ArenaPut) instead of two (PutStart and
# PutEnd). The state machine's allocator is deterministic and has no allocate-at-offset, so the
# leader cannot pick a range by itself and have followers take the same one; it can take a
# large range (an arena) through the log, and then hand out parts of it without the log.
#
# - ReserveArena takes an arena in a segment for the leader of `term`; only that leader hands
#   out parts of it, each part to one put only (it never hands a part out twice).
# - The put's writer fills its parts, then ArenaPut records the object with its parts as
#   replicas (arena + offset), in one command. A put that is revoked or never ends needs no
#   command: its parts are simply never handed out again.
# - An arena is closed by its leader when full (CloseArenas) and by the first arena command of
#   a later term (a new leader never hands out parts of an older term's arena: a writer of the
#   old leader may still be filling them). A closed arena returns to the allocator once no
#   object uses a part of it and its hold time (`hold_ms`: the longest a late replica write
#   can take) has passed since it closed.
# So no range is written by two writers: the replicated allocator never gives an arena's range
# to anything else while the arena lives, and within an arena one leader hands out each part
# once; after the arena is freed, every write aimed at it is late by more than the hold time.


@dataclass(frozen=True, slots=True)
class ReserveArena:
    """Take `size_bytes` of a segment as an arena of the leader of `term`; the result is
    (arena id, offset). Closes every arena of an earlier term."""
    segment_id: int
    size_bytes: int
    term: int
    hold_ms: int  # a closed arena is freed no sooner than this after it closed
    now_ms: int


@dataclass(frozen=True, slots=True)
class CloseArenas:
    """Close the listed arenas (full: their leader hands out no more parts of them), each held
    at most `hold_ms` (0 when every put with a part in it has ended), and every arena of a term
    before `term` (with the hold it was reserved with)."""
    term: int
    arena_ids: tuple[int, ...]
    hold_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class ArenaPut:
    """A whole put: `object_key` becomes readable with the replicas its writer filled, parts of
    arenas of `term` given as (arena id, offset), each `size_bytes` long.

    A put fails if the key exists, or is being written by a PutStart younger than the discard
    timeout; an upsert replaces the readable version (its old bytes are reused only after
    `replaced_release_at_ms`) unless a later-started upsert of the key has completed: then it
    succeeds without change (the last upsert to start wins). Refused when the put started more
    than the release timeout ago (its parts may be in a freed arena), or an arena is not one of
    `term`'s."""
    object_key: ObjectKey
    size_bytes: int
    replica_num: int  # asked for (repair restores it)
    replicas: tuple[tuple[int, int], ...]
    soft_pin_ttl_ms: int | None  # None: no soft pin
    hard_pin: bool
    upsert: bool
    writer_id: int
    started_ms: int
    now_ms: int
    replaced_release_at_ms: int
    term: int


# The disk tier (README "SSD tier"): a readable version may have a copy on one node's disk
# (state_machine.DiskReplica) besides its DRAM replicas, and stays readable while it has either.


@dataclass(frozen=True, slots=True)
class AddDiskReplica:
    """Record that `node_id` wrote the readable version of `object_key` to its disk tier, at
    (region, offset), `size_bytes` long, under `disk_version` (the record's version on disk).

    Applied only while that version is still the readable one (same writer_id and started_ms,
    same size) and has no disk copy; result True. Otherwise nothing changes and the result is
    False: the writer then drops the record it wrote. `recovered`: a record found on disk at
    start; it becomes the key's readable version (disk-only, writer_id and started_ms as
    given) when the key has no entry at all, and is refused (False) otherwise."""
    object_key: ObjectKey
    writer_id: int
    started_ms: int
    node_id: int
    region: int
    offset: int
    size_bytes: int
    disk_version: int
    recovered: bool = False


@dataclass(frozen=True, slots=True)
class DropDiskReplica:
    """Forget the disk copy of `object_key`'s readable version that `node_id` holds at
    (region, offset): reclaimed, unreadable, or its node lost its disk. A version left with
    no DRAM replica is gone (the object with it). Result: whether a copy was dropped."""
    object_key: ObjectKey
    node_id: int
    region: int
    offset: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Several commands in one log entry (group commit: one entry, one write and one sync for
    the commands proposed while the log was busy). Applied in order, each with its own result:
    the result is a list holding, for each command, its result or the MooncakedError it
    failed with (one failing changes nothing for the others)."""
    commands: tuple
