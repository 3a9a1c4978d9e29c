"""The store's use of its disk tier (README "SSD tier"): offload, eviction to disk, reads of
disk-only values, promotion, removal and recovery, on a single node.

The disk tier itself (mooncaked/ssd/tier.py, `DiskTier`) stores records and knows nothing of
objects. This module keeps the metadata in step with it, through the same commands a cluster's
log carries (AddDiskReplica, DropDiskReplica, AddReplicas):

- **Offload (write-behind).** While DRAM use is above `offload_watermark_ratio`, each sweep
  writes the coldest readable objects without a disk copy to disk, at most
  `offload_bytes_in_flight` at a time. A value is copied out of its DRAM replica when its write
  starts (so nothing that reuses that memory later can change what is written), and eviction
  leaves the object's DRAM alone until the copy is recorded (`Master.offloading`). Then
  AddDiskReplica records the copy, if the version is still the readable one; else the record
  is dropped again. Eviction (meta/master.py) takes objects with a disk copy first and frees
  only their DRAM: they stay readable, disk-only.
- **Write-through.** A put that asks for it (ReplicateConfig.write_through, or `[ssd]
  write_through`) is offloaded the same way as soon as it ends, whatever the watermark.
- **Reads.** A disk-only value is read by the daemon: into the reply for a socket read, into
  a DRAM range it reserves for a shared-memory read (answered as the replica; the range is
  freed when the read lease ends, or becomes the object's DRAM replica when promoted). The
  record is pinned while read, so reclaim never reuses its space mid-read. A record that fails
  its checksum or its read is dropped (DropDiskReplica): that read is a miss.
- **Promotion.** Every disk hit counts in a Count-Min sketch (daemon/admission.py); at
  `promote_threshold` the value read gets a DRAM replica (AddReplicas), its disk copy stays.
- **Removal.** A remove or upsert answers only after the replaced version's disk record is
  dropped (DEAD on disk) and any write of that key in flight has finished (and dropped its
  record): a restart never brings back what was removed or overwritten.
- **Reclaim.** When the tier reclaims a region, its records' copies are dropped; a disk-only
  object among them is gone (counted as an SSD eviction).
- **Recovery.** At start, each record the tier found becomes a disk-only object again
  (AddDiskReplica recovered).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import time

from mooncaked.daemon.admission import CountMinSketch
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.master import ReplicateConfig

log = logging.getLogger(__name__)

_ONE_REPLICA = ReplicateConfig()


class TierStats:
    """Counters of the disk tier's use (status `tiers`, metrics)."""

    def __init__(self) -> None:
        self.dram_hits = 0
        self.ssd_hits = 0
        self.ssd_misses = 0  # disk-only reads that failed (record corrupt, unreadable, gone)
        self.offloads = 0
        self.offload_bytes = 0
        self.offload_failures = 0  # write errors (the DRAM copy stays)
        self.offloads_discarded = 0  # written, but the version changed meanwhile
        self.disk_full = 0  # writes refused for want of space
        self.write_throughs = 0
        self.promotions = 0
        self.promotion_bytes = 0
        self.promotions_skipped = 0  # admitted, but no DRAM could be reserved
        self.ssd_evictions = 0  # disk-only objects dropped by reclaim
        self.reclaimed_copies = 0  # disk copies dropped by reclaim
        self.drops = 0  # records dropped for removes, upserts and discarded writes
        self.recovered = 0
        self.recovered_refused = 0


