"""What clients on the followers see while the leader is dead (wire/PROTOCOL.md 5.4).

A request that never reached the dead leader (its node could not connect to it) waits for a
new leader within the documented bound, then answers `NO_LEADER`: it is never reported as
"outcome unknown". Reads are asked again until they are answered. Only a mutation that may have
reached the leader before it died may answer an outcome-unknown code.
"""

from __future__ import annotations

import threading

from cluster_harness import Cluster
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError

PUTS_PER_THREAD_AFTER_KILL = 15
GETS_PER_THREAD_AFTER_KILL = 15
OUTCOME_UNKNOWN_CODES = {ErrorCode.OUTCOME_UNKNOWN, ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT}


def value_of(key: str) -> bytes:
    return (key.encode() * 64)[:1000]


def test_requests_on_followers_wait_for_a_new_leader_instead_of_failing():
    cluster = Cluster(3)
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        followers = [i for i in (1, 2, 3) if i != leader]
        # Replicas on the followers only: the kill loses no value, and no put needs the dead
        # node's memory.
        on_followers = ReplicateConfig(replica_num=2,
                                       preferred_segments=[f"node{i}/0" for i in followers])
        with cluster.client(followers[0]) as client:
            for n in range(20):
                assert client.put(f"old{n}", value_of(f"old{n}"), on_followers) is True

        killed = threading.Event()
        results: list[tuple[str, str, bool, object]] = []  # (kind, key, after kill, outcome)
        lock = threading.Lock()

        def work(node_id: int, tag: int) -> None:
            # Long client timeout: a request may wait for the election.
            with cluster.client(node_id, timeout_s=30) as client:
                done_after_kill = 0
                n = 0
                while done_after_kill < PUTS_PER_THREAD_AFTER_KILL + GETS_PER_THREAD_AFTER_KILL:
                    after = killed.is_set()
                    if n % 2:
                        key = f"old{n % 20}"
                        try:
                            outcome = client.get(key) == value_of(key)
                        except MooncakedError as exc:
                            outcome = exc.code
                        kind = "get"
                    else:
                        key = f"new{tag}-{n}"
                        try:
                            outcome = client.put(key, value_of(key), on_followers)
                        except MooncakedError as exc:
                            outcome = exc.code
                        kind = "put"
                    with lock:
                        results.append((kind, key, after, outcome))
                    done_after_kill += after
                    n += 1

        threads = [threading.Thread(target=work, args=(node, tag))
                   for tag, node in enumerate(followers * 2)]
        for thread in threads:
            thread.start()
        while len(results) < 20:  # the workload runs before the kill
            threading.Event().wait(0.02)
        cluster.nodes[leader].kill()  # SIGKILL by PID
        killed.set()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)

        gets = [r for r in results if r[0] == "get"]
        puts = [r for r in results if r[0] == "put"]
        # Reads change nothing: they are asked again, never answered "outcome unknown".
        failed_gets = [r for r in gets if r[3] is not True and r[3] != ErrorCode.NO_LEADER]
        assert not failed_gets, failed_gets[:10]
        for kind, key, after, outcome in puts:
            assert outcome is True or outcome == ErrorCode.NO_LEADER \
                or outcome in OUTCOME_UNKNOWN_CODES, (key, outcome)
        # Each thread has one request in flight at a time: only the one it had sent when the
        # leader died (or that crossed the leader's closing connection) may be unknown.
        unknown = [r for r in puts if r[3] in OUTCOME_UNKNOWN_CODES]
        assert len(unknown) <= 2 * len(threads), unknown
        # A new leader serves both kinds.
        assert any(r[2] and r[3] is True for r in gets)
        assert any(r[2] and r[3] is True for r in puts)
        survivor = followers[0]
        with cluster.client(survivor) as client:
            for kind, key, after, outcome in puts:
                if outcome is True:
                    assert client.get(key) == value_of(key)
    finally:
        cluster.close()
