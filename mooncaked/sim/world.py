"""The simulated world the real daemons run in: a virtual-time loop (sim/loop.py), a network of
simulated streams (sim/streams.py), each node's clock and randomness, its data directory, and
crash / restart / pause of whole nodes.

A node is a real `Daemon` (mooncaked/daemon/main.py) in cluster mode: its ClusterService,
RaftNode, ReplicatedMaster, client handlers and peer transport, exactly the objects a mooncaked
process runs. Several live in one process; each runs in a context of its own whose
`environment.current` is its `NodeEnvironment`, so every callback it schedules carries it:
the loop runs them only while the node lives and is not paused, and the node reads its own
(drifting) clock.

The Raft log: each node writes it into its own directory on a simulated file system
(sim/disk.py SimFileSystem, one per node, outliving its incarnations), handed to the log store
through `NodeEnvironment.log_store_options` (`LogStore(..., fs=...)`); a crash calls its
`close_all()` (kill -9: every write stays), a power loss its `crash()` (only what was synced
stays, and a random part of what was not). Its faults (EIO, a full disk) make the node stop
itself, as it must (fail-stop): `SimNode.disk_faults` excuses that stop.
"""

from __future__ import annotations

import contextvars
import logging
import os
import random
import shutil
import tempfile

from mooncaked import config as config_module
from mooncaked import environment
from mooncaked.daemon.main import Daemon
from mooncaked.sim.disk import SimFileSystem

CLIENT_PORT_BASE = 7000
PEER_PORT_BASE = 8000
HOST = "127.0.0.1"


class NodeEnvironment:
    """One incarnation of a node as the loop sees it: alive or crashed, running or paused; the
    clock and the randomness its code reads."""

    simulated = True

    def __init__(self, name: str, loop, rng: random.Random, clock_offset_s: float,
                 clock_rate: float, filesystem=None) -> None:
        self.name = name
        self.filesystem = filesystem  # the Raft log's; None: the real one
        self.loop = loop
        self.rng = rng
        self.clock_offset_s = clock_offset_s
        self.clock_rate = clock_rate  # drift: this node's seconds per virtual second
        self.crashed = False
        self.paused = False
        self.held: list = []  # callbacks held while paused

    def monotonic(self) -> float:
        return self.clock_offset_s + self.loop.time() * self.clock_rate

    def monotonic_ns(self) -> int:
        return int(self.monotonic() * 1e9)

    def random_bytes(self, count: int) -> bytes:
        return self.rng.randbytes(count)

    def log_store_options(self) -> dict:
        return {} if self.filesystem is None else {"fs": self.filesystem}


class ClientEnvironment(NodeEnvironment):
    """A client: never crashes or pauses, but has an endpoint name the network can cut off."""


def node_name(node_id: int) -> str:
    return f"node{node_id}"


