"""A node cut off past node_ttl_ms gets its replicas back when it returns (real daemons).

Three nodes, values put with replica_num 2. One follower is cut off from the others
(nftables, tests/cluster_harness.py) until the leader declares it down, then the cut heals.
The node's process and memory were never lost: it returns under a new mount generation with
the replicas of every value that is still current, so each value has its two replicas again.
The proof that they are real replicas: another node is then killed, and every acknowledged
value still reads back with its bytes. With repair off, nothing but the return can have put
them back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cluster_harness import Cluster, Partition, replicas_by_key, wait_until
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ObjectNotFound

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = (1, 2, 3)
TWO = ReplicateConfig(replica_num=2)


def value_of(index: int) -> bytes:
    size = 1000 + 7919 * index % 50_000
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def node_entry(cluster: Cluster, ask: int, node: int) -> dict | None:
    status = cluster.status(ask) or {}
    return next((n for n in status.get("nodes", []) if n["node_id"] == node), None)


@pytest.fixture
def partition():
    try:
        cut = Partition()
    except RuntimeError as exc:
        pytest.skip(f"no partitions here: {exc}")
    try:
        yield cut
    finally:
        cut.close()


def cut_off_until_declared_down(cluster: Cluster, partition: Partition, leader: int,
                                node: int) -> int:
    """Cut `node` off, wait until the leader declares it down, heal; returns its mount
    generation from before the cut."""
    generation = cluster.status(node)["mount_generation"]
    partition.isolate(node, list(NODES))
    try:
        wait_until(f"node {node} declared down", lambda: (
            (entry := node_entry(cluster, leader, node)) and not entry["up"]))
        kept = node_entry(cluster, leader, node)["kept_replicas"]
        assert kept > 0
        shown = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a",
                                cluster.nodes[leader].tcp_address, "-o", "json", "cluster",
                                "members"], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PYTHONPATH=REPO))
        assert shown.returncode == 0, shown.stderr
        members = {m["node_id"]: m for m in json.loads(shown.stdout)}
        assert members[node]["kept_replicas"] == kept and not members[node]["up"]
    finally:
        partition.heal()
    wait_until(f"node {node} registered again", lambda: (
        (status := cluster.status(node)) and status["registered"]
        and status["mount_generation"] != generation
        and (entry := node_entry(cluster, leader, node)) and entry["up"]))
    return generation


def test_a_node_cut_off_past_its_ttl_returns_with_its_replicas(partition):
    cluster = Cluster(3, cluster={"repair_bytes_per_s": 0})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        cut, other = [i for i in NODES if i != leader]
        keys = [f"r{i}" for i in range(40)]
        with cluster.client(leader) as client:
            for i, key in enumerate(keys):
                assert client.put(key, value_of(i), TWO) is True
        placed = replicas_by_key(cluster, leader, keys)
        on_cut = [key for key, nodes in placed.items() if cut in nodes]
        on_cut_and_leader = [key for key in on_cut if leader in placed[key]]
        assert on_cut_and_leader, placed

        cut_off_until_declared_down(cluster, partition, leader, cut)
        # Every value has its two replicas again, where they were: the returning node's
        # replicas are back (repair is off).
        restored = wait_until("every value back to two replicas", lambda: (
            (found := replicas_by_key(cluster, leader, keys))
            and all(len(n) == 2 for n in found.values()) and found))
        assert restored == placed
        assert node_entry(cluster, leader, cut)["kept_replicas"] == 0
        assert cluster.status(cut)["returns"] == 1
        # The node serves its restored replicas itself.
        with cluster.client(cut) as client:
            for key in on_cut:
                assert client.get(key) == value_of(keys.index(key)), key

        # They are real replicas: lose the leader, which held the other replica of some.
        cluster.nodes[leader].kill()
        alive = [cut, other]
        cluster.wait_for_leader(among=alive)
        for node in alive:
            with cluster.client(node) as client:
                for i, key in enumerate(keys):
                    assert client.get(key) == value_of(i), f"{key} through node {node}"
    finally:
        cluster.close()


def test_a_returning_node_with_repair_on_leaves_no_extra_replica_nor_leaked_range(partition):
    """Repair copied values meanwhile: the returning node's surplus replicas are freed, none
    is counted twice, and once every value is removed (and a new term has closed the
    leader's open arenas) every segment is empty again."""
    cluster = Cluster(3)
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        cut = next(i for i in NODES if i != leader)
        keys = [f"s{i}" for i in range(30)]
        with cluster.client(leader) as client:
            for i, key in enumerate(keys):
                assert client.put(key, value_of(i), TWO) is True
        # Some values are overwritten and one removed while the node is cut off: their
        # replicas on it are of versions that ended, and must not come back.
        upserted = keys[:5]
        removed = keys[5]
        generation = cluster.status(cut)["mount_generation"]
        partition.isolate(cut, list(NODES))
        try:
            wait_until(f"node {cut} declared down", lambda: (
                (entry := node_entry(cluster, leader, cut)) and not entry["up"]))
            with cluster.client(leader) as client:
                for key in upserted:
                    client.upsert(key, b"new " + key.encode(), TWO)
                client.remove(removed, force=True)
        finally:
            partition.heal()
        wait_until(f"node {cut} registered again", lambda: (
            (status := cluster.status(cut)) and status["registered"]
            and status["mount_generation"] != generation))
        current = [key for key in keys if key != removed]
        found = wait_until("every value with two replicas", lambda: (
            (found := replicas_by_key(cluster, leader, current))
            and all(len(n) == 2 for n in found.values()) and found))
        assert all(len(set(nodes)) == 2 for nodes in found.values()), found
        for node in NODES:
            with cluster.client(node) as client:
                with pytest.raises(ObjectNotFound):
                    client.get(removed)
                for i, key in enumerate(current):
                    expected = b"new " + key.encode() if key in upserted \
                        else value_of(keys.index(key))
                    assert client.get(key) == expected, f"{key} through node {node}"

        with cluster.client(leader) as client:
            for key in current:
                client.remove(key, force=True)

        def used() -> dict[int, int]:
            totals = {}
            for node in NODES:
                with cluster.client(node) as client:
                    totals[node] = sum(s["used_bytes"] for s in client.segment_report())
            return totals

        # The leader's open arenas hold their segment space for its next puts: a new term
        # closes them. Everything is then freed once its deadlines (read leases, put
        # timeouts, arena holds) pass and the sweep runs.
        successor = next(i for i in NODES if i != leader)
        with cluster.client(leader) as client:
            client.call("cluster_transfer_leader", successor)
        wait_until("every segment empty", lambda: not any(used().values()))
    finally:
        cluster.close()


def test_after_node_return_grace_ms_a_returning_node_gets_nothing_back(partition):
    """The grace bounds what is kept: once it has passed, the leader drops it, and the node,
    back with its memory, registers anew with empty segments (repair off: the values it held
    keep the one replica they have left)."""
    cluster = Cluster(3, cluster={"repair_bytes_per_s": 0, "node_return_grace_ms": 500})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        cut = next(i for i in NODES if i != leader)
        keys = [f"g{i}" for i in range(20)]
        with cluster.client(leader) as client:
            for i, key in enumerate(keys):
                assert client.put(key, value_of(i), TWO) is True
        placed = replicas_by_key(cluster, leader, keys)
        on_cut = [key for key, nodes in placed.items() if cut in nodes]
        assert on_cut
        generation = cluster.status(cut)["mount_generation"]
        partition.isolate(cut, list(NODES))
        try:
            wait_until(f"node {cut} declared down and what it held dropped", lambda: (
                (entry := node_entry(cluster, leader, cut)) and not entry["up"]
                and entry["kept_replicas"] == 0))
        finally:
            partition.heal()
        wait_until(f"node {cut} registered again", lambda: (
            (status := cluster.status(cut)) and status["registered"]
            and status["mount_generation"] != generation))
        assert cluster.status(cut)["returns"] == 0
        found = replicas_by_key(cluster, leader, keys)
        assert all(found[key] == [n for n in placed[key] if n != cut] for key in on_cut)
        with cluster.client(cut) as client:
            for i, key in enumerate(keys):
                assert client.get(key) == value_of(i), key
    finally:
        cluster.close()


def test_a_node_paused_past_its_ttl_returns_with_its_replicas():
    """The same without nftables: a follower stopped (SIGSTOP) until the leader declares it
    down, then resumed, is back with the replicas it held (repair off)."""
    cluster = Cluster(3, cluster={"repair_bytes_per_s": 0})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        paused = next(i for i in NODES if i != leader)
        keys = [f"p{i}" for i in range(20)]
        with cluster.client(leader) as client:
            for i, key in enumerate(keys):
                assert client.put(key, value_of(i), TWO) is True
        placed = replicas_by_key(cluster, leader, keys)
        assert any(paused in nodes for nodes in placed.values())
        generation = cluster.status(paused)["mount_generation"]
        pid = cluster.nodes[paused].process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(f"node {paused} declared down", lambda: (
                (entry := node_entry(cluster, leader, paused)) and not entry["up"]
                and entry["kept_replicas"] > 0))
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(f"node {paused} back", lambda: (
            (status := cluster.status(paused)) and status["registered"]
            and status["mount_generation"] != generation))
        assert cluster.status(paused)["returns"] == 1, cluster.nodes[paused].log()[-4000:]
        ask = cluster.wait_for_leader()
        restored = wait_until("every value back to two replicas", lambda: (
            (found := replicas_by_key(cluster, ask, keys))
            and all(len(n) == 2 for n in found.values()) and found))
        assert restored == placed
        for node in NODES:
            with cluster.client(node) as client:
                for i, key in enumerate(keys):
                    assert client.get(key) == value_of(i), f"{key} through node {node}"
    finally:
        cluster.close()
