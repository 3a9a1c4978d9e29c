"""Concurrent upserts of one key, on a single daemon and on a 3-node cluster: last writer
wins and every call succeeds (wire/PROTOCOL.md 5.1); a drain never undoes a concurrent write.

Values identify their writer and sequence number, so a read shows exactly which write it
returned; the checks are on data and codes, never on timing.
"""

from __future__ import annotations

import json
import threading

import pytest

from mooncaked import BlockingClient, MooncakedError
from mooncaked.client.calls import ReplicateConfig

WRITERS = 4
UPSERTS_PER_WRITER = 40


def tagged(writer: int, number: int, size: int) -> bytes:
    head = f"{writer}:{number}:".encode()
    return head + bytes([65 + writer]) * (size - len(head))


def parse(value: bytes) -> tuple[int, int]:
    writer, number, rest = value.split(b":", 2)
    assert rest == bytes([65 + int(writer)]) * len(rest), "torn or foreign bytes"
    return int(writer), int(number)


def hammer(connect, key: str, size: int) -> tuple[list, dict]:
    """WRITERS threads upsert `key` concurrently; returns (errors, last value per writer)."""
    errors, last = [], {}
    lock = threading.Lock()

    def writer(index: int) -> None:
        with connect(index) as client:
            for number in range(UPSERTS_PER_WRITER):
                try:
                    client.upsert(key, tagged(index, number, size))
                    with lock:
                        last[index] = number
                except MooncakedError as exc:
                    with lock:
                        errors.append((index, number, exc.code, exc.message))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return errors, last


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_concurrent_upserts_of_one_key_all_succeed_on_one_daemon(daemon, transport):
    address = daemon.tcp_address if transport == "tcp" else daemon.unix_address
    # Values of several reads each, so that the writers' puts overlap in the daemon.
    errors, last = hammer(lambda i: BlockingClient.connect(address), "hot", 256 << 10)
    assert errors == []
    assert all(last[i] == UPSERTS_PER_WRITER - 1 for i in range(WRITERS))
    with BlockingClient.connect(address) as client:
        writer, number = parse(client.get("hot"))
    assert number == UPSERTS_PER_WRITER - 1  # the value of some writer's last upsert


def test_concurrent_upserts_of_one_key_all_succeed_on_a_cluster(cluster):
    errors, last = hammer(lambda i: cluster.client(1 + i % 3), "hot", 4096)
    assert errors == []
    with cluster.client(2) as client:
        writer, number = parse(client.get("hot"))
    assert number == UPSERTS_PER_WRITER - 1


def test_a_drain_does_not_undo_concurrent_upserts(cluster):
    keys = [f"k{i}" for i in range(150)]
    size = 4096
    with cluster.client(3) as client:
        for key in keys:  # only on node 3: the drain must move every one
            client.upsert(key, tagged(0, 0, size), ReplicateConfig(
                preferred_segments=["node3/0"]))
    latest = {key: (0, 0) for key in keys}
    unknown: set[str] = set()
    done = threading.Event()

    def upserter() -> None:
        number = 0
        with cluster.client(1) as client:
            while not done.is_set():
                number += 1
                for key in keys:
                    try:
                        client.upsert(key, tagged(1, number, size), ReplicateConfig(
                            preferred_segments=["node1/0"]))
                        latest[key] = (1, number)
                    except MooncakedError:
                        unknown.add(key)  # either value may be there
                    if done.is_set():
                        return

    thread = threading.Thread(target=upserter)
    thread.start()
    try:
        from test_cluster import ctl
        for _ in range(5):  # asked again if an election leaves node 1 without a leader
            out = ctl(cluster.nodes[1], "-o", "json", "cluster", "drain", "3")
            if "NO_LEADER" not in out.stderr:
                break
            cluster.wait_for_leader()
    finally:
        done.set()
        thread.join(timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["dropped"] == 0
    with cluster.client(1) as client:
        for key in keys:
            if key not in unknown:
                assert parse(client.get(key)) == latest[key], key
