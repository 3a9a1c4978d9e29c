"""The store over its disk tier (daemon/tiering.py), with an in-memory disk (tests/ssd_fake.py).

A real daemon runs in the test's event loop, clients talk to it over TCP (values in the socket)
and the Unix socket (values through shared memory); only the disk below the tier is a fake, so
these tests are about the store's logic: offload ahead of eviction, eviction that keeps
offloaded values readable, reads of disk-only values through every read method, promotion,
removal that reaches the disk before it answers, reclaim, write-through, recovery, faults.
The same behaviour on the real disk tier: tests/test_ssd_store.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random

import pytest

import ssd_fake
from mooncaked import config as config_module
from mooncaked.client.aio import Client
from mooncaked.client.calls import ReplicateConfig
from mooncaked.daemon.admission import CountMinSketch
from mooncaked.daemon.main import Daemon
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c

SEGMENT_BYTES = 1 << 20
VALUE_BYTES = 64 * 1024


def make_config(tmp_path, lease_ttl_ms=50, **ssd) -> config_module.Config:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    ssd_section = {"enabled": True, "directory": str(tmp_path / "ssd"),
                   "capacity_bytes": 64 << 20, "region_bytes": 64 << 10,
                   "file_bytes": 1 << 20, **ssd}
    return config_module.from_dict({
        "server": {"tcp_port": 0, "unix_socket": str(tmp_path / "d.sock")},
        "segments": {"size_bytes": SEGMENT_BYTES, "shm_dir": str(shm)},
        "store": {"eviction_interval_ms": 5, "lease_ttl_ms": lease_ttl_ms},
        "metrics": {"enabled": False},
        "ssd": ssd_section,
    })


class Harness:
    """A daemon over the fake disk tier, and a TCP and a Unix socket client."""

    def __init__(self, tmp_path, storage=None, lease_ttl_ms=50, **ssd) -> None:
        self.config = make_config(tmp_path, lease_ttl_ms, **ssd)
        ssd_fake.DiskTier.storage = storage or ssd_fake.Storage(
            self.config.ssd.capacity_bytes)
        self.storage = ssd_fake.DiskTier.storage
        self.daemon = Daemon(self.config)
        self.daemon.disk_tier_module = ssd_fake

    async def __aenter__(self) -> "Harness":
        await self.daemon.start()
        self.tier = self.daemon.tiering.tier
        self.tcp = await Client.connect(f"127.0.0.1:{self.daemon.tcp_port}")
        self.local = await Client.connect(f"unix:{self.config.server.unix_socket}")
        assert self.local.segments is not None  # reads through shared memory
        return self

    async def __aexit__(self, *exc) -> None:
        if self.tier.gate is not None:
            self.tier.gate.set()  # writes held by a test that failed must end
        await self.tcp.close()
        await self.local.close()
        self.daemon.request_stop()
        await self.daemon.stop()

    @property
    def state(self):
        return self.daemon.master.state

    def version(self, key: str):
        return self.state.readable(("default", key))

    async def settle(self) -> None:
        """Until the sweep has nothing left to write: what is above the watermark is on disk
        (or being written), and no write is in flight."""
        tiering = self.daemon.tiering
        for _ in range(2000):
            await asyncio.sleep(0.002)
            if tiering.offloads:
                continue
            dram = tiering.status()["dram"]
            allowed = self.config.ssd.offload_watermark_ratio * dram["capacity_bytes"]
            if dram["bytes_without_disk_copy"] <= allowed:
                return
        raise AssertionError("offloading did not settle")

    async def fill(self, count: int, size: int = VALUE_BYTES, prefix: str = "v") -> dict:
        """Put `count` values, letting offloading keep up; returns them by key."""
        rng = random.Random(count)
        values = {}
        for i in range(count):
            key = f"{prefix}{i}"
            values[key] = rng.randbytes(size)
            assert await self.tcp.put(key, values[key])
            await self.settle()
        return values


def run(coroutine):
    return asyncio.run(coroutine)


def disk_only(harness, key) -> bool:
    version = harness.version(key)
    return version is not None and not version.replicas and version.disk is not None


# -- the admission sketch ---------------------------------------------------------------------

def test_sketch_counts_at_least_the_true_hits_and_ages():
    sketch = CountMinSketch(64, aging_period=1000)
    for i in range(200):
        for _ in range(i % 5):
            sketch.add(("ns", f"k{i}"))
    assert all(sketch.estimate(("ns", f"k{i}")) >= i % 5 for i in range(200))
    assert sketch.estimate(("ns", "never")) <= 15
    hot = ("ns", "hot")
    for _ in range(40):
        sketch.add(hot)
    assert sketch.estimate(hot) == 15  # 4-bit counters saturate
    sketch.age()
    assert sketch.estimate(hot) == 7


def test_sketch_of_a_wide_row_is_exact_for_few_keys():
    sketch = CountMinSketch(1 << 16)
    assert sketch.add(("a", "1")) == 1
    assert sketch.add(("a", "1")) == 2
    assert sketch.add(("a", "2")) == 1


# -- offload and eviction ---------------------------------------------------------------------

def test_more_than_dram_holds_reads_back_byte_exact_through_every_read_method(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(40)  # 2.5 MiB through a 1 MiB segment
            on_disk = [k for k in values if disk_only(h, k)]
            assert len(on_disk) >= 20
            evictions = h.daemon.master.evictions
            assert evictions.to_disk >= 20 and evictions.without_offload == 0
            # Quota and used_bytes count DRAM alone.
            assert h.state.used_bytes() <= SEGMENT_BYTES
            for key, value in values.items():
                assert await h.tcp.exists(key)
                assert await h.tcp.get_size(key) == len(value)
            for key in on_disk[:6]:
                stat = await h.tcp.object_stat(key)
                assert stat["tier"] == "ssd" and stat["replicas"] == [] and stat["disk"]
            # Socket reads, one by one and in a batch, then shared-memory reads.
            for key, value in values.items():
                assert await h.tcp.get(key) == value, key
            keys = list(values)
            assert await h.tcp.batch_get(keys[:12]) == [values[k] for k in keys[:12]]
            for key, value in values.items():
                assert await h.local.get(key) == value, key
            assert h.daemon.tiering.stats.ssd_hits >= len(on_disk)
            h.state.check_invariants()
    run(main())


def test_get_replica_names_the_tier_and_reads_a_disk_only_value_into_shared_memory(tmp_path):
    async def main():
        async with Harness(tmp_path, promote=False) as h:
            values = await h.fill(30)
            key = next(k for k in values if disk_only(h, k))
            warm = list(values)[-1]
            assert not disk_only(h, warm)
            raw = await _call(h.local, "get_replica", key)
            assert raw[3] == "ssd" and raw[2] == VALUE_BYTES
            address = h.local.segments.address(raw[0], raw[1], raw[2])
            assert ctypes.string_at(address, raw[2]) == values[key]
            assert (await _call(h.local, "get_replica", warm))[3] == "dram"
            both = await _call(h.local, "batch_get_replica", [key, warm, "missing"])
            assert [b[3] for b in both[:2]] == ["ssd", "dram"]
            assert both[2] == int(ErrorCode.OBJECT_NOT_FOUND)
            # Not promoted: still on disk only, and the range it was read into is freed once
            # the read lease is over.
            assert disk_only(h, key)
            await asyncio.sleep(0.2)
            assert not any(k[0] == c.RESERVED_NAMESPACE for k in h.state.objects)
            h.state.check_invariants()
    run(main())


async def _call(client, method, *params):
    from mooncaked.client import calls
    return await client.drive(_single(calls.simple(method, *params)))


def _single(call):
    result = yield call
    return result


def test_eviction_takes_offloaded_objects_first_and_frees_only_their_dram(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(16)  # over the 0.7 watermark: the coldest are offloaded
            with_copy = [k for k in values if h.version(k).disk is not None]
            assert with_copy and with_copy == list(values)[:len(with_copy)]  # coldest first
            used = h.state.used_bytes()
            chosen = h.daemon.master.choose_evictions(h.daemon.now_ms() + 10_000,
                                                      need_bytes=VALUE_BYTES)
            assert chosen and h.version(chosen[0][1]).disk is not None
            await h.fill(10, prefix="more")
            for key in with_copy:
                assert await h.tcp.get(key) == values[key]
            assert h.state.used_bytes() <= SEGMENT_BYTES and used > 0
    run(main())


def test_remove_and_overwrite_drop_the_disk_record_before_answering(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            gone, replaced = [k for k in values if disk_only(h, k)][:2]
            await h.tcp.remove(gone)
            assert ("default", gone) not in h.tier.live()  # dead on disk when remove answers
            new = b"n" * 1000
            await h.tcp.upsert(replaced, new)
            assert ("default", replaced) not in h.tier.live()
            assert await h.tcp.get(replaced) == new
            with pytest.raises(MooncakedError) as info:
                await h.tcp.get(gone)
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            # remove_all reaches the disk too.
            assert await h.tcp.remove_all(force=True) >= 20
            assert not h.tier.live()
            h.state.check_invariants()
    run(main())


def test_a_remove_during_an_offload_waits_for_it_and_leaves_no_record(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.tier.gate = asyncio.Event()  # writes wait
            rng = random.Random(5)
            for i in range(14):
                assert await h.tcp.put(f"w{i}", rng.randbytes(VALUE_BYTES))
            for _ in range(200):
                await asyncio.sleep(0.005)
                if h.daemon.tiering.offloads:
                    break
            key = next(iter(h.daemon.tiering.offloads))
            remove = asyncio.ensure_future(h.tcp.remove(key[1], force=True))
            await asyncio.sleep(0.05)
            assert not remove.done()  # waits for the write in flight
            h.tier.gate.set()
            await remove
            assert key not in h.tier.live()
            assert h.daemon.tiering.stats.offloads_discarded >= 1
    run(main())


# -- promotion ----------------------------------------------------------------------------------

def test_a_value_hit_twice_on_disk_is_promoted_and_keeps_its_disk_copy(tmp_path):
    async def main():
        async with Harness(tmp_path, promote_threshold=2) as h:
            values = await h.fill(30)
            key = next(k for k in values if disk_only(h, k))
            assert await h.tcp.get(key) == values[key]
            assert disk_only(h, key)  # one hit: not admitted
            assert await h.tcp.get(key) == values[key]
            version = h.version(key)
            assert version.replicas and version.disk is not None  # promoted, copy kept
            assert h.daemon.tiering.stats.promotions == 1
            assert (await h.tcp.object_stat(key))["tier"] == "dram"
            assert await h.local.get(key) == values[key]
            h.state.check_invariants()
    run(main())


def test_a_shared_memory_read_promotes_after_two_hits(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            key = next(k for k in values if disk_only(h, k))
            assert await h.local.get(key) == values[key]
            assert disk_only(h, key)
            assert await h.local.get(key) == values[key]
            assert h.version(key).replicas
            await asyncio.sleep(0.2)
            assert not any(k[0] == c.RESERVED_NAMESPACE for k in h.state.objects)
            h.state.check_invariants()
    run(main())


# -- reclaim, faults, write-through -------------------------------------------------------------

def test_reclaim_drops_the_copies_and_disk_only_objects_go(tmp_path):
    async def main():
        async with Harness(tmp_path, capacity_bytes=12 * VALUE_BYTES) as h:
            values = await h.fill(40)
            stats = h.daemon.tiering.stats
            assert h.tier.reclaimed and stats.ssd_evictions >= 1
            for key, value in values.items():
                try:
                    assert await h.tcp.get(key) == value  # never a wrong value
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND
            live = h.tier.live()
            for key, entry in h.state.objects.items():
                if entry.complete.disk is not None:
                    assert key in live
            h.state.check_invariants()
    run(main())


def test_a_full_disk_stops_offloading_and_eviction_drops_as_before(tmp_path):
    async def main():
        async with Harness(tmp_path, capacity_bytes=8 * VALUE_BYTES) as h:
            # Every region pinned: nothing can be reclaimed.
            h.tier.pins = _AllPinned()
            values = await _fill_fast(h, 30)
            tiering = h.daemon.tiering
            assert tiering.stats.disk_full >= 1 and tiering.full
            assert h.daemon.master.evictions.without_offload >= 1
            for key, value in values.items():
                try:
                    assert await h.tcp.get(key) == value
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND
            # Space returns: offloading resumes.
            h.tier.pins = {}
            await h.fill(4, prefix="after")
            assert not tiering.full and tiering.stats.offloads >= 1
    run(main())


class _AllPinned(dict):
    def items(self):
        return [(ssd_fake.Locator(region, 0, 0, 0), 1) for region in range(1, 10_000)]


async def _fill_fast(h, count):
    rng = random.Random(count)
    values = {}
    for i in range(count):
        values[f"f{i}"] = rng.randbytes(VALUE_BYTES)
        assert await h.tcp.put(f"f{i}", values[f"f{i}"])
        await asyncio.sleep(0.01)
    return values


def test_a_corrupt_record_is_a_miss_and_is_dropped(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            bad, good = [k for k in values if disk_only(h, k)][:2]
            h.tier.corrupt.add(("default", bad))
            with pytest.raises(MooncakedError) as info:
                await h.tcp.get(bad)
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            assert h.version(bad) is None and not await h.tcp.exists(bad)
            assert await h.tcp.get(good) == values[good]
            assert h.daemon.tiering.stats.ssd_misses == 1
    run(main())


def test_a_write_error_keeps_the_dram_copy(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            h.tier.fail_writes = True
            values = await _fill_fast(h, 12)
            tiering = h.daemon.tiering
            assert tiering.stats.offload_failures >= 1 and tiering.failing
            assert len(tiering.offloads) <= 1  # one probe at a time while writes fail
            for key, value in values.items():
                assert await h.tcp.get(key) == value
    run(main())


def test_write_through_puts_reach_the_disk_below_the_watermark(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            value = os.urandom(5000)
            assert await h.tcp.put("wt", value, ReplicateConfig(write_through=True))
            assert await h.tcp.put("plain", value)
            for _ in range(200):
                await asyncio.sleep(0.005)
                if h.version("wt").disk is not None:
                    break
            assert h.version("wt").disk is not None and h.version("plain").disk is None
            assert h.tier.live()[("default", "wt")] == value
            assert h.daemon.tiering.stats.write_throughs == 1
            assert (await h.tcp.status())["tiers"]["offload"]["write_through"] == 1
    run(main())


def test_write_through_by_default_from_the_config(tmp_path):
    async def main():
        async with Harness(tmp_path, write_through=True) as h:
            await h.tcp.put("a", b"x" * 100)
            await h.tcp.put("b", b"y" * 100, ReplicateConfig(write_through=False))
            for _ in range(200):
                await asyncio.sleep(0.005)
                if h.version("a").disk is not None:
                    break
            assert h.version("a").disk is not None and h.version("b").disk is None
    run(main())


# -- restart ------------------------------------------------------------------------------------

def test_values_on_disk_are_back_after_a_restart_and_removed_ones_are_not(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            storage = h.storage
            gone = next(k for k in values if disk_only(h, k))
            await h.tcp.remove(gone)
            on_disk = {k for k in values if h.version(k) and h.version(k).disk is not None}
        async with Harness(tmp_path, storage=storage) as h:
            assert h.daemon.tiering.stats.recovered == len(on_disk)
            assert not await h.tcp.exists(gone)
            for key in on_disk:
                assert disk_only(h, key)
                assert await h.tcp.get(key) == values[key]
                assert await h.local.get(key) == values[key]
            h.state.check_invariants()
            tiers = (await h.tcp.status())["tiers"]
            assert tiers["ssd"]["recovered"] == len(on_disk)
    run(main())


def test_status_reports_both_tiers(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            await h.fill(30)
            tiers = (await h.tcp.status())["tiers"]
            assert tiers["dram"]["capacity_bytes"] == SEGMENT_BYTES
            assert tiers["ssd"]["disk_only_objects"] >= 1
            assert tiers["ssd"]["objects"] >= tiers["ssd"]["disk_only_objects"]
            assert tiers["offload"]["done"] >= 1 and tiers["eviction"]["to_disk"] >= 1
    run(main())


def test_mooncakectl_tiers_and_the_metrics_show_both_tiers(tmp_path):
    from click.testing import CliRunner
    from prometheus_client import generate_latest

    from mooncaked import ctl
    from mooncaked.daemon.metrics import make_registry

    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            key = next(k for k in values if disk_only(h, k))
            assert await h.tcp.get(key) == values[key]
            address = f"unix:{h.config.server.unix_socket}"
            loop = asyncio.get_running_loop()
            runner = CliRunner()
            table = await loop.run_in_executor(None, lambda: runner.invoke(
                ctl.cli, ["-a", address, "tiers", "--interval", "0"]))
            assert table.exit_code == 0, table.output
            assert "ssd" in table.output and "offload:" in table.output
            as_json = await loop.run_in_executor(None, lambda: runner.invoke(
                ctl.cli, ["-a", address, "-o", "json", "tiers", "--interval", "0.05"]))
            assert as_json.exit_code == 0, as_json.output
            data = json.loads(as_json.output)
            assert data["ssd"]["hits"] >= 1 and data["offload"]["done"] >= 1
            assert "offloads/s" in data["rates_per_s"]
            text = generate_latest(make_registry(h.daemon)).decode()
            assert 'mooncaked_tier_hits_total{tier="ssd"}' in text
            assert 'mooncaked_tier_used_bytes{tier="dram"}' in text
            assert "mooncaked_ssd_offloads_total" in text
            assert "mooncaked_evicted_without_offload_objects_total 0.0" in text
    run(main())


@pytest.mark.parametrize("sections, words", [
    ({"ssd": {"enabled": True, "offload_watermark_ratio": 0.95}}, "offload_watermark_ratio"),
    ({"ssd": {"enabled": True}, "cluster": {"enabled": True, "node_id": 1}}, "[cluster]"),
    ({"ssd": {"promote_threshold": 0}}, "promote_threshold"),
    ({"ssd": {"offload_bytes_in_flight": 1}}, "offload_bytes_in_flight"),
])
def test_bad_policy_keys_are_refused_naming_the_key(sections, words):
    with pytest.raises(config_module.ConfigError) as info:
        config_module.from_dict(sections, "x.toml")
    assert words in str(info.value) and "x.toml" in str(info.value)


def test_get_into_and_batch_get_into_of_local_clients_read_disk_only_values(tmp_path):
    async def main():
        async with Harness(tmp_path, promote=False) as h:
            values = await h.fill(30)
            cold = [k for k in values if disk_only(h, k)][:4]
            warm = list(values)[-2:]
            keys = cold + warm + ["missing"]
            buffers = [ctypes.create_string_buffer(VALUE_BYTES) for _ in keys]
            sizes = await h.local.batch_get_into(keys, [ctypes.addressof(b) for b in buffers],
                                                 [VALUE_BYTES] * len(keys))
            assert sizes[:-1] == [VALUE_BYTES] * (len(keys) - 1)
            assert sizes[-1] == int(ErrorCode.OBJECT_NOT_FOUND)
            for key, buffer in zip(keys[:-1], buffers):
                assert buffer.raw == values[key], key
            one = ctypes.create_string_buffer(VALUE_BYTES)
            assert await h.local.get_into_address(cold[0], ctypes.addressof(one),
                                                  VALUE_BYTES) == VALUE_BYTES
            assert one.raw == values[cold[0]]
            # A batch over the socket mixing both tiers and a corrupt record.
            h.tier.corrupt.add(("default", cold[1]))
            got = await h.tcp.batch_get([cold[0], cold[1], warm[0]])
            assert got == [values[cold[0]], None, values[warm[0]]]
            h.state.check_invariants()
    run(main())


def test_a_record_the_tier_no_longer_holds_is_a_miss_for_every_read_method(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            values = await h.fill(30)
            lost = [k for k in values if disk_only(h, k)][:3]
            for key in lost:
                disk = h.version(key).disk
                h.storage.records[disk.region][4] = False  # gone below the metadata
            with pytest.raises(MooncakedError) as info:
                await h.tcp.get(lost[0])
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            with pytest.raises(MooncakedError) as info:
                await h.local.get(lost[1])
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            assert await h.tcp.batch_get([lost[2]]) == [None]
            assert all(h.version(k) is None for k in lost)
            assert not any(k[0] == c.RESERVED_NAMESPACE for k in h.state.objects)
            h.state.check_invariants()
    run(main())


def test_a_write_through_upsert_of_a_key_being_written_waits_for_that_write(tmp_path):
    async def main():
        async with Harness(tmp_path) as h:
            through = ReplicateConfig(write_through=True)
            h.tier.gate = asyncio.Event()
            assert await h.tcp.put("k", b"old" * 100, through)
            for _ in range(100):
                await asyncio.sleep(0.005)
                if ("default", "k") in h.daemon.tiering.offloads:
                    break
            upsert = asyncio.ensure_future(h.tcp.upsert("k", b"new" * 100, through))
            await asyncio.sleep(0.05)
            assert not upsert.done()  # the old value's write is in flight
            h.tier.gate.set()
            await upsert
            for _ in range(200):
                await asyncio.sleep(0.005)
                if h.version("k").disk is not None:
                    break
            assert h.tier.live() == {("default", "k"): b"new" * 100}
    run(main())


def test_a_read_lease_holds_a_disk_only_value_against_reclaim(tmp_path):
    async def main():
        async with Harness(tmp_path, lease_ttl_ms=60_000,
                           capacity_bytes=12 * VALUE_BYTES) as h:
            values = await h.fill(20)
            held = next(k for k in values if disk_only(h, k))
            assert await h.tcp.exists(held)  # a lease: its record is pinned
            more = await h.fill(40, prefix="more")
            assert h.tier.reclaimed > 0
            assert await h.tcp.get(held) == values[held]
            del more
    run(main())
