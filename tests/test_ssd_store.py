"""The store with its disk tier, end to end: a real daemon process, a small DRAM segment, the
real disk tier (mooncaked/ssd) in a directory under the test's temp dir, real clients.

- More values than DRAM holds read back byte-exact through the socket and shared memory, and
  exists / get_size / get_replica / object_stat name the tier.
- A remove of a value on disk only is not back after a restart; values on disk are back after
  SIGTERM, and after SIGKILL in the middle of offloading (everything readable is byte-exact).
- A value hit twice on disk is promoted to DRAM.
- A disk too small for what is evicted: reclaim and eviction drop values, nothing wrong is
  served, the store keeps working.
"""

from __future__ import annotations

import os
import random
import time
import urllib.request

import pytest

from conftest import DaemonProcess
import test_ssd_faults
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError

SEGMENT_BYTES = 1 << 20
VALUE_BYTES = 64 * 1024


def ssd_daemon(workdir: str, ssd: dict | None = None, store: dict | None = None
               ) -> DaemonProcess:
    """A daemon (not started) with a 1 MiB DRAM segment and a disk tier in workdir/ssd."""
    return DaemonProcess(
        workdir,
        segments={"size_bytes": SEGMENT_BYTES},
        store={"eviction_interval_ms": 10, "lease_ttl_ms": 100, **(store or {})},
        ssd={"enabled": True, "directory": os.path.join(workdir, "ssd"),
             "capacity_bytes": 32 << 20, "file_bytes": 8 << 20, "region_bytes": 1 << 20,
             "bounce_bytes": 4 << 20, **(ssd or {})})


