"""An in-memory stand-in for the disk tier (mooncaked/ssd/tier.py `DiskTier`), with the same
interface, for tests of the store's logic above it (daemon/tiering.py).

Each record is a "region" of its own: reclaim takes the oldest live unpinned record. Its
`storage` outlives an instance, so a test can open a new one over it, as a restart does, and
find what was live (`recovered`). Faults are injected by the test: `corrupt` (a read fails its
checksum), `fail_writes` (EIO), `gate` (writes wait until it is set).
"""

from __future__ import annotations

import asyncio

# The tier's own value and error types: the store sees the same ones from the fake.
from mooncaked.ssd.tier import DiskCorrupt, DiskFull, DiskIOError, DiskRecord, Locator  # noqa: F401


class Storage:
    """What survives a restart: records by region number, in write order."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.records: dict[int, list] = {}  # region -> [namespace, key, version, bytes, live]
        self.next_region = 1


class DiskTier:
    # Set by a test before the daemon opens its tier.
    storage: Storage | None = None
    instances: list = []

    def __init__(self, storage: Storage, on_reclaim) -> None:
        self.storage = storage
        self.on_reclaim = on_reclaim
        self.pins: dict[Locator, int] = {}
        self.corrupt: set[tuple[str, str]] = set()
        self.fail_writes = False
        self.gate: asyncio.Event | None = None
        self.writes = self.reads = self.drops = self.reclaimed = 0
        self.closed = False
        self.recovered = [DiskRecord(ns, key, len(data), version,
                                     Locator(region, 0, len(data), version))
                          for region, (ns, key, version, data, live)
                          in storage.records.items() if live]

    @classmethod
    async def open(cls, config, *, loop=None, on_reclaim=None) -> "DiskTier":
        tier = cls(cls.storage or Storage(config.capacity_bytes), on_reclaim)
        cls.instances.append(tier)
        return tier

    def fits(self, namespace: str, key: str, size_bytes: int) -> bool:
        return len(namespace) + len(key.encode()) <= 3000 \
            and size_bytes <= self.storage.capacity_bytes

    def used_bytes(self) -> int:
        return sum(len(record[3]) for record in self.storage.records.values())

    async def write(self, namespace, key, version, parts) -> Locator:
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail_writes:
            raise DiskIOError("injected EIO")
        data = b"".join(bytes(part) for part in parts)
        storage = self.storage
        while self.used_bytes() + len(data) > storage.capacity_bytes:
            victim = next((region for region in storage.records
                           if not any(loc.region == region for loc, n in self.pins.items()
                                      if n)), None)
            if victim is None:
                raise DiskFull("every region is pinned")
            ns, k, v, old, live = storage.records[victim]
            if live and self.on_reclaim is not None:
                self.on_reclaim([DiskRecord(ns, k, len(old), v,
                                            Locator(victim, 0, len(old), v))])
            del storage.records[victim]
            self.reclaimed += 1
        region = storage.next_region
        storage.next_region += 1
        storage.records[region] = [namespace, key, version, data, True]
        self.writes += 1
        return Locator(region, 0, len(data), version)

    def _record(self, locator: Locator):
        record = self.storage.records.get(locator.region)
        if record is None or not record[4] or record[2] != locator.version:
            raise KeyError(locator)
        return record

    async def read(self, locator: Locator) -> bytes:
        await asyncio.sleep(0)
        record = self._record(locator)
        if (record[0], record[1]) in self.corrupt:
            record[4] = False
            raise DiskCorrupt("crc mismatch")
        self.reads += 1
        return bytes(record[3])

    async def read_into(self, locator: Locator, dest: memoryview) -> None:
        assert len(dest) == locator.size_bytes
        dest[:] = await self.read(locator)

    async def drop(self, locator: Locator) -> None:
        await asyncio.sleep(0.01)  # a block write and a sync: an answer sent early shows
        record = self._record(locator)
        record[4] = False
        self.drops += 1

    def pin(self, locator: Locator) -> None:
        self._record(locator)  # KeyError when gone, as the real tier
        self.pins[locator] = self.pins.get(locator, 0) + 1

    def unpin(self, locator: Locator) -> None:
        if self.pins.get(locator):
            self.pins[locator] -= 1

    def live(self) -> dict:
        return {(ns, key): data for ns, key, _, data, live in self.storage.records.values()
                if live}

    def status(self) -> dict:
        used = self.used_bytes()
        return {"capacity_bytes": self.storage.capacity_bytes, "used_bytes": used,
                "live_bytes": sum(len(d) for d in self.live().values()),
                "live_records": len(self.live()), "direct_io": False,
                "direct_io_reason": "in memory", "writes": self.writes, "reads": self.reads,
                "write_latency_us": {}, "read_latency_us": {}}

    async def close(self) -> None:
        self.closed = True
