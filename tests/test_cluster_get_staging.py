"""A cluster node's local clients get values through its get staging area (get_staged,
wire/PROTOCOL.md): another node's replica is received straight into memory the client maps,
not sent to it through the socket."""

from __future__ import annotations

import pytest

from cluster_harness import Cluster, applied_replicas
from mooncaked._native import buffer_address
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import Call, ReplicateConfig
from mooncaked.config import ConfigError, from_dict
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c

MIB = 1 << 20
STAGING_BYTES = 4 * MIB


def value_of(size: int, tag: int) -> bytes:
    return (tag.to_bytes(8, "little") * (size // 8 + 1))[:size]


@pytest.fixture(scope="module")
def nodes():
    """A 3-node cluster with a small staging area; values over 1 MiB take several stripes.
    node_ttl_ms is long so that a killed node's replicas stay listed (its fetch fails)."""
    cluster = Cluster(3, cluster={"get_staging_bytes": STAGING_BYTES, "stripe_bytes": MIB,
                                  "node_ttl_ms": 600_000, "rpc_timeout_ms": 3000},
                      segments={"prefault": True})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        reader, holder = [i for i in (1, 2, 3) if i != leader]
        yield cluster, leader, reader, holder
    finally:
        cluster.close()


def local_client(cluster, node_id: int) -> BlockingClient:
    return BlockingClient.connect(cluster.nodes[node_id].unix_address, timeout_s=10)


def put_on(cluster, via: int, node_id: int, key: str, value: bytes) -> None:
    with cluster.client(via) as client:
        assert client.put(key, value, ReplicateConfig(preferred_segments=[f"node{node_id}/0"]))
        replicas = applied_replicas(client, key)
    assert [c.node_of_segment(r["segment_id"]) for r in replicas] == [node_id]


def raw_get_staged(client: BlockingClient, key: str, release: list) -> tuple:
    """([offset or None, size], payload) of one get_staged request."""
    return client._request(Call("get_staged", [key, release],
                                parse=lambda result, payload: (result, payload)), True)


def test_a_local_client_receives_another_nodes_replica_in_mapped_memory(nodes):
    cluster, leader, reader, holder = nodes
    value = value_of(3 * MIB + 5, 1)  # 4 stripes
    put_on(cluster, leader, holder, "remote-3m", value)
    with local_client(cluster, reader) as client:
        assert client.get_staging is not None
        assert client.server["get_staging"]["prefaulted"] is True  # mapped populated
        # The answer names a range of the staging area and carries no payload.
        (offset, size), payload = raw_get_staged(client, "remote-3m", [])
        assert offset is not None and size == len(value) and not payload
        copied = bytearray(size)
        client.get_staging.read(offset, buffer_address(copied), size)
        assert bytes(copied) == value
        client._request(Call("release_staged", [[offset]]), False)
        # The client's get and get_into_address take the same path and hand each range back
        # with the next request: many gets of a value most of the area's size all stage.
        for _ in range(5):
            assert client.get("remote-3m") == value
        target = bytearray(len(value))
        assert client.get_into_address("remote-3m", buffer_address(target), len(target)) \
            == len(value)
        assert bytes(target) == value
        release = client.get_staging.take_release()
        assert len(release) == 1
        (offset, _), _ = raw_get_staged(client, "remote-3m", release)
        assert offset is not None
        staging = client.call("cluster_status")["get_staging"]
        assert staging["size_bytes"] == STAGING_BYTES and staging["held_bytes"] >= 3 * MIB
        assert staging["staged_gets"] >= 8 and staging["staged_bytes"] >= 8 * len(value)


def test_the_asyncio_client_stages_concurrent_gets_on_one_connection(nodes):
    import asyncio

    from mooncaked.client.aio import Client
    cluster, leader, reader, holder = nodes
    values = {f"aio-{i}": value_of(700_000 + i, 10 + i) for i in range(4)}
    for key, value in values.items():
        put_on(cluster, leader, holder, key, value)

    async def run() -> list:
        client = await Client.connect(cluster.nodes[reader].unix_address)
        try:
            assert client.get_staging is not None
            got = await asyncio.gather(*(client.get(key) for key in values))
            return got + [len(client.get_staging.to_release)]
        finally:
            await client.close()
    *got, held = asyncio.run(run())
    assert got == list(values.values())
    assert 1 <= held <= len(values)  # every range but those handed back with later gets


def test_a_replica_on_the_reading_node_is_staged_too(nodes):
    cluster, leader, reader, holder = nodes
    value = value_of(100_000, 2)
    put_on(cluster, leader, reader, "own-100k", value)
    with local_client(cluster, reader) as client:
        (offset, size), _ = raw_get_staged(client, "own-100k", [])
        assert offset is not None and size == len(value)
        client.get_staging.to_release.append(offset)
        assert client.get("own-100k") == value


def test_a_value_larger_than_the_area_comes_through_the_socket(nodes):
    cluster, leader, reader, holder = nodes
    value = value_of(STAGING_BYTES + 1, 3)
    put_on(cluster, leader, holder, "remote-big", value)
    with local_client(cluster, reader) as client:
        (offset, size), payload = raw_get_staged(client, "remote-big", [])
        assert offset is None and size == len(value) and bytes(payload) == value
        assert client.get("remote-big") == value
        small = bytearray(10)
        with pytest.raises(MooncakedError) as raised:
            client.get_into_address("remote-big", buffer_address(small), len(small))
        assert raised.value.code == ErrorCode.INVALID_PARAMS


def test_a_full_area_answers_through_the_socket_and_frees_on_release(nodes):
    cluster, leader, reader, holder = nodes
    value = value_of(3 * MIB, 4)
    put_on(cluster, leader, holder, "remote-3m-b", value)
    with local_client(cluster, reader) as client:
        (first, _), _ = raw_get_staged(client, "remote-3m-b", [])
        assert first is not None
        (second, _), payload = raw_get_staged(client, "remote-3m-b", [])  # first still held
        assert second is None and bytes(payload) == value
        assert client.call("cluster_status")["get_staging"]["staging_full"] >= 1
        (third, _), _ = raw_get_staged(client, "remote-3m-b", [first])
        assert third is not None


def test_ranges_are_the_connections_own_and_freed_when_it_closes(nodes):
    cluster, leader, reader, holder = nodes
    value = value_of(3 * MIB, 5)
    put_on(cluster, leader, holder, "remote-3m-c", value)
    with local_client(cluster, reader) as one, local_client(cluster, reader) as other:
        (held, _), _ = raw_get_staged(one, "remote-3m-c", [])
        assert held is not None
        # Another connection cannot release it (and releases nothing of its own then).
        with pytest.raises(MooncakedError) as raised:
            raw_get_staged(other, "remote-3m-c", [held])
        assert raised.value.code == ErrorCode.INVALID_PARAMS
        # A list with a bad entry is refused whole: the valid range stays held.
        with pytest.raises(MooncakedError) as raised:
            raw_get_staged(one, "remote-3m-c", [held, held + 64])
        assert raised.value.code == ErrorCode.INVALID_PARAMS
        with pytest.raises(MooncakedError):
            one._request(Call("release_staged", [["x"]]), False)
        (none_left, _), _ = raw_get_staged(other, "remote-3m-c", [])
        assert none_left is None  # `one` still holds its 3 MiB of the 4 MiB area
    with local_client(cluster, reader) as client:  # `one` closed: its range is free
        (offset, _), _ = raw_get_staged(client, "remote-3m-c", [])
        assert offset is not None


def test_errors_a_get_staged_can_answer(nodes):
    cluster, leader, reader, holder = nodes
    with local_client(cluster, reader) as client:
        with pytest.raises(MooncakedError) as raised:
            raw_get_staged(client, "no-such-key", [])
        assert raised.value.code == ErrorCode.OBJECT_NOT_FOUND
        assert client.get_staging.take_release() == []
    with cluster.client(reader) as tcp:  # not offered over TCP: the bytes go by the socket
        assert "get_staging" not in tcp.server
        with pytest.raises(MooncakedError) as raised:
            raw_get_staged(tcp, "no-such-key", [])
        assert raised.value.code == ErrorCode.NOT_SUPPORTED


def test_a_failed_fetch_gives_its_range_back(nodes):
    """Runs last in this file: it kills the holder node."""
    cluster, leader, reader, holder = nodes
    value = value_of(3 * MIB, 6)
    put_on(cluster, leader, holder, "lost-3m", value)
    put_on(cluster, leader, leader, "kept-3m", value)
    cluster.nodes[holder].kill()
    with local_client(cluster, reader) as client:
        with pytest.raises(MooncakedError) as raised:
            raw_get_staged(client, "lost-3m", [])
        assert raised.value.code == ErrorCode.TRANSFER_FAIL
        # The 3 MiB range of the failed get is free again: the next one stages.
        (offset, size), _ = raw_get_staged(client, "kept-3m", [])
        assert offset is not None and size == len(value)
        client.get_staging.to_release.append(offset)
        assert client.get("kept-3m") == value


def test_no_staging_area_when_it_is_off():
    cluster = Cluster(1, cluster={"get_staging_bytes": 0})
    try:
        cluster.start()
        value = value_of(2 * MIB, 7)
        with local_client(cluster, 1) as client:
            assert client.get_staging is None and "get_staging" not in client.server
            assert client.call("cluster_status")["get_staging"] is None
            assert client.put("k", value) is True
            assert client.get("k") == value
            with pytest.raises(MooncakedError) as raised:
                raw_get_staged(client, "k", [])
            assert raised.value.code == ErrorCode.NOT_SUPPORTED
    finally:
        cluster.close()


def test_the_staging_size_is_checked():
    with pytest.raises(ConfigError, match="get_staging_bytes"):
        from_dict({"cluster": {"get_staging_bytes": -1}})
