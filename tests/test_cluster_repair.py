"""Replica repair on a 3-node cluster of real daemons: a rolling restart loses no value.

Values are put with replica_num 2 on three nodes. One node is killed (SIGKILL by PID); once it
is declared down (node_ttl_ms) the leader copies every value that lost a replica to the third
node. The killed node is restarted (empty) and rejoins, then a second, different node is
killed: every acknowledged value must still read back with its bytes. Without repair, the
values whose two replicas were on the two killed nodes are gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

from cluster_harness import Cluster, replicas_by_key, wait_until
from mooncaked.client.calls import ReplicateConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = (1, 2, 3)
TWO = ReplicateConfig(replica_num=2)


def value_of(index: int) -> bytes:
    size = 1000 + 7919 * index % 60_000
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def leader_status(cluster: Cluster) -> dict | None:
    leader = cluster.wait_for_leader()
    return cluster.status(leader)


def test_repair_restores_replicas_so_a_rolling_restart_loses_nothing(cluster):
    keys = [f"v{i}" for i in range(30)]
    leader = cluster.wait_for_leader()
    # First failure: a follower, so the leader (and its repair counters) stays; the second:
    # the leader. The first ten values are placed on both, the others anywhere.
    first = next(i for i in NODES if i != leader)
    both = ReplicateConfig(replica_num=2,
                           preferred_segments=[f"node{first}/0", f"node{leader}/0"])
    with cluster.client(leader) as client:
        for i, key in enumerate(keys):
            assert client.put(key, value_of(i), both if i < 10 else TWO) is True
    placed = replicas_by_key(cluster, leader, keys)
    assert all(len(nodes) == 2 for nodes in placed.values())
    lost_one = [key for key, nodes in placed.items() if first in nodes]
    assert set(keys[:10]) <= set(lost_one)
    cluster.nodes[first].kill()
    wait_until(f"node {first} declared down", lambda: any(
        n["node_id"] == first and not n["up"] for n in cluster.status(leader)["nodes"]))
    repaired = wait_until("every value back to two replicas, none on the dead node", lambda: (
        (found := replicas_by_key(cluster, leader, keys))
        and all(len(n) == 2 and first not in n for n in found.values()) and found))
    survivors = [i for i in NODES if i != first]
    assert all(nodes == survivors for key, nodes in repaired.items() if key in lost_one)

    status = cluster.status(leader)
    repair = status["repair"]
    assert repair["replicas_added"] >= len(lost_one)
    assert repair["objects_repaired"] >= len(lost_one)
    assert repair["bytes_copied"] >= sum(len(value_of(keys.index(k))) for k in lost_one)
    assert repair["queued"] == 0 and repair["in_progress"] == 0
    shown = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a",
                            cluster.nodes[leader].tcp_address, "cluster", "status"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=REPO))
    assert shown.returncode == 0, shown.stderr
    assert "repair" in shown.stdout and "replicas_added" in shown.stdout
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{cluster.nodes[leader].metrics_port}/metrics", timeout=10).read()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.decode().splitlines()
              if line.startswith("mooncaked_cluster_repair")}
    assert values["mooncaked_cluster_repair_replicas_added_total"] >= len(lost_one)
    assert values["mooncaked_cluster_repair_queued"] == 0

    # The node comes back empty and registers again; then another node fails: the leader.
    cluster.nodes[first].start()
    cluster.wait_for_leader(among=list(NODES))
    second = leader
    cluster.nodes[second].kill()
    alive = [i for i in NODES if i != second]
    cluster.wait_for_leader(among=alive)
    for node in alive:
        with cluster.client(node) as client:
            for i, key in enumerate(keys):
                assert client.get(key) == value_of(i), f"{key} through node {node}"


def test_repair_off_leaves_values_with_the_replicas_they_have():
    cluster = Cluster(3, cluster={"repair_bytes_per_s": 0})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        first = next(i for i in NODES if i != leader)
        on_first = ReplicateConfig(replica_num=2, preferred_segments=[f"node{first}/0"])
        with cluster.client(leader) as client:
            for i in range(6):
                assert client.put(f"v{i}", value_of(i), on_first) is True
        cluster.nodes[first].kill()
        wait_until(f"node {first} declared down", lambda: any(
            n["node_id"] == first and not n["up"] for n in cluster.status(leader)["nodes"]))
        found = replicas_by_key(cluster, leader, [f"v{i}" for i in range(6)])
        assert all(len(nodes) == 1 for nodes in found.values()), found
        repair = cluster.status(leader)["repair"]
        assert repair["bytes_per_s"] == 0 and repair["replicas_added"] == 0
    finally:
        cluster.close()