class Tiering:
    def __init__(self, daemon, config, tier, api, node_id: int = 0) -> None:
        """`tier`: an open DiskTier; `api`: the module of its types (Locator, DiskFull,
        DiskIOError: mooncaked.ssd.tier)."""
        self.daemon = daemon
        self.master = daemon.master
        self.config = config
        self.tier = tier
        self.api = api
        self.node_id = node_id
        self.stats = TierStats()
        self.sketch = CountMinSketch(config.promote_sketch_width)
        # Writes in flight, by key: their task (which also drops a record it cannot record).
        self.offloads: dict[c.ObjectKey, asyncio.Task] = {}
        self.offload_bytes_in_flight = 0
        self.write_through_queue: dict[c.ObjectKey, None] = {}  # keys, in order
        # The last write found the tier full, or failed: one write at a time until one works.
        self.full = False
        self.failing = False
        self._drops: set[asyncio.Task] = set()
        self._reads_in_flight = 0
        # Disk-only values under a read lease: their record pinned until the lease ends
        # (reclaim skips its region), as a lease holds a value in DRAM against eviction.
        self.leased: dict[c.ObjectKey, tuple] = {}  # key -> (locator, lease end)
        # Reserved DRAM for disk reads is taken under this writer id (a connection id no
        # client has) and RESERVED_NAMESPACE keys of this name.
        self.writer_id = daemon.next_connection_id()
        self._names = itertools.count(1)
        self._last_disk_version = 0

    # -- start and stop -----------------------------------------------------------------------

    def attach(self) -> None:
        """Hook into the master (eviction order, released versions, write-through)."""
        master = self.master
        master.tiered = True
        master.released = []
        master.write_through_puts = set()
        master.write_through_default = self.config.write_through
        master.on_write_through = self._write_through

    async def recover(self, now_ms: int) -> int:
        """Make each record the tier found at open a disk-only object again; returns how
        many. A record that cannot be one (its key exists, the object table is full) is
        dropped."""
        recovered = 0
        for record in self.tier.recovered:
            key = (record.namespace, record.key)
            locator = record.locator
            applied = c.valid_namespace(record.namespace) and self.master.propose(
                c.AddDiskReplica(key, 0, now_ms, self.node_id, locator.region, locator.offset,
                                 record.size_bytes, record.version, True))
            if applied:
                recovered += 1
                self._last_disk_version = max(self._last_disk_version, record.version)
            else:
                self.stats.recovered_refused += 1
                await self._drop(locator)
        self.stats.recovered = recovered
        return recovered

    def hold(self, key: c.ObjectKey, version) -> None:
        """A read lease was granted on a value on disk only: pin its record until the lease
        ends (`sweep` unpins)."""
        held = self.leased.get(key)
        locator = self._locator(version.disk)
        if held is not None and held[0] != locator:
            self.tier.unpin(held[0])
            held = None
        if held is None:
            try:
                self.tier.pin(locator)
            except KeyError:
                return  # gone below the metadata: the read finds out
        self.leased[key] = (locator, self.master.lease_end_ms(key))

    def _release_leases(self, now_ms: int) -> None:
        """Unpin the records whose lease ended, or whose value is no longer that copy
        (removed, replaced, its copy dropped)."""
        readable = self.master.state.readable
        for key, (locator, until) in list(self.leased.items()):
            version = readable(key)
            if until <= now_ms or version is None or version.disk is None \
                    or self._locator(version.disk) != locator:
                del self.leased[key]
                self.tier.unpin(locator)

    async def close(self) -> None:
        """Let writes and drops in flight finish (their records stay consistent with what was
        answered), then close the tier."""
        pending = list(self.offloads.values()) + list(self._drops)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.tier.close()

    # -- offload ------------------------------------------------------------------------------

    def sweep(self, now_ms: int) -> None:
        """Start writes: write-through puts first, then the coldest objects while DRAM use is
        above the offload watermark. Also drops the disk records of versions released by
        paths that did not wait for it (none today; a safety net)."""
        if self.master.released:
            for _, version in self._take_released():
                if self._own_copy(version):
                    self._drop_later(self._locator(version.disk))
        if self.leased:
            self._release_leases(now_ms)
        self._pump_write_through()
        budget = self._budget()
        state = self.master.state
        capacity = state.capacity_bytes()
        if capacity == 0:
            return
        allowed = self.config.offload_watermark_ratio * capacity
        used = state.used_bytes()
        if used <= allowed:
            return
        # Bytes eviction could free now without losing a value: unleased objects with a disk
        # copy, or being written. Offload the coldest others until what is left fits the
        # watermark. Leased and hard-pinned objects eviction cannot take: they are not
        # written (a leased one is, once its lease is over), and cover nothing.
        objects = state.objects
        covered = 0
        for key, lease_end in self.master.access.items():
            if used - covered <= allowed or self.offload_bytes_in_flight >= budget:
                break
            entry = objects.get(key)
            version = entry.complete if entry is not None else None
            if version is None or not version.replicas or entry.hard_pin \
                    or lease_end > now_ms:
                continue
            dram_bytes = version.size_bytes * len(version.replicas)
            if version.disk is not None or key in self.offloads:
                covered += dram_bytes
            elif self._start_offload(key):
                covered += dram_bytes

    def _write_through(self, key: c.ObjectKey) -> None:
        self.write_through_queue[key] = None
        loop = asyncio.get_running_loop()
        loop.call_soon(self._pump_write_through)

    def _budget(self) -> int:
        """Bytes that may be in flight now: while the tier is full or its writes fail, one
        write at a time (a probe shows whether it takes writes again)."""
        return 1 if self.full or self.failing else self.config.offload_bytes_in_flight

    def _pump_write_through(self) -> None:
        """Start the queued write-through writes the budget allows, in order. A key whose
        earlier version is still being written waits for that write to end."""
        queue = self.write_through_queue
        budget = self._budget()
        for key in list(queue):
            if self.offload_bytes_in_flight >= budget:
                break
            if key in self.offloads:
                continue
            del queue[key]
            if self._start_offload(key):
                self.stats.write_throughs += 1

    def _start_offload(self, key: c.ObjectKey) -> bool:
        """Copy the key's readable value out of DRAM and start writing it; False when it is
        not one to write (gone, disk-only, already on disk or being written, too large)."""
        if key in self.offloads or key[0] == c.RESERVED_NAMESPACE:
            return False
        entry = self.master.state.objects.get(key)
        version = entry.complete if entry is not None else None
        if version is None or not version.replicas or version.disk is not None:
            return False
        memory = self.daemon.own_memory(version.replicas[0].segment_id)
        if memory is None or not self.tier.fits(key[0], key[1], version.size_bytes):
            return False
        size = version.size_bytes
        # Page-aligned memory: the disk tier writes an aligned value from it directly.
        copy = memoryview(mmap.mmap(-1, size))
        copy[:] = self.daemon.replica_view(version.replicas[0], size)
        self.master.offloading.add(key)
        self.offload_bytes_in_flight += size
        self.offloads[key] = asyncio.get_running_loop().create_task(
            self._offload(key, version, copy))
        return True

    def _next_disk_version(self) -> int:
        self._last_disk_version = max(self._last_disk_version + 1, time.time_ns())
        return self._last_disk_version

    async def _offload(self, key: c.ObjectKey, version, copy: memoryview) -> None:
        size = version.size_bytes
        api = self.api
        try:
            try:
                locator = await self.tier.write(key[0], key[1], self._next_disk_version(),
                                                [copy])
            except api.DiskFull:
                self.stats.disk_full += 1
                if not self.full:
                    log.warning("the disk tier is full: offloading stops until space returns")
                self.full = True
                return
            except api.DiskIOError as exc:
                self.stats.offload_failures += 1
                if not self.failing:
                    log.warning("writing %r to the disk tier failed (it stays in DRAM): %s; "
                                "one write at a time until one succeeds", key, exc)
                self.failing = True
                return
            finally:
                self.offload_bytes_in_flight -= size
                self.master.offloading.discard(key)
            if self.full or self.failing:
                log.info("the disk tier takes writes again: offloading resumes")
                self.full = self.failing = False
            applied = self.master.propose(c.AddDiskReplica(
                key, version.writer_id, version.started_ms, self.node_id, locator.region,
                locator.offset, size, locator.version))
            if applied:
                self.stats.offloads += 1
                self.stats.offload_bytes += size
            else:  # removed, overwritten or evicted meanwhile: the record must not stay
                self.stats.offloads_discarded += 1
                await self._drop(locator)
        except Exception:
            log.exception("offloading %r", key)
        finally:
            self.offloads.pop(key, None)
            if self.write_through_queue:
                self._pump_write_through()

    # -- removal --------------------------------------------------------------------------------

    def _take_released(self) -> list:
        released = self.master.released
        taken = list(released)
        released.clear()
        return taken

    def _own_copy(self, version) -> bool:
        return version is not None and version.disk is not None \
            and version.disk.node_id == self.node_id

    def _locator(self, disk):
        return self.api.Locator(disk.region, disk.offset, disk.size_bytes, disk.disk_version)

    def settle(self, outcome):
        """`outcome` once the versions the request took out of the state (removed, replaced)
        have no record left on disk: at once when none had one, else a coroutine that waits
        for their writes in flight and drops their records first."""
        if not self.master.released:
            return outcome
        waits, drops = [], []
        for key, version in self._take_released():
            task = self.offloads.get(key)
            if task is not None:
                waits.append(task)
            if self._own_copy(version):
                drops.append(self._locator(version.disk))
        if not waits and not drops:
            return outcome

        async def finish():
            if waits:
                await asyncio.wait(waits)
            if drops:
                await asyncio.gather(*(self._drop(locator) for locator in drops))
            return outcome
        return finish()

    async def _drop(self, locator) -> None:
        try:
            await self.tier.drop(locator)
            self.stats.drops += 1
        except KeyError:
            pass  # dropped already (a failed read, reclaim)
        except self.api.DiskIOError as exc:
            log.error("marking a disk record dead failed: %s", exc)

    def _drop_later(self, locator) -> None:
        task = asyncio.get_running_loop().create_task(self._drop(locator))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    def on_reclaim(self, records) -> None:
        """The tier reclaims a region: these records' copies leave the metadata first."""
        for record in records:
            key = (record.namespace, record.key)
            entry = self.master.state.objects.get(key)
            version = entry.complete if entry is not None else None
            disk_only = version is not None and not version.replicas
            locator = record.locator
            if self.master.propose(c.DropDiskReplica(key, self.node_id, locator.region,
                                                     locator.offset)):
                self.stats.reclaimed_copies += 1
                if disk_only:
                    self.stats.ssd_evictions += 1
                    self.master.access.pop(key, None)

    # -- reads ----------------------------------------------------------------------------------

    def count_dram_hit(self) -> None:
        self.stats.dram_hits += 1

    def _admit(self, key: c.ObjectKey) -> bool:
        hits = self.sketch.add(key)
        return self.config.promote and hits >= self.config.promote_threshold

    def _reserve(self, key: c.ObjectKey, size: int):
        """A DRAM range of `size` in the pool of the key's namespace, as a reservation of
        this module's writer (None when there is no room, after eviction, or no quota)."""
        reserved = (c.RESERVED_NAMESPACE,
                    c.reservation_name(key[0], self.writer_id, next(self._names)))
        try:
            replicas = self.master.put_start(reserved, size, _ONE_REPLICA, False,
                                             self.writer_id, self.daemon.now_ms(),
                                             owner_namespace=key[0])
        except MooncakedError:
            return None, None
        return reserved, replicas[0]

    def _release_reserved(self, reserved: c.ObjectKey, release_at_ms: int) -> None:
        try:
            self.master.propose(c.PutRevoke(reserved, self.writer_id, release_at_ms))
        except MooncakedError as exc:  # revoked by the release sweep meanwhile
            log.debug("releasing %r: %s", reserved, exc)

    def _lost(self, key: c.ObjectKey, version, exc) -> MooncakedError:
        """A disk read failed: the copy is dropped from the metadata, the read is a miss."""
        self.stats.ssd_misses += 1
        disk = version.disk
        if not isinstance(exc, KeyError):
            log.warning("reading %r from the disk tier failed: %s", key, exc)
        self.master.propose(c.DropDiskReplica(key, self.node_id, disk.region, disk.offset))
        return MooncakedError(ErrorCode.OBJECT_NOT_FOUND,
                              "no such object (its disk copy could not be read)")

    async def _read_pinned(self, key, version, read):
        """`read(locator)` of the version's disk copy, its record pinned meanwhile (reclaim
        never reuses its space mid-read). A record gone, corrupt or unreadable: the copy is
        dropped and the read is a miss (OBJECT_NOT_FOUND)."""
        locator = self._locator(version.disk)
        try:
            self.tier.pin(locator)
        except KeyError as exc:  # reclaimed or dropped meanwhile
            raise self._lost(key, version, exc) from None
        self._reads_in_flight += 1
        try:
            return await read(locator)
        except (KeyError, self.api.DiskIOError) as exc:
            raise self._lost(key, version, exc) from None
        finally:
            self._reads_in_flight -= 1
            self.tier.unpin(locator)

    async def _read_into_range(self, key, version, reserved_key, replica) -> None:
        dest = self.daemon.replica_view(replica, version.size_bytes)
        try:
            await self._read_pinned(key, version,
                                    lambda locator: self.tier.read_into(locator, dest))
        except BaseException:
            self._release_reserved(reserved_key, 0)  # nothing was answered from it
            raise

    def _promote(self, key, version, reserved_key) -> bool:
        """Make the range just read the version's DRAM replica (AddReplicas); False when the
        version changed meanwhile (the range is then released at the lease's end)."""
        try:
            self.master.propose(c.AddReplicas(key, version.writer_id, version.started_ms,
                                              reserved_key, self.writer_id))
        except MooncakedError:
            self._release_reserved(reserved_key, self.master.lease_end_ms(key))
            return False
        self.stats.promotions += 1
        self.stats.promotion_bytes += version.size_bytes
        return True

    async def read_value(self, key: c.ObjectKey, version):
        """The bytes of a disk-only version (for a socket reply), under the read lease the
        caller took; promoted to DRAM when admitted. OBJECT_NOT_FOUND if unreadable."""
        self.stats.ssd_hits += 1
        size = version.size_bytes
        if self._admit(key):
            reserved_key, replica = self._reserve(key, size)
            if reserved_key is not None:
                await self._read_into_range(key, version, reserved_key, replica)
                # Not promoted (the version changed meanwhile): the range is released at the
                # lease's end, after the reply has been sent from it.
                self._promote(key, version, reserved_key)
                return self.daemon.replica_view(replica, size)
            self.stats.promotions_skipped += 1
        # Page-aligned memory the disk reads into directly, sent from as it is.
        dest = memoryview(mmap.mmap(-1, size))
        await self._read_pinned(key, version,
                                lambda locator: self.tier.read_into(locator, dest))
        return dest

    async def read_shared(self, key: c.ObjectKey, version) -> tuple:
        """A disk-only version read into a DRAM range a local client maps: (replica, size).
        The range becomes the version's replica when promotion admits it, else it is freed
        at the end of the read lease. NO_AVAILABLE_HANDLE when no range can be had."""
        self.stats.ssd_hits += 1
        size = version.size_bytes
        reserved_key, replica = self._reserve(key, size)
        if reserved_key is None:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                 f"the value is on disk and no {size} bytes of DRAM can be "
                                 "reserved to read it into; read it with get")
        await self._read_into_range(key, version, reserved_key, replica)
        if not (self._admit(key) and self._promote(key, version, reserved_key)):
            self._release_reserved(reserved_key, self.master.lease_end_ms(key))
        return replica

    # -- reports --------------------------------------------------------------------------------

    def status(self, latency: bool = False) -> dict:
        """The `tiers` block of status (and `mooncakectl tiers`); `latency`: with the disk
        tier's latency histograms (for metrics)."""
        state = self.master.state
        stats = self.stats
        disk_objects = disk_bytes = disk_only = dram_objects = dram_only = dram_only_bytes = 0
        for entry in state.objects.values():
            version = entry.complete
            if version is None:
                continue
            if version.replicas:
                dram_objects += 1
                if version.disk is None:
                    dram_only += 1
                    dram_only_bytes += version.size_bytes * len(version.replicas)
            if version.disk is not None and version.disk.node_id == self.node_id:
                disk_objects += 1
                disk_bytes += version.size_bytes
                if not version.replicas:
                    disk_only += 1
        evictions = self.master.evictions
        tier_status = self.tier.status()
        return {
            "dram": {"capacity_bytes": state.capacity_bytes(), "used_bytes": state.used_bytes(),
                     "objects": dram_objects, "objects_without_disk_copy": dram_only,
                     "bytes_without_disk_copy": dram_only_bytes, "hits": stats.dram_hits},
            "ssd": {**{k: v for k, v in tier_status.items()
                       if latency or not k.endswith("_latency_us")},
                    "objects": disk_objects, "object_bytes": disk_bytes,
                    "disk_only_objects": disk_only, "hits": stats.ssd_hits,
                    "failing": self.failing,
                    "misses": stats.ssd_misses, "reads_in_flight": self._reads_in_flight,
                    "evictions": stats.ssd_evictions, "reclaimed_copies": stats.reclaimed_copies,
                    "drops": stats.drops, "recovered": stats.recovered,
                    "recovered_refused": stats.recovered_refused, "full": self.full},
            "offload": {"watermark_ratio": self.config.offload_watermark_ratio,
                        "in_flight": len(self.offloads),
                        "in_flight_bytes": self.offload_bytes_in_flight,
                        "queued_write_through": len(self.write_through_queue),
                        "done": stats.offloads, "bytes": stats.offload_bytes,
                        "write_through": stats.write_throughs,
                        "failed": stats.offload_failures, "discarded": stats.offloads_discarded,
                        "disk_full": stats.disk_full},
            "promotion": {"enabled": self.config.promote,
                          "threshold": self.config.promote_threshold,
                          "done": stats.promotions, "bytes": stats.promotion_bytes,
                          "skipped": stats.promotions_skipped},
            "eviction": {"to_disk": evictions.to_disk,
                         "without_offload": evictions.without_offload},
        }
