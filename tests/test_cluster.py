"""A 3-node cluster of real daemons: replication, data between nodes, membership, leadership.

The fault tests (kill -9, SIGSTOP, partitions, with a recorded history) are in
tests/test_cluster_faults.py; this file checks the functions a client and an operator use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cluster_harness import Cluster
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctl(node, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", node.tcp_address,
                           *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))


def value_of(size: int, tag: int) -> bytes:
    return (tag.to_bytes(8, "little") * (size // 8 + 1))[:size]


def test_three_nodes_elect_one_leader_and_register(cluster):
    leader = cluster.wait_for_leader()
    statuses = [cluster.status(i) for i in (1, 2, 3)]
    assert {s["leader"] for s in statuses} == {leader}
    assert sorted(statuses[0]["voters"]) == [1, 2, 3]
    nodes = {n["node_id"]: n for n in statuses[0]["nodes"]}
    assert sorted(nodes) == [1, 2, 3] and all(n["up"] and n["segments"] == 1
                                              for n in nodes.values())
    roles = sorted(s["role"] for s in statuses)
    assert roles == ["follower", "follower", "leader"]


def test_a_put_on_one_node_is_read_on_every_node(cluster):
    sizes = [1, 4096, 1 << 20, 9 << 20]  # the last is striped over the data connections
    with cluster.client(1) as writer:
        for tag, size in enumerate(sizes):
            assert writer.put(f"k{tag}", value_of(size, tag), ReplicateConfig(replica_num=1)) is True
        assert writer.put("k0", b"other") is False  # write-once, through the log
    for node_id in (1, 2, 3):
        with cluster.client(node_id) as reader:
            for tag, size in enumerate(sizes):
                assert reader.get(f"k{tag}") == value_of(size, tag)
            assert reader.exists("k1") is True
            assert reader.exists("missing") is False
            with pytest.raises(MooncakedError) as info:
                reader.get("missing")
            assert info.value.code == ErrorCode.OBJECT_NOT_FOUND


def test_replicas_land_on_distinct_nodes_and_a_get_survives_one_of_them(cluster):
    leader = cluster.wait_for_leader()
    a, b = [i for i in (1, 2, 3) if i != leader]
    with cluster.client(leader) as client:
        assert client.put("two", value_of(300_000, 7), ReplicateConfig(
            replica_num=2, preferred_segments=[f"node{a}/0", f"node{b}/0"])) is True
        stat = client.call("object_stat", "two")  # at the leader: applied before the ack
    assert sorted(c.node_of_segment(r["segment_id"]) for r in stat["replicas"]) == sorted([a, b])
    cluster.nodes[a].kill()  # abruptly: still mounted, its replica unreachable
    with cluster.client(leader) as client:
        assert client.get("two") == value_of(300_000, 7)  # read from b after a fails
        status = client.call("cluster_status")
    assert status["replica_read_failovers"] >= 1 \
        or c.node_of_segment(stat["replicas"][0]["segment_id"]) == b


def test_remove_and_upsert_are_seen_everywhere(cluster):
    with cluster.client(2) as client:
        client.put("a", b"first")
        client.upsert("a", b"second value")
    with cluster.client(3) as client:
        assert client.get("a") == b"second value"
        client.remove("a", force=True)
    with cluster.client(1) as client:
        assert client.exists("a") is False


def test_batch_calls_through_a_follower(cluster):
    leader = cluster.wait_for_leader()
    follower = next(i for i in (1, 2, 3) if i != leader)
    keys = [f"b{i}" for i in range(20)]
    values = [value_of(1000 + i, i) for i in range(20)]
    with cluster.client(follower) as client:
        assert client.batch_put(keys, values) == [0] * 20
        assert client.batch_get(keys + ["nope"]) == values + [None]
        assert client.batch_exists(keys[:3] + ["nope"]) == [True, True, True, False]


def test_a_restarted_node_catches_up_and_serves(cluster):
    # A restarted node comes back with empty memory: values survive on the other replicas.
    with cluster.client(1) as client:
        for i in range(30):
            client.put(f"r{i}", value_of(100, i), ReplicateConfig(replica_num=3))
    victim = next(i for i in (1, 2, 3) if i != cluster.wait_for_leader())
    cluster.nodes[victim].terminate()
    with cluster.client(next(i for i in (1, 2, 3) if i != victim)) as client:
        for i in range(30, 40):
            client.put(f"r{i}", value_of(100, i), ReplicateConfig(replica_num=2))
    cluster.nodes[victim].start()
    cluster.wait_for_leader()
    status = cluster.status(victim)
    assert status["registered"]
    with cluster.client(victim) as client:
        for i in range(40):
            assert client.get(f"r{i}") == value_of(100, i), i


def test_ctl_cluster_status_members_and_transfer_leader(cluster):
    leader = cluster.wait_for_leader()
    node = cluster.nodes[1]
    out = ctl(node, "-o", "json", "cluster", "status")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["leader"] == leader
    out = ctl(node, "-o", "json", "cluster", "members")
    members = json.loads(out.stdout)
    assert [m["node_id"] for m in members] == [1, 2, 3]
    assert [m["role"] for m in members].count("leader") == 1
    target = next(i for i in (1, 2, 3) if i != leader)
    out = ctl(node, "cluster", "transfer-leader", str(target))
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 10
    while cluster.wait_for_leader() != target and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.wait_for_leader() == target


def test_a_fourth_node_joins_as_learner_and_becomes_voter_then_is_drained(cluster):
    with cluster.client(1) as client:
        client.put("before", b"x" * 5000)
    def operator_adds(peer_address: str) -> None:
        out = ctl(cluster.nodes[3], "-o", "json", "cluster", "add", "4", peer_address)
        assert out.returncode == 0, out.stderr
        leader = cluster.wait_for_leader()  # it applied the change before answering
        assert 4 in cluster.status(leader)["learners"]  # a learner until it has caught up

    cluster.add_node(4, join_via=2, before_start=operator_adds)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = cluster.status(4)
        if status and 4 in status["voters"] and status["registered"]:
            break
        time.sleep(0.2)
    assert 4 in status["voters"], status
    with cluster.client(4) as client:
        assert client.get("before") == b"x" * 5000
        assert client.put("on4", b"y" * 7000, ReplicateConfig(preferred_segments=["node4/0"])) is True
    out = ctl(cluster.nodes[1], "-o", "json", "cluster", "drain", "4")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["moved"] >= 1
    status = cluster.status(1)
    assert 4 not in status["voters"] and 4 not in status["learners"]
    with cluster.client(1) as client:
        assert client.get("on4") == b"y" * 7000  # moved off node 4 before it left


def test_ctl_on_a_single_node_says_it_is_not_a_cluster_member(daemon):
    out = ctl(daemon, "cluster", "status")
    assert out.returncode == 1
    assert "not a cluster member" in out.stderr


def test_metrics_show_raft_and_transfer_counters(cluster):
    import urllib.request
    leader = cluster.wait_for_leader()
    follower = next(i for i in (1, 2, 3) if i != leader)
    with cluster.client(follower) as client:
        client.put("m", b"z" * 10_000, ReplicateConfig(
            preferred_segments=[f"node{leader}/0"]))
    values = {}
    for node_id in (leader, follower):
        port = cluster.nodes[node_id].metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        values[node_id] = {line.split()[0]: float(line.split()[1])
                           for line in text.decode().splitlines()
                           if line.startswith("mooncaked_") and " " in line}
    assert values[leader]["mooncaked_raft_is_leader"] == 1
    assert values[follower]["mooncaked_raft_is_leader"] == 0
    assert values[leader]["mooncaked_raft_commit_index"] >= 5
    assert values[follower]["mooncaked_cluster_forwarded_total"] >= 2  # put start and end
    assert values[follower]["mooncaked_cluster_replica_bytes_sent_total"] >= 10_000
    assert values[leader]["mooncaked_cluster_replica_bytes_received_total"] >= 10_000


def test_a_lagging_node_catches_up_from_a_snapshot():
    cluster = Cluster(3, cluster={"snapshot_entries": 20})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        victim = next(i for i in (1, 2, 3) if i != leader)
        cluster.nodes[victim].terminate()
        with cluster.client(leader) as client:
            for i in range(60):  # 120 entries: the log is compacted past the victim's end
                client.put(f"s{i}", value_of(64, i), ReplicateConfig(replica_num=2))
        leader_status = cluster.status(leader)
        assert leader_status["raft"]["snapshot_index"] > 0
        cluster.nodes[victim].start()
        cluster.wait_for_leader()
        status = cluster.status(victim)
        assert status["raft"]["snapshot_index"] > 0  # it installed (or took) a snapshot
        assert "installed a snapshot" in cluster.nodes[victim].log()
        with cluster.client(victim) as client:
            for i in range(60):
                assert client.get(f"s{i}") == value_of(64, i), i
    finally:
        cluster.close()


def test_local_first_places_the_replica_on_the_receiving_node():
    cluster = Cluster(3, store={"allocation_strategy": "local_first"})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        for node_id in (1, 2, 3):
            with cluster.client(node_id) as client, cluster.client(leader) as at_leader:
                for i in range(5):
                    key = f"local{node_id}-{i}"
                    client.put(key, value_of(2000, i))
                    # The leader has applied the put before it was acknowledged; another
                    # node's applied copy may lag a moment behind.
                    stat = at_leader.call("object_stat", key)
                    assert [c.node_of_segment(r["segment_id"]) for r in stat["replicas"]] == [node_id]
    finally:
        cluster.close()


def test_a_new_leader_treats_every_object_as_leased_for_one_ttl():
    ttl_s = 6.0
    cluster = Cluster(3, store={"lease_ttl_ms": int(ttl_s * 1000)})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        with cluster.client(leader) as client:
            client.put("unread", b"v" * 100)
            client.put("unread-too", b"w" * 100)
        target = next(i for i in (1, 2, 3) if i != leader)
        with cluster.client(leader) as client:
            client.call("cluster_transfer_leader", target)
        deadline = time.monotonic() + 10
        while cluster.wait_for_leader() != target and time.monotonic() < deadline:
            time.sleep(0.05)
        changed_at = time.monotonic()
        with cluster.client(target) as client:
            with pytest.raises(MooncakedError) as info:
                client.remove("unread")  # never read, but the new leader cannot know that
            assert info.value.code == ErrorCode.OBJECT_HAS_LEASE
            time.sleep(max(0.0, changed_at + ttl_s + 0.5 - time.monotonic()))
            client.remove("unread")  # the floor has passed
            assert client.exists("unread") is False
            assert client.get("unread-too") == b"w" * 100
    finally:
        cluster.close()
