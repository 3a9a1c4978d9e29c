"""Store semantics (Mooncake Store's) through the real daemon, over TCP and the Unix socket.

Each test starts mooncaked as a subprocess with the bounds it needs, drives it with the
blocking or the asyncio client, and checks the data and codes that come back.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
import urllib.request

import pytest

from mooncaked import BlockingClient, Client, ErrorCode, MooncakedError
from mooncaked.client.calls import ReplicateConfig


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not reached")


def code_of(call) -> int:
    with pytest.raises(MooncakedError) as info:
        call()
    return info.value.code


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_put_is_write_once_and_upsert_replaces(daemon, transport):
    address = daemon.tcp_address if transport == "tcp" else daemon.unix_address
    with BlockingClient.connect(address) as client:
        assert client.put("k", b"first") is True
        assert client.put("k", b"second!") is False
        assert client.get("k") == b"first"
        assert client.get_size("k") == 5
        client.upsert("k", b"replaced value")
        assert client.get("k") == b"replaced value"
        assert client.get_size("k") == 14
        client.upsert("new", b"via upsert")
        assert client.get("new") == b"via upsert"
        assert code_of(lambda: client.get("missing")) == ErrorCode.OBJECT_NOT_FOUND
        assert code_of(lambda: client.get_size("missing")) == ErrorCode.OBJECT_NOT_FOUND
        assert client.exists("missing") is False
        assert code_of(lambda: client.put("empty", b"")) == ErrorCode.INVALID_PARAMS


def test_large_values_round_trip_both_transports(daemon):
    value = os.urandom(16 << 20)
    with BlockingClient.connect(daemon.tcp_address) as tcp, \
            BlockingClient.connect(daemon.unix_address) as unix:
        assert tcp.put("big", value)
        assert unix.get("big") == value
        target = bytearray(16 << 20)
        assert tcp.get_into("big", target) == len(value)
        assert target == value
        small = bytearray(10)
        assert code_of(lambda: tcp.get_into("big", small)) == ErrorCode.INVALID_PARAMS
        assert tcp.ping() == "pong"  # the connection survived the refused read


def test_in_progress_put_is_invisible_until_put_end(daemon):
    with BlockingClient.connect(daemon.unix_address) as writer, \
            BlockingClient.connect(daemon.tcp_address) as reader:
        value = b"x" * 4096
        buffer = ctypes.create_string_buffer(value, len(value))
        segment_id, offset = writer._run(
            __import__("mooncaked.client.calls", fromlist=["put_start"]).put_start(
                "wip", len(value), None))
        writer.segments.write(segment_id, offset, ctypes.addressof(buffer), len(value))
        assert reader.exists("wip") is False
        assert code_of(lambda: reader.get("wip")) == ErrorCode.OBJECT_NOT_FOUND
        assert code_of(lambda: reader.remove("wip")) == ErrorCode.REPLICA_IS_NOT_READY
        assert reader.put("wip", b"other") is False  # a young in-progress put holds the key
        with BlockingClient.connect(daemon.unix_address) as other:
            assert code_of(lambda: other._run(
                __import__("mooncaked.client.calls", fromlist=["simple"]).simple(
                    "put_end", "wip"))) == ErrorCode.ILLEGAL_CLIENT
        writer._run(__import__("mooncaked.client.calls",
                               fromlist=["simple"]).simple("put_end", "wip"))
        assert reader.get("wip") == value


def test_read_lease_blocks_remove_until_it_ends(make_daemon):
    daemon = make_daemon(store={"lease_ttl_ms": 400})
    with BlockingClient.connect(daemon.tcp_address) as client:
        client.put("a", b"1")
        client.remove("a")  # a put grants no lease
        client.put("b", b"2")
        assert client.get("b") == b"2"
        assert code_of(lambda: client.remove("b")) == ErrorCode.OBJECT_HAS_LEASE
        assert client.batch_remove(["b"]) == [ErrorCode.OBJECT_HAS_LEASE]
        wait_until(lambda: _try_remove(client, "b"))
        assert code_of(lambda: client.remove("b")) == ErrorCode.OBJECT_NOT_FOUND
        client.put("c", b"3")
        client.exists("c")
        client.remove("c", force=True)
        assert client.exists("c") is False


def _try_remove(client, key) -> bool:
    try:
        client.remove(key)
        return True
    except MooncakedError as exc:
        assert exc.code == ErrorCode.OBJECT_HAS_LEASE
        return False


def test_forced_remove_keeps_leased_bytes_until_the_lease_ends(make_daemon):
    daemon = make_daemon(store={"lease_ttl_ms": 500})
    with BlockingClient.connect(daemon.unix_address) as client:
        baseline = client.segment_report()[0]["used_bytes"]
        client.put("k", b"v" * 1000)
        client.get("k")
        client.remove("k", force=True)
        assert client.exists("k") is False
        # The range is still held for the reader's lease, then freed.
        assert client.segment_report()[0]["used_bytes"] > baseline
        wait_until(lambda: client.segment_report()[0]["used_bytes"] == baseline)


def test_eviction_frees_oldest_first_and_spares_leased_and_pinned(make_daemon):
    daemon = make_daemon(segments={"size_bytes": 1 << 20},
                         store={"lease_ttl_ms": 60_000, "eviction_interval_ms": 20})
    value = b"e" * (64 << 10)
    with BlockingClient.connect(daemon.tcp_address) as client:
        client.put("hard", value, ReplicateConfig(with_hard_pin=True))
        client.put("soft", value, ReplicateConfig(with_soft_pin=True))
        client.put("leased", value)
        client.get("leased")  # a 60 s lease
        for i in range(40):  # 40 x 64 KiB into 1 MiB: eviction must make room
            assert client.put(f"k{i}", value) is True
        # One request sees one state: the daemon's sweep cannot run in the middle of it (a
        # read of each key in turn would lease it, and the sweep would then evict the others).
        flags = client.batch_exists([f"k{i}" for i in range(40)])
        present = [i for i in range(40) if flags[i]]
        assert 39 in present
        assert 0 not in present and 1 not in present  # the oldest went first
        assert present == list(range(present[0], 40))  # and only the oldest
        assert client.get("hard") == value
        assert client.get("leased") == value
        assert client.get("soft") == value  # soft pins go only when nothing else can
        status = client.status()
        assert status["evictions"]["objects"] >= 24


def test_no_space_returns_200_when_nothing_can_be_evicted(make_daemon):
    daemon = make_daemon(segments={"size_bytes": 1 << 20})
    with BlockingClient.connect(daemon.tcp_address) as client:
        assert code_of(lambda: client.put("huge", b"h" * (2 << 20))) == \
            ErrorCode.NO_AVAILABLE_HANDLE
        for i in range(15):
            client.put(f"pinned{i}", b"p" * (64 << 10), ReplicateConfig(with_hard_pin=True))
        assert code_of(lambda: client.put("one-more", b"p" * (128 << 10))) == \
            ErrorCode.NO_AVAILABLE_HANDLE
        assert client.exists("one-more") is False
        assert client.get("pinned0") == b"p" * (64 << 10)


def test_abandoned_put_is_preempted_then_freed(make_daemon):
    daemon = make_daemon(store={"put_start_discard_timeout_ms": 200,
                                "put_start_release_timeout_ms": 600,
                                "eviction_interval_ms": 20, "lease_ttl_ms": 300})
    from mooncaked.client import calls
    with BlockingClient.connect(daemon.unix_address) as stale, \
            BlockingClient.connect(daemon.unix_address) as fresh:
        baseline = fresh.segment_report()[0]["used_bytes"]
        stale._run(calls.put_start("k", 8192, None))
        assert fresh.put("k", b"young") is False
        wait_until(lambda: fresh.put("k", b"taken over"), timeout_s=5)
        assert fresh.get("k") == b"taken over"
        # The preempted range is released after the release timeout, not before reuse.
        wait_until(lambda: fresh.segment_report()[0]["allocations"] == 1)
        # The stale writer's put is gone: ending it is refused, the new value stays.
        assert code_of(lambda: stale._run(calls.simple("put_end", "k"))) == \
            ErrorCode.INVALID_WRITE
        assert fresh.get("k") == b"taken over"
        fresh.remove("k", force=True)
        wait_until(lambda: fresh.segment_report()[0]["used_bytes"] == baseline)


def test_namespaces_isolate_keys(daemon):
    with BlockingClient.connect(daemon.tcp_address, namespace="model-a") as a, \
            BlockingClient.connect(daemon.tcp_address, namespace="model-b") as b:
        assert a.put("block:1", b"A") is True
        assert b.put("block:1", b"B") is True
        assert a.get("block:1") == b"A"
        assert b.get("block:1") == b"B"
        b.remove("block:1", force=True)
        assert a.get("block:1") == b"A"
        assert b.remove_all() == 0
        assert a.exists("block:1") is True
    with pytest.raises(MooncakedError) as info:
        BlockingClient.connect(daemon.tcp_address, namespace="bad namespace!")
    assert info.value.code == ErrorCode.INVALID_PARAMS


def test_batches_regex_and_remove_all(daemon):
    with BlockingClient.connect(daemon.tcp_address) as client:
        keys = [f"req:{i}" for i in range(10)] + ["other"]
        values = [os.urandom(100 + i) for i in range(len(keys))]
        assert client.batch_put(keys, values) == [0] * len(keys)
        assert client.batch_put(["req:0", "fresh"], [b"x", b"y"]) == [1, 0]
        assert client.batch_get(["req:3", "nope", "fresh"]) == [values[3], None, b"y"]
        assert client.batch_exists(["req:9", "nope"]) == [True, False]
        # req:3 was read (leased), so the regex removes the other four it matches.
        assert client.remove_by_regex(r"^req:[0-4]$") == 4
        assert client.batch_exists([f"req:{i}" for i in range(5)]) == \
            [False, False, False, True, False]
        assert client.batch_remove(["req:5", "nope", "req:3"]) == \
            [0, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_HAS_LEASE]


def test_remove_by_regex_skips_leased_unless_forced(daemon):
    with BlockingClient.connect(daemon.tcp_address) as client:
        for i in range(6):
            client.put(f"r{i}", b"v")
        client.get("r1")
        assert client.remove_by_regex(r"^r[0-3]$") == 3
        assert client.batch_exists([f"r{i}" for i in range(6)]) == \
            [False, True, False, False, True, True]
        assert client.remove_by_regex(r"^r", force=True) == 3
        client.put("x", b"1")
        client.put("y", b"2")
        assert client.remove_all() == 2
        assert client.batch_exists(["x", "y"]) == [False, False]


def test_replicas_land_on_distinct_segments(make_daemon):
    daemon = make_daemon(segments={"count": 3, "size_bytes": 4 << 20})
    with BlockingClient.connect(daemon.unix_address) as client:
        client.put("two", b"r" * 5000, ReplicateConfig(replica_num=2))
        replicas = client.object_stat("two")["replicas"]
        assert len(replicas) == 2 and replicas[0]["segment_id"] != replicas[1]["segment_id"]
        client.put("many", b"m" * 100, ReplicateConfig(replica_num=5))  # best effort
        assert len(client.object_stat("many")["replicas"]) == 3
        name = client.segment_report()[2]["name"]
        client.put("placed", b"p", ReplicateConfig(preferred_segments=[name]))
        assert client.object_stat("placed")["replicas"][0]["segment_id"] == 2
        assert client.get("two") == b"r" * 5000


def test_soft_pin_and_hard_pin_are_reported(daemon):
    with BlockingClient.connect(daemon.tcp_address) as client:
        client.put("s", b"1", ReplicateConfig(with_soft_pin=True, soft_pin_ttl_ms=60_000))
        client.put("h", b"2", ReplicateConfig(with_hard_pin=True))
        soft = client.object_stat("s")
        assert 0 < soft["soft_pin_expires_in_ms"] <= 60_000 and soft["hard_pin"] is False
        assert client.object_stat("h")["hard_pin"] is True
        assert code_of(lambda: client.put("t", b"3", ReplicateConfig(
            with_soft_pin=True, soft_pin_ttl_ms=10 ** 12))) == ErrorCode.INVALID_PARAMS
        client.remove("h")  # a hard pin does not block remove (as in Mooncake)


def _payload_bytes_in(daemon) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('mooncaked_payload_bytes_total{direction="in"}'):
                return float(line.split()[-1])
    raise AssertionError("no payload counter")


def test_local_zero_copy_moves_no_payload_through_the_socket(daemon):
    size = 1 << 20
    source = ctypes.create_string_buffer(os.urandom(size), size)
    target = ctypes.create_string_buffer(size)
    with BlockingClient.connect(daemon.unix_address) as client:
        assert client.segments is not None
        before = _payload_bytes_in(daemon)
        assert client.put_from("zc", ctypes.addressof(source), size) is True
        assert client.put_from("zc", ctypes.addressof(source), size) is False
        assert client.get_into_address("zc", ctypes.addressof(target), size) == size
        assert target.raw == source.raw
        assert _payload_bytes_in(daemon) == before
        keys = [f"b{i}" for i in range(8)]
        sources = [ctypes.create_string_buffer(os.urandom(4096), 4096) for _ in keys]
        targets = [ctypes.create_string_buffer(4096) for _ in keys]
        assert client.batch_put_from(keys, [ctypes.addressof(s) for s in sources],
                                     [4096] * 8) == [0] * 8
        assert client.batch_get_into(keys + ["none"],
                                     [ctypes.addressof(t) for t in targets] + [0],
                                     [4096] * 9) == [4096] * 8 + [ErrorCode.OBJECT_NOT_FOUND]
        assert [t.raw for t in targets] == [s.raw for s in sources]
    with BlockingClient.connect(daemon.tcp_address) as tcp:  # no shared memory: same results
        assert tcp.segments is None
        copy = ctypes.create_string_buffer(size)
        assert tcp.get_into_address("zc", ctypes.addressof(copy), size) == size
        assert copy.raw == source.raw


def test_async_client_pipelines_requests(daemon):
    async def scenario():
        async with await Client.connect(daemon.unix_address, namespace="aio") as client:
            values = {f"k{i}": os.urandom(1000 + i) for i in range(200)}
            stored = await asyncio.gather(*(client.put(k, v) for k, v in values.items()))
            assert all(stored)
            got = await asyncio.gather(*(client.get(k) for k in values))
            assert got == list(values.values())
            assert await client.batch_exists(["k0", "zz"]) == [True, False]
            with pytest.raises(MooncakedError) as info:
                await client.get("zz")
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
            buffer = ctypes.create_string_buffer(b"z" * 65536, 65536)
            assert await client.put_from("shm", ctypes.addressof(buffer), 65536)
            out = ctypes.create_string_buffer(65536)
            assert await client.get_into_address("shm", ctypes.addressof(out), 65536) == 65536
            assert out.raw == buffer.raw
            assert (await client.status())["objects"] == 201
    asyncio.run(scenario())
