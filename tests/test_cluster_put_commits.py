"""What a put costs the Raft log, on real daemons: one entry per put, and puts whose commits
are proposed together (the keys of one batch_put) share entries."""

from __future__ import annotations

import pytest

from cluster_harness import Cluster


@pytest.fixture
def one_node():
    cluster = Cluster(1, cluster={"fsync": "none"})
    try:
        yield cluster.start()
    finally:
        cluster.close()


def _last_index(client) -> int:
    return client.call("cluster_status")["last_index"]


def test_a_put_takes_one_log_entry(one_node):
    with one_node.client(1) as client:
        client.put("warm", b"w" * 1000)  # the first put also reserves the arenas
        before = _last_index(client)
        for i in range(40):
            assert client.put(f"k{i}", bytes([i]) * 1000)
        assert _last_index(client) - before == 40
        for i in range(40):
            assert client.get(f"k{i}") == bytes([i]) * 1000


def test_the_keys_of_a_batch_put_share_log_entries(one_node):
    with one_node.client(1) as client:
        client.put("warm", b"w" * 1000)
        before = _last_index(client)
        keys = [f"b{i}" for i in range(32)]
        values = [bytes([i]) * 4096 for i in range(32)]
        assert client.batch_put(keys, values) == [0] * 32
        assert _last_index(client) - before <= 2  # 32 puts: one Batch entry (or two)
        assert [client.get(key) for key in keys] == values
        # An existing key in a batch fails alone; the others still commit.
        result = client.batch_put(["b0", "new"], [b"x", b"y"])
        assert result == [1, 0]
        assert client.get("b0") == values[0] and client.get("new") == b"y"
