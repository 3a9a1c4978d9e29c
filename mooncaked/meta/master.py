"""The master: store semantics on top of the replicated state machine.

Two parts. `MasterPolicy` reads the state and decides: read leases, the access order used for
eviction, which objects an eviction takes, quota reports, the checks of a put's config. That is
what is local to a master and never replicated, and it changes nothing in the state machine.
`Master`, a single node's, adds the mutators, which apply their commands to the state at once
(`propose`). A cluster's master (cluster/master.py) builds on the policy alone and turns every
mutation into a log command, so that no call on it changes a node's state outside the log.

Time is passed in (`now_ms`, a monotonic clock in milliseconds); nothing here reads a clock.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import Replica, StateMachine, Version


@dataclass(frozen=True, slots=True)
class ReplicateConfig:
    replica_num: int = 1
    preferred_segments: tuple[str, ...] = ()
    soft_pin_ttl_ms: int | None = None  # None: no soft pin
    hard_pin: bool = False
    # Write the value to the disk tier at put end as well (None: as [ssd] write_through says).
    write_through: bool | None = None


@dataclass
class EvictionStats:
    runs: int = 0
    objects: int = 0
    bytes: int = 0
    # With a disk tier: objects dropped that had no disk copy (the others keep it), and
    # objects whose DRAM replicas were freed because a disk copy holds their bytes.
    without_offload: int = 0
    to_disk: int = 0


class MasterPolicy:
    """Reads and decisions over the state; never changes the state machine."""

    def __init__(self, state: StateMachine, store_config: StoreConfig, seed: int = 0) -> None:
        self.state = state
        self.config = store_config
        self.lease_ttl_ms = store_config.lease_ttl_ms
        # Complete, evictable-in-principle objects in order of last access; the value is the
        # end of the object's read lease (or the time it became readable, if never read).
        # Leases all have the same length, so this is oldest-lease-first order.
        self.access: dict[c.ObjectKey, int] = {}
        self.evictions = EvictionStats()
        self._rng = random.Random(seed)
        # The disk tier (daemon/tiering.py): `tiered` makes eviction take objects with a disk
        # copy first (it frees their DRAM only); `offloading` are objects being written to
        # disk, whose DRAM replicas eviction leaves alone until the copy is recorded.
        self.tiered = False
        self.offloading: set[c.ObjectKey] = set()

    # -- leases -----------------------------------------------------------------------------

    def _grant_lease(self, key: c.ObjectKey, now_ms: int) -> None:
        access = self.access
        expiry = now_ms + self.lease_ttl_ms
        previous = access.pop(key, 0)
        access[key] = expiry if expiry > previous else previous

    def lease_end_ms(self, key: c.ObjectKey) -> int:
        return self.access.get(key, 0)

    def leased(self, key: c.ObjectKey, now_ms: int) -> bool:
        return self.access.get(key, 0) > now_ms

    def active_leases(self, now_ms: int) -> int:
        return sum(1 for expiry in self.access.values() if expiry > now_ms)

    # -- reads ------------------------------------------------------------------------------

    def get(self, key: c.ObjectKey, now_ms: int) -> Version | None:
        """The readable version of a key, leased for one TTL; None when there is none."""
        entry = self.state.objects.get(key)
        if entry is None or entry.complete is None:
            return None
        self._grant_lease(key, now_ms)
        return entry.complete

    def exists(self, key: c.ObjectKey, now_ms: int) -> bool:
        return self.get(key, now_ms) is not None

    def puts_in_progress(self) -> int:
        """Unfinished puts (reservations included)."""
        return len(self.state.pending_order)

    # -- writes -----------------------------------------------------------------------------

    def check_replicate_config(self, config: ReplicateConfig) -> None:
        if config.replica_num < 1:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "replica_num must be at least 1")
        ttl = config.soft_pin_ttl_ms
        if ttl is not None and not 1 <= ttl <= self.config.max_soft_pin_ttl_ms:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"soft_pin_ttl_ms must be in 1..{self.config.max_soft_pin_ttl_ms}")

    # -- quotas -------------------------------------------------------------------------------

    def quota_command(self, namespace: str, max_bytes: int | None,
                      max_objects: int | None) -> c.SetQuota:
        current = self.state.quotas.get(namespace, (0, 0))
        return c.SetQuota(namespace, current[0] if max_bytes is None else max_bytes,
                          current[1] if max_objects is None else max_objects)

    def quota_report(self) -> list[dict]:
        """Every namespace with a quota of its own or something stored, and the default."""
        state = self.state
        names = [n for n in state.quotas if n != c.QUOTA_DEFAULT]
        names += sorted(n for n in state.usage if n not in state.quotas)
        default = state.quotas.get(c.QUOTA_DEFAULT, (0, 0))
        report = [{"namespace": c.QUOTA_DEFAULT, "bytes": 0, "objects": 0,
                   "max_bytes": default[0], "max_objects": default[1], "own_quota": True}]
        for namespace in names:
            usage = state.usage.get(namespace)
            max_bytes, max_objects = state.quota_of(namespace)
            report.append({"namespace": namespace,
                           "bytes": usage.bytes if usage else 0,
                           "objects": usage.objects if usage else 0,
                           "max_bytes": max_bytes, "max_objects": max_objects,
                           "own_quota": namespace in state.quotas})
        return report

    # -- eviction ---------------------------------------------------------------------------

    def choose_evictions(self, now_ms: int, need_bytes: int = 0, need_objects: int = 0,
                         pool: str | None = None) -> list[c.ObjectKey]:
        """What one eviction run takes, oldest lease first.

        About `eviction_ratio` of the capacity (more when further over the watermark), never a
        leased, being-written or hard-pinned object. Objects of namespaces over their quota
        go first, until each is back within it; soft-pinned objects are taken only in a last
        pass, when the others freed less than the lower bound.
        """
        state, config = self.state, self.config
        if pool is None:
            capacity, used = state.capacity_bytes(), state.used_bytes()
        else:
            segments = state.pool_segments(pool)
            capacity = sum(s.allocator.capacity_bytes for s in segments)
            used = sum(s.allocator.used_bytes for s in segments)
        if capacity == 0:
            return []
        used_ratio = used / capacity
        high = config.eviction_high_watermark_ratio
        over_objects = len(state.objects) - state.max_objects + need_objects
        if used_ratio <= high and need_bytes == 0 and over_objects <= 0:
            return []
        target_ratio = max(config.eviction_ratio, used_ratio - high + config.eviction_ratio)
        target_bytes = max(int(target_ratio * capacity), need_bytes)
        lower_bytes = max(int(max(target_ratio * 0.5, used_ratio - high) * capacity), need_bytes)
        chosen: list[c.ObjectKey] = []
        freed = 0
        if self.tiered:
            freed = self._select_offloaded(now_ms, chosen, target_bytes, pool)
        freed += self._select_over_quota(now_ms, chosen, target_bytes - freed, over_objects,
                                         pool)
        freed += self._select(now_ms, chosen, target_bytes - freed, over_objects, False, pool)
        if freed < lower_bytes or len(chosen) < over_objects:
            freed += self._select(now_ms, chosen, target_bytes - freed,
                                  over_objects - len(chosen), True, pool)
        if self.offloading and (freed < lower_bytes or len(chosen) < over_objects):
            # Last, objects being written to disk: the write goes on from its own copy of the
            # value, and is discarded when it ends (the object is gone by then).
            self._select(now_ms, chosen, target_bytes - freed, over_objects - len(chosen),
                         None, pool)
        return chosen

    def _select_offloaded(self, now_ms: int, chosen: list, want_bytes: int,
                          pool: str | None) -> int:
        """Oldest lease first, objects whose bytes are on disk too: eviction frees their DRAM
        replicas and they stay readable. Never leased, pinned or soft-pinned ones."""
        objects = self.state.objects
        pool_of = self.state.pool_of
        freed = 0
        for key, lease_end in self.access.items():
            if freed >= want_bytes:
                break
            if lease_end > now_ms or (pool is not None and pool_of(key[0]) != pool):
                continue
            entry = objects.get(key)
            version = entry.complete if entry is not None else None
            if version is None or version.disk is None or not version.replicas \
                    or entry.hard_pin or entry.soft_pinned(now_ms):
                continue
            chosen.append(key)
            freed += version.size_bytes * len(version.replicas)
        return freed

    def _evictable(self, key: c.ObjectKey, entry) -> bool:
        """Whether eviction may take the object's DRAM replicas in its usual passes (hard
        pins apart): it has some, and is not being written to disk."""
        return entry.complete.replicas and key not in self.offloading

    def _select_over_quota(self, now_ms: int, chosen: list, want_bytes: int,
                           want_objects: int, pool: str | None) -> int:
        """Oldest lease first, objects of namespaces over their quota, while each still is
        (only those whose objects lie in `pool`, when one is named)."""
        excess = {ns: list(over) for ns, over in self.state.namespaces_over_quota().items()
                  if pool is None or self.state.pool_of(ns) == pool}
        objects = self.state.objects
        taken = set(chosen)
        freed = 0
        for key, lease_end in self.access.items():
            if not excess or (freed >= want_bytes and len(chosen) >= want_objects):
                break
            rest = excess.get(key[0])
            if rest is None or lease_end > now_ms:
                continue
            entry = objects.get(key)
            if entry is None or entry.complete is None or entry.hard_pin \
                    or entry.soft_pinned(now_ms) or not self._evictable(key, entry) \
                    or key in taken:
                continue
            chosen.append(key)
            size = entry.complete.size_bytes * len(entry.complete.replicas)
            freed += size
            rest[0] -= size
            rest[1] -= 1
            if rest[0] <= 0 and rest[1] <= 0:
                del excess[key[0]]
        return freed

    def _select(self, now_ms: int, chosen: list, want_bytes: int, want_objects: int,
                soft_pinned: bool | None, pool: str | None) -> int:
        """Oldest lease first, objects soft-pinned or not (`soft_pinned`); None: objects
        being written to disk, pinned or not."""
        offloading = self.offloading
        objects = self.state.objects
        pool_of = self.state.pool_of
        taken = set(chosen)
        freed = 0
        for key, lease_end in self.access.items():
            if freed >= want_bytes and len(chosen) >= want_objects:
                break
            if lease_end > now_ms or key in taken:
                continue
            if pool is not None and pool_of(key[0]) != pool:
                continue
            entry = objects.get(key)
            if entry is None or entry.complete is None or entry.hard_pin \
                    or not entry.complete.replicas:
                continue
            if soft_pinned is None:
                if key not in offloading:
                    continue
            elif key in offloading or entry.soft_pinned(now_ms) != soft_pinned:
                continue
            chosen.append(key)
            freed += entry.complete.size_bytes * len(entry.complete.replicas)
        return freed


class Master(MasterPolicy):
    """A single node's master: every mutation applies its command to the state at once.

    `released`, when a list (a disk tier is on): every readable version that a remove or an
    upsert took out of the state is appended, with its key, so that the caller drops its disk
    copy (or waits for the one being written) before it answers."""

    released: list | None = None
    # Write-through (daemon/tiering.py): with `write_through_puts` a set, each put that asks
    # for it (ReplicateConfig.write_through, None = `write_through_default`) is noted at its
    # start, and `on_write_through(key)` is called when it ends.
    write_through_puts: set | None = None
    write_through_default = False
    on_write_through = None

    def _wants_write_through(self, config: ReplicateConfig) -> bool:
        return self.write_through_puts is not None and (
            self.write_through_default if config.write_through is None
            else config.write_through)

    def propose(self, command):
        return self.state.apply(command)

    # -- writes -----------------------------------------------------------------------------

    def put_start(self, key: c.ObjectKey, size_bytes: int, config: ReplicateConfig,
                  upsert: bool, writer_id: int, now_ms: int,
                  owner_namespace: str | None = None) -> list[Replica]:
        """Start a put; its ranges lie in the pool of `owner_namespace` (None: the key's
        namespace), and only that pool is evicted from to make room."""
        if size_bytes <= 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "a value must have at least 1 byte")
        command = c.PutStart(key, size_bytes, config.replica_num, config.preferred_segments,
                             config.soft_pin_ttl_ms, config.hard_pin, upsert, writer_id, now_ms,
                             self._rng.getrandbits(32), owner_namespace)
        try:
            replicas = self.propose(command)
        except MooncakedError as exc:
            if exc.code != ErrorCode.NO_AVAILABLE_HANDLE:
                raise
            # No room: evict what may be evicted, at least enough for this value, and try
            # once more.
            pool = self.state.pool_of(key[0] if owner_namespace is None else owner_namespace)
            self.evict(now_ms, need_bytes=size_bytes * config.replica_num, need_objects=1,
                       pool=self._eviction_pool(pool))
            replicas = self.propose(command)
        if key[0] != c.RESERVED_NAMESPACE and self._wants_write_through(config):
            self.write_through_puts.add((key, writer_id))
        return replicas

    def put_end(self, key: c.ObjectKey, writer_id: int, now_ms: int) -> None:
        # An upsert's old bytes stay until the end of the key's current read lease.
        replaced_release_at = max(now_ms, self.lease_end_ms(key))
        replaced = self.propose(c.PutEnd(key, writer_id, now_ms, replaced_release_at))
        self.access.pop(key, None)
        self.access[key] = now_ms
        if replaced is not None and self.released is not None:
            self.released.append((key, replaced))
        if self.write_through_puts and (key, writer_id) in self.write_through_puts:
            self.write_through_puts.discard((key, writer_id))
            self.on_write_through(key)

    def put_commit(self, reserved_key: c.ObjectKey, key: c.ObjectKey, size_bytes: int,
                   config: ReplicateConfig, writer_id: int, now_ms: int) -> None:
        """Store a reserved range as `key` (one replica); OBJECT_ALREADY_EXISTS if it exists."""
        if config.replica_num != 1 or config.preferred_segments:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 "a reserved range is one replica: replica_num must be 1 "
                                 "and preferred_segments empty")
        self.propose(c.PutCommit(reserved_key, key, size_bytes, config.soft_pin_ttl_ms,
                                 config.hard_pin, writer_id, now_ms))
        self.access.pop(key, None)
        self.access[key] = now_ms
        if self._wants_write_through(config):
            self.on_write_through(key)

    def put_revoke(self, key: c.ObjectKey, writer_id: int) -> None:
        if self.write_through_puts:
            self.write_through_puts.discard((key, writer_id))
        self.propose(c.PutRevoke(key, writer_id))

    # -- removal ----------------------------------------------------------------------------

    def remove(self, key: c.ObjectKey, force: bool, now_ms: int) -> None:
        entry = self.state.objects.get(key)
        if entry is not None and entry.complete is not None and not force \
                and self.leased(key, now_ms):
            raise MooncakedError(ErrorCode.OBJECT_HAS_LEASE, "the object has a read lease")
        # A forced remove hides the object now; its bytes stay until the lease ends.
        removed = self.propose(c.Remove(key, max(now_ms, self.lease_end_ms(key))))
        self.access.pop(key, None)
        if self.released is not None:
            self.released.append((key, removed))

    def remove_matching(self, namespace: str | None, pattern: re.Pattern | None, force: bool,
                        now_ms: int) -> int:
        """Remove readable objects of a namespace (all if None) whose key matches the pattern.

        Leased objects are skipped unless forced; objects being written are always skipped.
        """
        selected = [key for key, entry in self.state.objects.items()
                    if entry.complete is not None
                    and (namespace is None or key[0] == namespace)
                    and (pattern is None or pattern.search(key[1]))
                    and (force or not self.leased(key, now_ms))]
        for key in selected:
            removed = self.propose(c.Remove(key, max(now_ms, self.lease_end_ms(key))))
            self.access.pop(key, None)
            if self.released is not None:
                self.released.append((key, removed))
        return len(selected)

    # -- quotas, expiry and eviction ----------------------------------------------------------

    def set_quota(self, namespace: str, max_bytes: int | None, max_objects: int | None) -> None:
        """Set a namespace's limits (None keeps the current one, 0 = unlimited)."""
        self.propose(self.quota_command(namespace, max_bytes, max_objects))

    def tick(self, now_ms: int) -> int:
        """The periodic sweep: deadlines first, then eviction above the high watermark.
        Returns what the deadlines released (ranges and unfinished puts)."""
        released = self.propose(c.ReleaseExpired(now_ms))
        if not self.state.pool_namespaces:
            self.evict(now_ms)
        else:  # each pool against its own watermark: one pool's use frees nothing in another
            for pool in self.state.pools():
                self.evict(now_ms, pool=pool)
        return released

    def _eviction_pool(self, pool: str) -> str | None:
        return pool if self.state.pool_namespaces else None

    def evict(self, now_ms: int, need_bytes: int = 0, need_objects: int = 0,
              pool: str | None = None) -> int:
        """Evict oldest-lease-first when usage is over the high watermark, or `need_*` asks.

        `pool`: only objects of that pool, against its own capacity (None: the whole store).
        Returns the number of objects evicted.
        """
        chosen = self.choose_evictions(now_ms, need_bytes, need_objects, pool)
        if not chosen:
            return 0
        objects = self.state.objects
        to_disk = sum(1 for key in chosen if objects[key].complete.disk is not None)
        freed_bytes = self.propose(c.Evict(tuple(chosen)))
        for key in chosen:
            self.access.pop(key, None)
        self.evictions.runs += 1
        self.evictions.objects += len(chosen)
        self.evictions.bytes += freed_bytes
        self.evictions.to_disk += to_disk
        if self.tiered:
            self.evictions.without_offload += len(chosen) - to_disk
        return len(chosen)