class SimNode:
    """A node across its incarnations: its config and data directory stay, its process (a
    Daemon and everything it holds) is dropped by a crash and built anew by a restart."""

    def __init__(self, world: "World", node_id: int, members: str, join: str = "") -> None:
        self.world = world
        self.node_id = node_id
        self.name = node_name(node_id)
        self.directory = os.path.join(world.directory, self.name)
        self.members = members
        self.join = join
        self.incarnation = 0
        self.env: NodeEnvironment | None = None
        self.context: contextvars.Context | None = None
        self.daemon: Daemon | None = None
        self.stopped_itself: str | None = None  # fail_stop's reason, when the node halted
        # The disk of the node's Raft log, across incarnations: None for the real file system
        # (under self.directory), or a simulated one (sim/disk.py SimFileSystem).
        self.filesystem = SimFileSystem(random.Random(world.rng.random()))
        self.disk_faults = 0  # injected faults of its disk not yet over
        self.stop_excused = False  # this incarnation stopped itself on a disk fault
        rng = world.rng
        self.clock_offset_s = rng.uniform(0, 1000)
        self.clock_rate = 1.0 + rng.uniform(-world.params.max_drift, world.params.max_drift)

    @property
    def client_port(self) -> int:
        return CLIENT_PORT_BASE + self.node_id

    @property
    def peer_address(self) -> str:
        return f"{HOST}:{PEER_PORT_BASE + self.node_id}"

    def config(self) -> config_module.Config:
        p = self.world.params
        shm_dir = os.path.join(self.directory, f"shm-{self.incarnation}")
        os.makedirs(shm_dir, exist_ok=True)
        return config_module.from_dict({
            "node": {"name": self.name},
            "server": {"tcp_host": HOST, "tcp_port": self.client_port, "unix_socket": ""},
            "segments": {"size_bytes": p.segment_bytes, "shm_dir": shm_dir,
                         "max_allocations": 1024},
            "store": {"lease_ttl_ms": p.lease_ttl_ms, "put_start_discard_timeout_ms": 2000,
                      "put_start_release_timeout_ms": 4000},
            "metrics": {"enabled": False},
            "log": {"level": "warning"},
            "cluster": {"enabled": True, "node_id": self.node_id, "peer_host": HOST,
                        "peer_port": PEER_PORT_BASE + self.node_id,
                        "initial_members": self.members, "join": self.join,
                        "data_dir": os.path.join(self.directory, "raft"), "fsync": "batch",
                        "tick_ms": p.tick_ms, "election_ticks": p.election_ticks,
                        "node_ttl_ms": p.node_ttl_ms, "rpc_timeout_ms": p.rpc_timeout_ms,
                        "read_mode": p.read_mode, "snapshot_entries": p.snapshot_entries,
                        "data_connections": 1,
                        "node_return_grace_ms": p.node_return_grace_ms,
                        **({} if p.repair else {"repair_bytes_per_s": 0})},
        }, f"<sim {self.name}>")

    @property
    def alive(self) -> bool:
        return self.daemon is not None and not self.env.crashed

    @property
    def running(self) -> bool:
        """Alive, started, and not stopped by itself."""
        return self.alive and self.daemon.cluster is not None \
            and self.daemon.cluster.raft is not None and self.stopped_itself is None

    def start(self) -> None:
        world = self.world
        self.incarnation += 1
        self.env = NodeEnvironment(self.name, world.loop, random.Random(world.rng.random()),
                                   self.clock_offset_s, self.clock_rate, self.filesystem)
        self.context = contextvars.Context()
        self.context.run(environment.current.set, self.env)
        self.stopped_itself = None
        self.stop_excused = False
        self.daemon = self.context.run(Daemon, self.config())
        self.context.run(world.loop.create_task, self._run(self.daemon))
        world.trace(f"start {self.name} (incarnation {self.incarnation})")

    async def _run(self, daemon: Daemon) -> None:
        try:
            await daemon.start()
        except Exception as exc:  # noqa: BLE001 - a start-up failure is a finding
            self.stopped_itself = f"start failed: {type(exc).__name__}: {exc}"
            self.world.node_stopped(self, self.stopped_itself)
            return
        await daemon.stop_requested.wait()
        if daemon.exit_status != 0:
            self.stopped_itself = f"exit status {daemon.exit_status}"
            self.world.node_stopped(self, self.stopped_itself)

    def crash(self, power_loss: bool = False) -> None:
        """kill -9 (or, with power_loss, the machine's power goes): every callback of this
        incarnation is dropped, its connections reset, its memory gone; the data directory
        stays (all that was written to it, or, after a power loss on a simulated file system,
        what was synced)."""
        if self.daemon is None or self.env.crashed:
            return
        self.env.crashed = True
        self.env.held.clear()
        self.world.network.crash(self.name)
        if self.filesystem is not None:
            if power_loss:
                self.filesystem.crash()
            else:
                self.filesystem.close_all()
        self._release(self.daemon, close_log=self.filesystem is None)
        self.daemon = None
        self.world.trace(f"crash {self.name}")

    @staticmethod
    def _release(daemon: Daemon, close_log: bool) -> None:
        """What the kernel does for a killed process: close its files and mappings (the Raft
        log's too when it is on the real file system)."""
        cluster = daemon.cluster
        if close_log and cluster is not None and cluster.raft is not None:
            store = cluster.raft.store
            fd = getattr(store, "_fd", None)
            if fd is not None:
                os.close(fd)
                store._fd = None
        for memory in daemon.memory.values():
            memory.view.release()
            try:
                memory.mmap.close()
            except BufferError:
                pass  # still viewed by a dropped object; the mapping goes with it
            if memory.fd >= 0:
                os.close(memory.fd)
                memory.fd = -1

    def pause(self) -> None:
        if self.alive and not self.env.paused:
            self.env.paused = True
            self.world.trace(f"pause {self.name}")

    def resume(self) -> None:
        if self.alive and self.env.paused:
            self.world.loop.resume(self.env)
            self.world.trace(f"resume {self.name}")


class World:
    """The loop, the network and the nodes of one run."""

    def __init__(self, params, loop, network, rng: random.Random, trace) -> None:
        self.params = params
        self.loop = loop
        self.network = network
        self.rng = rng
        self.trace = trace
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.directory = tempfile.mkdtemp(prefix="mooncaked-sim-", dir=base)
        members = ",".join(f"{i}@{HOST}:{PEER_PORT_BASE + i}"
                           for i in range(1, params.nodes + 1))
        self.nodes: dict[int, SimNode] = {i: SimNode(self, i, members)
                                          for i in range(1, params.nodes + 1)}
        self.stopped: list[tuple[str, str]] = []  # (node, reason) of nodes that halted

    def node_stopped(self, node: SimNode, reason: str) -> None:
        if node.disk_faults:
            node.stop_excused = True
            self.trace(f"{node.name} stopped itself after a disk fault, as it must: {reason}")
            return
        self.trace(f"{node.name} stopped itself: {reason}")
        self.stopped.append((node.name, reason))

    def add_node(self, node_id: int, join_via: int) -> SimNode:
        node = SimNode(self, node_id, "", join=self.nodes[join_via].peer_address)
        self.nodes[node_id] = node
        node.start()
        return node

    def close(self) -> None:
        for node in self.nodes.values():
            if node.daemon is not None:
                node.env.crashed = True
                SimNode._release(node.daemon, close_log=node.filesystem is None)
                node.daemon = None
        shutil.rmtree(self.directory, ignore_errors=True)


class NodeLogFilter(logging.Filter):
    """Prefixes each record with the virtual time and the node that logged it."""

    def __init__(self, loop) -> None:
        super().__init__()
        self.loop = loop

    def filter(self, record: logging.LogRecord) -> bool:
        record.sim_where = getattr(environment.current.get(), "name", "world")
        record.sim_ms = int(self.loop.time() * 1000)
        return True

