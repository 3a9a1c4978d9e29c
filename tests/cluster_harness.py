"""A cluster of real mooncaked processes on loopback, for the cluster tests.

Node i's peer listener binds 127.0.0.(10+i) (its outbound peer connections leave from that
address too), so a test can cut the traffic between two nodes with nftables rules on those
addresses. Clients reach every node on 127.0.0.1. Each node has its own directory: config, log,
Raft data and segment files. Processes are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from conftest import DaemonProcess, free_port
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import MooncakedError, ObjectNotFound
from mooncaked.meta.commands import node_of_segment

# Timing for tests: elections in 0.5-1 s, short leases and put timeouts.
TICK_MS = 50
ELECTION_TICKS = 10
ELECTION_TIMEOUT_S = 2 * ELECTION_TICKS * TICK_MS / 1000  # the randomised maximum


def peer_host(node_id: int) -> str:
    return f"127.0.0.{10 + node_id}"


class Cluster:
    def __init__(self, size: int = 3, *, segment_bytes: int = 32 << 20, **overrides) -> None:
        self.directory = tempfile.mkdtemp(prefix="mooncaked-cluster-")
        self.peer_ports = {i: free_port_on(peer_host(i)) for i in range(1, size + 1)}
        members = ",".join(f"{i}@{peer_host(i)}:{port}" for i, port in self.peer_ports.items())
        self.nodes: dict[int, DaemonProcess] = {}
        self.segment_bytes = segment_bytes
        self.overrides = overrides
        for node_id in self.peer_ports:
            self.nodes[node_id] = self._make(node_id, members)

    def _make(self, node_id: int, members: str) -> DaemonProcess:
        workdir = os.path.join(self.directory, f"node{node_id}")
        os.makedirs(workdir, exist_ok=True)
        sections = {
            "node": {"name": f"node{node_id}"},
            "segments": {"size_bytes": self.segment_bytes},
            "store": {"lease_ttl_ms": 2000, "put_start_discard_timeout_ms": 2000,
                      "put_start_release_timeout_ms": 5000},
            "cluster": {"enabled": True, "node_id": node_id, "peer_host": peer_host(node_id),
                        "peer_port": self.peer_ports.get(node_id, 0),
                        "initial_members": members,
                        "data_dir": os.path.join(workdir, "raft"), "fsync": "batch",
                        "tick_ms": TICK_MS, "election_ticks": ELECTION_TICKS,
                        "node_ttl_ms": 3000, "rpc_timeout_ms": 5000},
        }
        for section, values in self.overrides.items():
            sections.setdefault(section, {}).update(values)
        return DaemonProcess(workdir, **sections)

    def start(self) -> "Cluster":
        for node in self.nodes.values():
            node.start()
        self.wait_for_leader()
        return self

    def add_node(self, node_id: int, join_via: int, before_start=None) -> DaemonProcess:
        """Start a new node that joins through `join_via`'s peer listener.

        before_start(peer_address) runs once the node's address is chosen (e.g. an operator's
        `mooncakectl cluster add`)."""
        self.peer_ports[node_id] = free_port_on(peer_host(node_id))
        if before_start is not None:
            before_start(f"{peer_host(node_id)}:{self.peer_ports[node_id]}")
        node = self._make(node_id, "")
        node.extra_args = ["--join", f"{peer_host(join_via)}:{self.peer_ports[join_via]}"]
        self.nodes[node_id] = node
        return node.start()

    # -- observation ----------------------------------------------------------------------------

    def client(self, node_id: int, timeout_s: float = 10.0) -> BlockingClient:
        return BlockingClient.connect(self.nodes[node_id].tcp_address, timeout_s=timeout_s)

    def status(self, node_id: int) -> dict | None:
        try:
            with self.client(node_id, timeout_s=2.0) as client:
                return client.call("cluster_status")
        except (OSError, MooncakedError):
            return None

    def alive(self) -> list[int]:
        return [i for i, n in self.nodes.items() if n.process and n.process.poll() is None]

    def wait_for_leader(self, among: list[int] | None = None, timeout_s: float = 30.0,
                        registered: bool = True) -> int:
        """The leader all of `among` (default: the live nodes) agree on, once registered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = among or self.alive()
            statuses = [self.status(i) for i in nodes]
            leaders = {s["leader"] for s in statuses if s}
            if (all(statuses) and len(leaders) == 1 and 0 not in leaders
                    and (not registered or all(s["registered"] for s in statuses))
                    and next(iter(leaders)) in nodes):
                return next(iter(leaders))
            time.sleep(0.1)
        raise TimeoutError("no agreed leader: " + "; ".join(
            f"node {i}: {self.status(i)}" for i in (among or self.alive())))

    def close(self) -> None:
        for node in self.nodes.values():
            try:
                node.close()
            except Exception:
                pass
        shutil.rmtree(self.directory, ignore_errors=True)


def free_port_on(host: str) -> int:
    return free_port(host)


class Partition:
    """Cuts traffic between loopback addresses with an nftables table the test owns."""

    def __init__(self) -> None:
        self.table = f"mooncaked_test_{os.getpid()}"
        if shutil.which("nft") is None or os.geteuid() != 0:
            raise RuntimeError("partitions need nft (Debian nftables) and root")
        self._nft(f"add table inet {self.table}")
        self._nft(f"add chain inet {self.table} output "
                  "{ type filter hook output priority 0 ; policy accept ; }")

    def _nft(self, command: str) -> None:
        subprocess.run(["nft", command], check=True, capture_output=True, text=True)

    def cut(self, a: int, b: int, both_ways: bool = True) -> None:
        """Drop packets from node a's peer address to node b's (and back if both_ways)."""
        pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
        for src, dst in pairs:
            self._nft(f"add rule inet {self.table} output ip saddr {peer_host(src)} "
                      f"ip daddr {peer_host(dst)} drop")

    def isolate(self, node_id: int, others: list[int]) -> None:
        for other in others:
            if other != node_id:
                self.cut(node_id, other)

    def heal(self) -> None:
        self._nft(f"flush chain inet {self.table} output")

    def close(self) -> None:
        subprocess.run(["nft", f"delete table inet {self.table}"], capture_output=True)


def applied_replicas(client, key: str, timeout_s: float = 10.0) -> list:
    """The key's replicas in the node's own applied copy of the log, which may lag the leader
    that acknowledged the put by a few milliseconds (PROTOCOL.md 5.4, local views)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.object_stat(key)["replicas"]
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.02)


WAIT_S = 60.0  # an upper bound for waits on the cluster, never asserted as a duration


def wait_until(what: str, condition, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = condition()
        except (OSError, MooncakedError):
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def replicas_by_key(cluster: Cluster, node: int, keys: list[str]) -> dict[str, list[int]]:
    """The nodes holding each key's replicas, as the node's applied log says."""
    with cluster.client(node) as client:
        return {key: sorted(node_of_segment(r["segment_id"]) for r in
                            client.call("object_stat", key)["replicas"]) for key in keys}