def wait_until(condition, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def tiers(client) -> dict:
    return client.status()["tiers"]


def settled(client) -> bool:
    """Offloading has nothing in flight and DRAM is within the offload watermark, or every
    value in DRAM has a disk copy."""
    status = client.status()
    offload = status["tiers"]["offload"]
    if offload["in_flight"] or offload["queued_write_through"]:
        return False
    dram = status["tiers"]["dram"]
    return dram["bytes_without_disk_copy"] <= 0.7 * dram["capacity_bytes"]


def fill(client, count: int, prefix: str = "v", seed: int = 1) -> dict:
    """Put `count` values of VALUE_BYTES, letting offloading keep up after each."""
    rng = random.Random(seed)
    values = {}
    for i in range(count):
        key = f"{prefix}{i}"
        values[key] = rng.randbytes(VALUE_BYTES)
        assert client.put(key, values[key])
        wait_until(lambda: settled(client), what="offloading to settle")
    return values


def on_disk(client, key: str) -> bool:
    try:
        return client.object_stat(key)["disk"] is not None
    except MooncakedError as exc:  # evicted without a disk copy
        assert exc.code == ErrorCode.OBJECT_NOT_FOUND
        return False


def tier_of(client, key: str) -> str:
    return client.object_stat(key)["tier"]


@pytest.fixture
def node(tmp_path):
    daemon = ssd_daemon(str(tmp_path))
    yield daemon
    daemon.close()


def test_more_than_dram_holds_reads_back_byte_exact_and_names_the_tier(node):
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp, \
            BlockingClient.connect(node.unix_address) as local:
        values = fill(tcp, 40)  # 2.5 MiB through 1 MiB of DRAM
        on_disk = [k for k in values if tier_of(tcp, k) == "ssd"]
        assert len(on_disk) >= 20
        status = tcp.status()
        assert status["used_bytes"] <= SEGMENT_BYTES
        assert status["tiers"]["eviction"]["without_offload"] == 0
        assert status["tiers"]["ssd"]["live_records"] >= len(on_disk)
        for key, value in values.items():
            assert tcp.exists(key) and tcp.get_size(key) == len(value)
        cold, warm = on_disk[0], list(values)[-1]
        location = local.call("get_replica", cold)
        assert location[2] == VALUE_BYTES and location[3] == "ssd"
        assert local.call("get_replica", warm)[3] == "dram"
        for key, value in values.items():
            assert tcp.get(key) == value, key
        for key, value in values.items():
            assert local.get(key) == value, key
        keys = list(values)[:10]
        assert tcp.batch_get(keys) == [values[k] for k in keys]
        assert tiers(tcp)["ssd"]["hits"] >= len(on_disk)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics") as reply:
        metrics = reply.read().decode()
    for line in ('mooncaked_tier_hits_total{tier="ssd"}', 'mooncaked_tier_objects{tier="dram"}',
                 "mooncaked_ssd_offloads_total", "mooncaked_ssd_write_duration_seconds_bucket",
                 "mooncaked_ssd_read_duration_seconds_count"):
        assert line in metrics, line
    assert node.terminate() == 0


def test_a_value_hit_twice_on_disk_is_promoted(node):
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp:
        values = fill(tcp, 30)
        key = next(k for k in values if tier_of(tcp, k) == "ssd")
        assert tcp.get(key) == values[key]
        assert tier_of(tcp, key) == "ssd"
        assert tcp.get(key) == values[key]
        stat = tcp.object_stat(key)
        assert stat["tier"] == "dram" and stat["disk"] is not None  # the copy stays
        assert tiers(tcp)["promotion"]["done"] == 1
        assert tcp.get(key) == values[key]


def test_removed_values_stay_removed_and_the_rest_is_back_after_a_restart(node):
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp:
        values = fill(tcp, 36)
        on_disk = [k for k in values if tcp.object_stat(k)["disk"] is not None]
        removed, replaced = on_disk[0], on_disk[1]
        tcp.remove(removed)
        newer = os.urandom(3000)
        tcp.upsert(replaced, newer)  # in DRAM only: a restart loses it, never the old one
        kept = [k for k in on_disk if k not in (removed, replaced)]
    assert node.terminate() == 0
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp, \
            BlockingClient.connect(node.unix_address) as local:
        assert not tcp.exists(removed) and not tcp.exists(replaced)
        assert tiers(tcp)["ssd"]["recovered"] == len(kept)
        for key in kept:
            assert tier_of(tcp, key) == "ssd"
            assert tcp.get(key) == values[key]
        for key in kept[:8]:
            assert local.get(key) == values[key]
        # A value on disk only, removed, is not back after the next restart either.
        tcp.remove(kept[0], force=True)
    assert node.terminate() == 0
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp:
        assert not tcp.exists(kept[0])
        assert tcp.get(kept[1]) == values[kept[1]]


def test_sigkill_in_the_middle_of_offloading_serves_nothing_wrong_after_restart(node):
    node.start()
    rng = random.Random(7)
    values = {}
    with BlockingClient.connect(node.tcp_address) as tcp:
        for i in range(60):
            key = f"k{i}"
            values[key] = rng.randbytes(VALUE_BYTES)
            assert tcp.put(key, values[key])
        wait_until(lambda: tiers(tcp)["offload"]["done"] > 0, what="offloading to start")
        # Upserts of values already on disk: once an upsert answered, the old value may
        # never come back (the new one may be lost with DRAM, or be on disk too).
        for key in [k for k in values if on_disk(tcp, k)][:6]:
            values[key] = rng.randbytes(VALUE_BYTES // 2)
            tcp.upsert(key, values[key])
        through = ReplicateConfig(write_through=True)
        for i in range(60, 90):  # writes in flight when the kill comes
            values[f"k{i}"] = rng.randbytes(VALUE_BYTES)
            assert tcp.put(f"k{i}", values[f"k{i}"], through)
    node.kill()
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp:
        recovered = tiers(tcp)["ssd"]["recovered"]
        found = 0
        for key, value in values.items():
            try:
                got = tcp.get(key)
            except MooncakedError as exc:
                assert exc.code == ErrorCode.OBJECT_NOT_FOUND
                continue
            assert got == value, key
            found += 1
        assert found == recovered
        # The store works on: new values go to disk and come back.
        more = fill(tcp, 20, prefix="after", seed=3)
        for key, value in more.items():
            assert tcp.get(key) == value


def test_sigterm_mid_offload_finishes_the_writes_and_they_are_back(node):
    node.start()
    rng = random.Random(11)
    values = {}
    with BlockingClient.connect(node.tcp_address) as tcp:
        for i in range(24):
            values[f"t{i}"] = rng.randbytes(VALUE_BYTES)
            assert tcp.put(f"t{i}", values[f"t{i}"])
    assert node.terminate() == 0
    node.start()
    with BlockingClient.connect(node.tcp_address) as tcp:
        recovered = tiers(tcp)["ssd"]["recovered"]
        assert recovered >= 1
        for key, value in values.items():
            if tcp.exists(key):
                assert tcp.get(key) == value


def test_a_disk_too_small_drops_values_and_never_serves_a_wrong_one(tmp_path):
    node = ssd_daemon(str(tmp_path), ssd={"capacity_bytes": 4 << 20, "file_bytes": 4 << 20,
                                          "region_bytes": 1 << 20})
    node.start()
    try:
        with BlockingClient.connect(node.tcp_address) as tcp, \
                BlockingClient.connect(node.unix_address) as local:
            rng = random.Random(3)
            values = {}
            for i in range(150):  # ~9.4 MiB through 1 MiB of DRAM and 4 MiB of disk
                values[f"s{i}"] = rng.randbytes(VALUE_BYTES)
                assert tcp.put(f"s{i}", values[f"s{i}"])
                if i % 10 == 0:
                    wait_until(lambda: settled(tcp), what="offloading to settle")
            status = tiers(tcp)
            assert status["ssd"]["evictions"] + status["eviction"]["without_offload"] > 0
            found = 0
            for key, value in values.items():
                for client in (tcp, local):
                    try:
                        assert client.get(key) == value, key
                        found += 1
                    except MooncakedError as exc:
                        assert exc.code == ErrorCode.OBJECT_NOT_FOUND
            assert found > 0
            time.sleep(0.3)  # the reads' leases end: their DRAM may be evicted again
            assert tcp.put("last", b"x" * 100) and tcp.get("last") == b"x" * 100
    finally:
        node.close()


def test_a_full_disk_stops_offloading_evicts_as_before_and_resumes(tmp_path):
    # Four regions of 1 MiB; read leases of 5 s pin what they cover, so once every region
    # holds a leased value nothing can be reclaimed: the disk is full.
    node = ssd_daemon(str(tmp_path), ssd={"capacity_bytes": 4 << 20, "file_bytes": 4 << 20,
                                          "region_bytes": 1 << 20},
                      store={"lease_ttl_ms": 5000})
    node.start()
    try:
        with BlockingClient.connect(node.tcp_address) as tcp:
            rng = random.Random(5)
            values, held = {}, []
            for i in range(160):
                key = f"d{i}"
                values[key] = rng.randbytes(VALUE_BYTES)
                assert tcp.put(key, values[key])
                wait_until(lambda: tiers(tcp)["offload"]["in_flight"] == 0, what="writes")
                # Lease every value on disk only: its record, and region, is pinned (and no
                # DRAM is held by the lease).
                for other in list(values):
                    if other not in held and on_disk(tcp, other) \
                            and tier_of(tcp, other) == "ssd":
                        assert tcp.exists(other)
                        held.append(other)
                if tiers(tcp)["ssd"]["full"]:
                    break
            status = tiers(tcp)
            assert status["ssd"]["full"] and status["offload"]["disk_full"] >= 1, status
            before = status["eviction"]["without_offload"]
            more = {}
            for i in range(40):  # DRAM keeps filling: eviction drops as without a tier
                more[f"m{i}"] = rng.randbytes(VALUE_BYTES)
                assert tcp.put(f"m{i}", more[f"m{i}"])
            wait_until(lambda: tiers(tcp)["eviction"]["without_offload"] > before,
                       what="evictions without offload")
            for key, value in {**values, **more}.items():
                try:
                    assert tcp.get(key) == value, key  # never a wrong value
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND
            # Space returns: the leased values (every value just read) are removed, and their
            # regions can be reclaimed.
            for key in list(values) + list(more):
                try:
                    tcp.remove(key, force=True)
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND
            # A forced remove frees DRAM when the lease ends (PROTOCOL.md 5.1).
            wait_until(lambda: tcp.status()["used_bytes"] < SEGMENT_BYTES // 4,
                       what="the removed values' DRAM to be freed")
            after = fill(tcp, 24, prefix="after", seed=9)
            assert not tiers(tcp)["ssd"]["full"]
            assert any(on_disk(tcp, key) for key in after)
            for key, value in after.items():
                assert tcp.get(key) == value
    finally:
        node.close()


eio_fuse = test_ssd_faults.eio_fuse  # a fixture: tests/eio_fuse.py mounted, or a skip


def _record_range(workdir_ssd: str, disk: dict, start: int, length: int) -> list:
    """A fault entry of tests/eio_fuse.py: bytes [start, start + length) of the record at
    `disk` ({region, offset} of object_stat), in its data file (8 regions of 1 MiB a file)."""
    file_index, within = divmod(disk["region"], 8)
    at = within * (1 << 20) + disk["offset"] + start
    return [f"ssd/ssd-{file_index:04d}.data", at, at + length]


def test_eio_on_a_read_is_a_miss_for_that_value_only_and_eio_on_writes_keeps_dram(
        eio_fuse):  # noqa: F811
    workdir = str(eio_fuse.mountpoint.parent)
    # The disk tier's directory on the fault-injecting file system.
    node = DaemonProcess(workdir, segments={"size_bytes": SEGMENT_BYTES},
                         store={"eviction_interval_ms": 10, "lease_ttl_ms": 100},
                         ssd={"enabled": True, "directory": str(eio_fuse.mountpoint / "ssd"),
                              "capacity_bytes": 32 << 20, "file_bytes": 8 << 20,
                              "region_bytes": 1 << 20, "bounce_bytes": 4 << 20})
    node.start()
    try:
        with BlockingClient.connect(node.tcp_address) as tcp, \
                BlockingClient.connect(node.unix_address) as local:
            values = fill(tcp, 30)
            cold = [k for k in values if tier_of(tcp, k) == "ssd"]
            bad, bad_local, good = cold[:3]
            eio_fuse.set_faults(read=[
                _record_range(workdir, tcp.object_stat(key)["disk"], 4096, 4096)
                for key in (bad, bad_local)])
            with pytest.raises(MooncakedError) as info:
                tcp.get(bad)
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            with pytest.raises(MooncakedError) as info:
                local.get(bad_local)
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            assert tcp.get(good) == values[good] and local.get(cold[3]) == values[cold[3]]
            eio_fuse.set_faults()
            assert not tcp.exists(bad) and not tcp.exists(bad_local)  # dropped, not retried
            assert tiers(tcp)["ssd"]["misses"] == 2
            # Every write fails: values stay in DRAM (evicted as without a tier), and
            # offloading goes on one write at a time until one succeeds.
            eio_fuse.set_faults(write=[["ssd/ssd-0000.data", 0, 8 << 20],
                                       ["ssd/ssd-0001.data", 0, 8 << 20],
                                       ["ssd/ssd-0002.data", 0, 8 << 20],
                                       ["ssd/ssd-0003.data", 0, 8 << 20]])
            rng = random.Random(2)
            more = {}
            for i in range(6):
                more[f"w{i}"] = rng.randbytes(VALUE_BYTES)
                assert tcp.put(f"w{i}", more[f"w{i}"])
            wait_until(lambda: tiers(tcp)["ssd"]["failing"], what="a failed write")
            assert tiers(tcp)["offload"]["failed"] >= 1
            for key, value in more.items():
                try:
                    assert tcp.get(key) == value
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.OBJECT_NOT_FOUND  # evicted, never wrong
            eio_fuse.set_faults()
            after = fill(tcp, 10, prefix="after", seed=4)
            assert not tiers(tcp)["ssd"]["failing"]
            for key, value in after.items():
                assert tcp.get(key) == value
    finally:
        node.close()


def test_a_directory_formatted_with_other_sizes_stops_start_with_a_message(tmp_path):
    node = ssd_daemon(str(tmp_path))
    node.start()
    assert node.terminate() == 0
    other = ssd_daemon(str(tmp_path), ssd={"region_bytes": 2 << 20})
    with pytest.raises(RuntimeError) as info:
        other.start()
    assert "[ssd] directory" in str(info.value)
    other.close()
