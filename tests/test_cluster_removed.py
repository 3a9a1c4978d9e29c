"""A node removed from the cluster knows it, says so, and serves no cluster data.

After `cluster drain N` (or `cluster remove N`) the removed node's own `cluster_status` says
`removed`, its client data requests answer `NOT_A_MEMBER` (wire/PROTOCOL.md 5.4, 6), and the
remaining nodes keep serving.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster_harness import Cluster
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError


def assert_silent(cluster: Cluster, node_id: int) -> None:
    """A removed node campaigns no more: it sends no Raft message over several election
    timeouts of the harness."""
    time.sleep(0.5)  # a message the leader sent before it applied the removal is answered
    before = cluster.status(node_id)["raft"]["messages_sent"]
    time.sleep(1.5)
    assert cluster.status(node_id)["raft"]["messages_sent"] == before


def wait_until_removed(cluster: Cluster, node_id: int) -> dict:
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        status = cluster.status(node_id)
        if status and status.get("removed"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"node {node_id} never said it was removed: {status}")


@pytest.mark.parametrize("method", ["cluster_drain", "cluster_remove"])
def test_a_removed_node_says_so_and_refuses_data_requests(cluster, method):
    leader = cluster.wait_for_leader()
    victim = next(i for i in (3, 2) if i != leader)
    keeper = next(i for i in (1, 2, 3) if i not in (leader, victim))
    with cluster.client(victim) as client:
        assert client.put("before", b"b" * 3000, ReplicateConfig(replica_num=2)) is True
    with cluster.client(keeper) as client:
        client.call(method, victim)

    status = wait_until_removed(cluster, victim)
    assert status["role"] == "removed" and status["registered"] is False
    assert victim not in status["voters"] and victim not in status["learners"]

    with cluster.client(victim) as client:
        for call in (lambda: client.get("before"), lambda: client.put("after", b"a" * 100),
                     lambda: client.exists("before"), lambda: client.remove("before")):
            with pytest.raises(MooncakedError) as refused:
                call()
            assert refused.value.code == ErrorCode.NOT_A_MEMBER
            assert "removed" in refused.value.message
        # Its own view stays available to the operator.
        assert client.call("cluster_status")["removed"] is True

    # The others keep serving, and agree that it is gone.
    for node_id in (leader, keeper):
        with cluster.client(node_id) as client:
            assert client.get("before") == b"b" * 3000
            assert client.put(f"after-{node_id}", b"c" * 100) is True
        status = cluster.status(node_id)
        assert status["removed"] is False
        assert victim not in status["voters"] and victim not in status["learners"]
    # It no longer campaigns, and the survivors' term does not move.
    term = cluster.status(leader)["term"]
    assert_silent(cluster, victim)
    assert cluster.status(leader)["term"] == term
    assert cluster.wait_for_leader(among=[leader, keeper]) == leader


@pytest.mark.parametrize("absence", ["killed", "stopped"])
def test_a_node_removed_while_it_was_away_learns_it_when_it_comes_back(cluster, absence):
    """Its own log never saw the removal: it learns it from a member that has applied more
    of the log (the leader, which no longer replicates to it, or another) and no longer lists
    it."""
    leader = cluster.wait_for_leader()
    victim = next(i for i in (3, 2) if i != leader)
    keeper = next(i for i in (1, 2, 3) if i not in (leader, victim))
    node = cluster.nodes[victim]
    pid = node.process.pid
    if absence == "killed":
        node.kill()  # SIGKILL: it announces nothing
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        with cluster.client(keeper) as client:
            client.call("cluster_remove", victim)
            assert client.put("while-down", b"w" * 100) is True
    finally:
        if absence == "stopped":
            os.kill(pid, signal.SIGCONT)
    if absence == "killed":
        node.start()  # the same data_dir: its log still lists it as a voter

    status = wait_until_removed(cluster, victim)
    assert status["role"] == "removed" and status["registered"] is False
    with cluster.client(victim) as client:
        with pytest.raises(MooncakedError) as refused:
            client.get("while-down")
        assert refused.value.code == ErrorCode.NOT_A_MEMBER
    assert_silent(cluster, victim)
    for node_id in (leader, keeper):
        with cluster.client(node_id) as client:
            assert client.get("while-down") == b"w" * 100
        assert victim not in cluster.status(node_id)["voters"]


def test_the_leader_drained_steps_down_and_says_it_was_removed(cluster):
    leader = cluster.wait_for_leader()
    others = [i for i in (1, 2, 3) if i != leader]
    with cluster.client(leader) as client:
        assert client.put("on-leader", b"l" * 2000,
                          ReplicateConfig(preferred_segments=[f"node{leader}/0"])) is True
        assert client.call("cluster_drain", leader)["moved"] >= 1
    status = wait_until_removed(cluster, leader)
    assert status["role"] == "removed"
    new_leader = cluster.wait_for_leader(among=others)
    assert new_leader in others
    for node_id in others:
        with cluster.client(node_id) as client:
            assert client.get("on-leader") == b"l" * 2000
        assert leader not in cluster.status(node_id)["voters"]
    with cluster.client(leader) as client:
        with pytest.raises(MooncakedError) as refused:
            client.get("on-leader")
        assert refused.value.code == ErrorCode.NOT_A_MEMBER
