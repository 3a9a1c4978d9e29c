"""Reservations (wire/PROTOCOL.md 5.2): a local put in one round trip, against a real daemon.

Round trips are counted by wrapping the connection's `_run` (one call = one request and its
answer). Bytes are checked from another connection as soon as a put returns. Space is checked
with `status` (`used_bytes`, `reserved_bytes`).
"""

from __future__ import annotations

import asyncio
import ctypes
import time

import pytest

from mooncaked import BlockingClient
from mooncaked.client.aio import Client
from mooncaked.client.calls import ReplicateConfig
from mooncaked.client.pool import ClientPool
from mooncaked.errors import ErrorCode, MooncakedError

KIB, MIB = 1024, 1 << 20


def counted(client: BlockingClient) -> list:
    """Count the requests a client sends: the list holds their method names."""
    sent = []
    run = client._run

    def counting(call):
        sent.append(call.method)
        return run(call)
    client._run = counting
    return sent


def buffer(size: int, seed: int):
    data = bytes((seed + i * 7) & 0xFF for i in range(256)) * (size // 256) + b"z" * (size % 256)
    return ctypes.create_string_buffer(data, size), data


def wait_for(check, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("size", [4 * KIB, MIB])
def test_put_from_is_one_round_trip_in_steady_state(daemon, size):
    writer = BlockingClient.connect(daemon.unix_address)
    reader = BlockingClient.connect(daemon.unix_address)
    sent = counted(writer)
    out = ctypes.create_string_buffer(size)
    for i in range(20):
        block, data = buffer(size, i)
        sent.clear()
        assert writer.put_from(f"k{i}", ctypes.addressof(block), size) is True
        # First of a size: reserve + commit; then one put_commit that also refills.
        assert sent == (["reserve", "put_commit"] if i == 0 else ["put_commit"])
        # Readable by another connection the moment put_from returns, with its exact bytes.
        assert reader.get_into_address(f"k{i}", ctypes.addressof(out), size) == size
        assert out.raw == data
    status = reader.status()
    assert status["objects"] == 20 and status["reserved_bytes"] == size
    writer.close()
    reader.close()


def test_batch_put_from_and_ranges_are_one_round_trip(daemon):
    client = BlockingClient.connect(daemon.unix_address)
    sent = counted(client)
    size = 16 * KIB
    blocks = [buffer(size, i) for i in range(8)]
    for round_ in range(3):
        keys = [f"b{round_}:{i}" for i in range(8)]
        sent.clear()
        assert client.batch_put_from(keys, [ctypes.addressof(b) for b, _ in blocks],
                                     [size] * 8) == [0] * 8
        assert sent == (["reserve", "batch_put_commit"] if round_ == 0 else ["batch_put_commit"])
        assert client.batch_get(keys) == [d for _, d in blocks]
    # Gathered from two halves per key (as batch_put_from_multi_buffers does), same size: the
    # stock the batches left serves it at once.
    half = size // 2
    sent.clear()
    keys = [f"r:{i}" for i in range(8)]
    ranges = [[(0, ctypes.addressof(b), half), (half, ctypes.addressof(b) + half, half)]
              for b, _ in blocks]
    assert client.batch_put_from_ranges(keys, [size] * 8, ranges) == [0] * 8
    assert sent == ["batch_put_commit"]
    assert client.batch_get(keys) == [d for _, d in blocks]
    client.close()


def test_write_once_keeps_the_value_and_the_range(daemon):
    client = BlockingClient.connect(daemon.unix_address)
    first, first_data = buffer(8 * KIB, 1)
    second, _ = buffer(8 * KIB, 2)
    assert client.put_from("k", ctypes.addressof(first), 8 * KIB) is True
    held = client.reservation_stock.held_bytes
    sent = counted(client)
    assert client.put_from("k", ctypes.addressof(second), 8 * KIB) is False
    assert sent == ["put_commit"]
    assert client.get("k") == first_data
    # The range came back to stock (and the refill added one): the next put needs no reserve.
    assert client.reservation_stock.held_bytes == held + 8 * KIB
    sent.clear()
    assert client.put_from("k2", ctypes.addressof(second), 8 * KIB) is True
    assert sent == ["put_commit"]
    # The same on the wire: a commit of an existing key answers false and keeps the range.
    [[segment_id, offset, size]] = client.call("reserve", [[4 * KIB, 1]])
    assert client.call("put_commit", "k", segment_id, offset, size, None, [], []) == [False, []]
    assert client.call("put_commit", "k3", segment_id, offset, size, None, [], []) == [True, []]
    [fresh] = client.call("reserve", [[4 * KIB, 1]])
    codes, _ = client.call("batch_put_commit", ["k", "k4"], [[segment_id, offset, size], fresh])
    assert codes == [int(ErrorCode.INVALID_WRITE), 0]  # k3 used up that range; k4 is stored
    assert client.get("k") == first_data
    client.close()


def test_reservations_are_freed_when_the_connection_closes(daemon):
    watcher = BlockingClient.connect(daemon.unix_address)
    before = watcher.status()["used_bytes"]
    client = BlockingClient.connect(daemon.unix_address)
    block, _ = buffer(64 * KIB, 3)
    for i in range(4):
        assert client.put_from(f"k{i}", ctypes.addressof(block), 64 * KIB) is True
    assert client.call("reserve", [[MIB, 3]]) != []
    status = watcher.status()
    assert status["reserved_bytes"] == 64 * KIB + 3 * MIB
    assert status["used_bytes"] == before + 4 * 64 * KIB + status["reserved_bytes"]
    assert status["objects"] == 4 and status["puts_in_progress"] == 0
    client.close()
    wait_for(lambda: watcher.status()["reserved_bytes"] == 0)
    assert watcher.status()["used_bytes"] == before + 4 * 64 * KIB
    watcher.close()


def test_reservations_are_released_after_the_timeout(make_daemon):
    daemon = make_daemon(store={"put_start_release_timeout_ms": 400,
                                "put_start_discard_timeout_ms": 200,
                                "eviction_interval_ms": 20})
    client = BlockingClient.connect(daemon.unix_address)
    assert client.server["reservation_ttl_ms"] == 400
    [[segment_id, offset, size]] = client.call("reserve", [[4 * KIB, 1]])
    assert client.status()["reserved_bytes"] == 4 * KIB
    wait_for(lambda: client.status()["used_bytes"] == 0)
    assert client.status()["reserved_bytes"] == 0
    with pytest.raises(MooncakedError) as info:
        client.call("put_commit", "k", segment_id, offset, size)
    assert info.value.code == ErrorCode.INVALID_WRITE
    # The client never writes into a range older than half the lifetime: it gives it back
    # and reserves anew (two round trips), and the value is whole.
    block, data = buffer(4 * KIB, 4)
    assert client.put_from("a", ctypes.addressof(block), 4 * KIB) is True
    time.sleep(0.25)
    sent = counted(client)
    assert client.put_from("b", ctypes.addressof(block), 4 * KIB) is True
    assert sent == ["reserve", "put_commit"]
    assert client.get("b") == data
    client.close()


def test_the_per_connection_bound_is_enforced(make_daemon):
    daemon = make_daemon(server={"max_reserved_bytes_per_connection": 16 * KIB})
    client = BlockingClient.connect(daemon.unix_address)
    assert client.server["max_reserved_bytes"] == 16 * KIB
    assert len(client.call("reserve", [[4 * KIB, 10]])) == 4  # fewer granted, no error
    assert client.call("reserve", [[KIB, 1]]) == []
    other = BlockingClient.connect(daemon.unix_address)  # per connection
    assert len(other.call("reserve", [[8 * KIB, 3]])) == 2
    assert other.status()["reserved_bytes"] == 32 * KIB
    # A value over the bound takes put_start / put_end, as before.
    block, data = buffer(64 * KIB, 5)
    sent = counted(other)
    assert other.put_from("big", ctypes.addressof(block), 64 * KIB) is True
    assert sent == ["put_start", "put_end"]
    assert client.get("big") == data
    client.close()
    other.close()


def test_a_new_size_takes_the_room_of_the_least_recently_used(make_daemon):
    daemon = make_daemon(server={"max_reserved_bytes_per_connection": 64 * KIB})
    client = BlockingClient.connect(daemon.unix_address)
    small, _ = buffer(32 * KIB, 10)
    large, data = buffer(48 * KIB, 11)
    for i in range(2):
        assert client.put_from(f"s{i}", ctypes.addressof(small), 32 * KIB) is True
    assert client.status()["reserved_bytes"] == 32 * KIB
    sent = counted(client)
    for i in range(3):
        sent.clear()
        assert client.put_from(f"l{i}", ctypes.addressof(large), 48 * KIB) is True
        # 32 + 48 KiB would pass the bound: the 32 KiB range is given back in the reserve.
        assert sent == (["reserve", "put_commit"] if i == 0 else ["put_commit"])
        assert client.status()["reserved_bytes"] == 48 * KIB
    assert client.get("l2") == data
    client.close()


def test_no_reservations_when_configured_off_or_over_tcp(make_daemon):
    daemon = make_daemon(server={"max_reserved_bytes_per_connection": 0})
    client = BlockingClient.connect(daemon.unix_address)
    assert client.reservation_stock is None
    block, data = buffer(8 * KIB, 6)
    sent = counted(client)
    assert client.put_from("k", ctypes.addressof(block), 8 * KIB) is True
    assert sent == ["put_start", "put_end"]
    assert client.call("reserve", [[KIB, 1]]) == []
    tcp = BlockingClient.connect(daemon.tcp_address)
    assert tcp.server["max_reserved_bytes"] == 0
    for method, params in (("reserve", [[[KIB, 1]]]), ("put_commit", ["k", 0, 0, 1]),
                           ("batch_put_commit", [["k"], [[0, 0, 1]]])):
        with pytest.raises(MooncakedError) as info:
            tcp.call(method, *params)
        assert info.value.code == ErrorCode.NOT_SUPPORTED
    assert tcp.get("k") == data
    client.close()
    tcp.close()


def test_bad_commits_are_refused_and_nothing_is_lost(daemon):
    owner = BlockingClient.connect(daemon.unix_address)
    thief = BlockingClient.connect(daemon.unix_address)
    [[segment_id, offset, size]] = owner.call("reserve", [[4 * KIB, 1]])
    block, data = buffer(4 * KIB, 7)
    owner.segments.write(segment_id, offset, ctypes.addressof(block), size)

    def refused(client, code, *params):
        with pytest.raises(MooncakedError) as info:
            client.call("put_commit", *params)
        assert info.value.code == code, info.value

    refused(thief, ErrorCode.ILLEGAL_CLIENT, "k", segment_id, offset, size)
    refused(owner, ErrorCode.INVALID_WRITE, "k", segment_id, offset + 64, size)
    refused(owner, ErrorCode.INVALID_WRITE, "k", 99, 0, size)
    refused(owner, ErrorCode.INVALID_PARAMS, "k", segment_id, offset, size - 1)
    refused(owner, ErrorCode.INVALID_PARAMS, "k", segment_id, offset, size, {"replica_num": 2})
    refused(owner, ErrorCode.INVALID_PARAMS, "k", segment_id, offset, size,
            {"preferred_segments": ["test-node/0"]})
    # The thief's release of it is ignored; its batch gets per-key codes.
    assert thief.call("reserve", [], [[segment_id, offset]]) == []
    codes, _ = thief.call("batch_put_commit", ["k"], [[segment_id, offset, size]])
    assert codes == [int(ErrorCode.ILLEGAL_CLIENT)]
    with pytest.raises(MooncakedError) as info:  # one range twice in a batch
        owner.call("batch_put_commit", ["a", "b"], [[segment_id, offset, size]] * 2)
    assert info.value.code == ErrorCode.INVALID_PARAMS
    assert not owner.exists("k") and owner.status()["reserved_bytes"] == size
    # Nothing was lost: the owner still commits it, with its bytes.
    assert owner.call("put_commit", "k", segment_id, offset, size) == [True, []]
    assert thief.get("k") == data
    refused(owner, ErrorCode.INVALID_WRITE, "k2", segment_id, offset, size)  # used up
    owner.close()
    thief.close()


def test_reservations_are_hidden_from_listings(daemon):
    client = BlockingClient.connect(daemon.unix_address)
    client.call("reserve", [[4 * KIB, 3]])
    assert client.objects_list(namespace="*") == []
    assert client.objects_list(namespace="#reserved") == []
    status = client.status()
    assert status["objects"] == 0 and status["puts_in_progress"] == 0
    with pytest.raises(MooncakedError) as info:  # the daemon names the first one "1/1"
        client.object_stat("1/1", namespace="#reserved")
    assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
    assert client.remove_all(force=True) == 0
    assert client.status()["reserved_bytes"] == 12 * KIB
    client.close()


def test_configs_the_commit_cannot_hold_take_put_start(daemon):
    client = BlockingClient.connect(daemon.unix_address)
    block, data = buffer(8 * KIB, 8)
    sent = counted(client)
    assert client.put_from("r2", ctypes.addressof(block), 8 * KIB,
                           ReplicateConfig(replica_num=2)) is True
    assert sent == ["put_start", "put_end"]
    # Pins apply at the commit.
    for i in range(2):
        sent.clear()
        assert client.put_from(f"pin{i}", ctypes.addressof(block), 8 * KIB,
                               ReplicateConfig(with_hard_pin=True)) is True
        assert sent == (["reserve", "put_commit"] if i == 0 else ["put_commit"])
    assert client.object_stat("pin1")["hard_pin"] is True
    assert client.get("pin1") == data
    client.close()


def test_pool_connections_keep_their_own_stock(daemon):
    pool = ClientPool.connect(daemon.unix_address, max_connections=2)
    block, data = buffer(32 * KIB, 9)
    for i in range(10):
        assert pool.put_from(f"p{i}", ctypes.addressof(block), 32 * KIB) is True
    [connection] = pool._idle
    sent = counted(connection)
    assert pool.put_from("last", ctypes.addressof(block), 32 * KIB) is True
    assert sent == ["put_commit"]
    assert pool.get("last") == data
    pool.close()
    watcher = BlockingClient.connect(daemon.unix_address)
    wait_for(lambda: watcher.status()["reserved_bytes"] == 0)
    watcher.close()


def test_asyncio_client_puts_concurrently_through_its_stock(daemon):
    size = 16 * KIB
    blocks = [buffer(size, i) for i in range(40)]

    async def main():
        async with await Client.connect(daemon.unix_address) as client:
            for round_ in range(2):
                results = await asyncio.gather(*(
                    client.put_from(f"a{round_}:{i}", ctypes.addressof(b), size)
                    for i, (b, _) in enumerate(blocks)))
                assert results == [True] * len(blocks)
            assert client.reservation_stock.held_bytes <= 40 * size
            values = await client.batch_get([f"a1:{i}" for i in range(40)])
            assert values == [d for _, d in blocks]
    asyncio.run(main())
