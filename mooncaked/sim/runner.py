"""One seed of the simulation of real daemons, start to end.

Everything random comes from the seed: the run's parameters and fault schedule from one
generator, and, from another, a generator for each component in a fixed order. Nothing reads a
wall clock, so a seed always replays the same run (the trace digest says so).

Phases:
- safety: the clients run their operations while the schedule's faults happen (crash and
  restart, pause and resume, partitions, a slow network, leader transfers, a membership
  change, clients dropping their connection in the middle of a put);
- liveness: faults stop (partitions heal, paused nodes resume, crashed ones restart). Within
  `liveness_bound_ms` a leader must be elected, every pending request answered, a read of
  every key answered, and every member's state must catch up to the same digest.
The safety properties (sim/safety.py) are checked after every step; the client histories must
be linearizable at the end.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import hashlib
import inspect
import logging
import random
import warnings
from dataclasses import dataclass, field

from mooncaked import environment
from mooncaked.checks import linearizability
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.raft.types import Role
from mooncaked.meta import commands as c
from mooncaked.sim.client import (NAMESPACE, ConnectionLost, WireClient, decode_value,
                                  encode_value)
from mooncaked.sim.loop import Stalled, VirtualTimeLoop
from mooncaked.sim.safety import Safety, Violation
from mooncaked.sim.streams import Network
from mooncaked.sim.world import HOST, ClientEnvironment, NodeLogFilter, World

STEP_MS = 10  # the safety properties are checked this often (virtual time), and after faults
FAULT_KINDS = ("crash", "pause", "partition", "slow", "transfer", "membership", "outage",
               "disk")


@dataclass(frozen=True)
class Fault:
    at_ms: int
    kind: str
    target: str  # "leader", "follower" or "nodeN"; for membership: "remove", "drain"
    duration_ms: int = 0

    def describe(self) -> str:
        return f"{self.kind}({self.target}) at {self.at_ms} ms for {self.duration_ms} ms"

    def spec(self) -> str:
        return f"{self.kind}:{self.target}:{self.at_ms}:{self.duration_ms}"

    @staticmethod
    def format_schedule(faults) -> str:
        return ";".join(f.spec() for f in faults)

    @staticmethod
    def parse_schedule(text: str) -> list["Fault"]:
        """`kind:target:at_ms:duration_ms` separated by ';' (what format_schedule writes)."""
        faults = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            fields = part.split(":")
            if len(fields) != 4 or fields[0] not in FAULT_KINDS \
                    or not fields[2].isdigit() or not fields[3].isdigit():
                raise ValueError(f"{part!r} is not kind:target:at_ms:duration_ms with a kind "
                                 f"of {', '.join(FAULT_KINDS)}")
            faults.append(Fault(int(fields[2]), fields[0], fields[1], int(fields[3])))
        return sorted(faults, key=lambda f: (f.at_ms, f.kind, f.target))


@dataclass
class Params:
    seed: int
    nodes: int = 3
    read_mode: str = "lease"  # [cluster] read_mode
    snapshot_entries: int = 10_000  # [cluster] snapshot_entries: small ones snapshot often
    clients: int = 3
    ops: int = 8  # per client
    keys: int = 3
    max_value_bytes: int = 2000
    segment_bytes: int = 256 * 1024
    tick_ms: int = 50
    election_ticks: int = 10
    node_ttl_ms: int = 3000
    rpc_timeout_ms: int = 2000
    lease_ttl_ms: int = 500
    max_drift: float = 0.0
    client_timeout_ms: int = 6000
    client_abort_percent: int = 0  # puts whose client's connection drops as it sends them
    safety_ms: int = 6000
    liveness_bound_ms: int = 20000
    replica_num: int = 0  # of every put; 0: each put asks for 1 or 2 at random
    repair: bool = True  # [cluster] repair_bytes_per_s at its default, or 0 (no repair)
    node_return_grace_ms: int = 600_000  # [cluster] node_return_grace_ms (0: nothing kept)
    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def draw(cls, seed: int, rng: random.Random, **overrides) -> "Params":
        params = cls(seed)
        params.nodes = rng.choice((3, 3, 3, 5))
        params.read_mode = rng.choice(("lease", "safe"))
        params.snapshot_entries = rng.choice((10_000, 40, 10))
        params.clients = rng.randint(2, 3)
        params.ops = rng.randint(6, 12)
        params.keys = rng.randint(2, 4)
        params.max_drift = rng.choice((0.0, 0.001, 0.01, 0.05))
        params.client_abort_percent = rng.choice((0, 0, 5, 15))
        params.safety_ms = rng.randint(3000, 7000)
        count = rng.choice((0, 1, 2, 2, 3, 4, 5))
        faults = []
        for _ in range(count):
            kind = rng.choice(FAULT_KINDS)
            at_ms = rng.randint(1500, params.safety_ms)
            if kind == "membership":
                target = rng.choice(("remove", "drain"))
            elif kind in ("slow", "transfer", "outage"):
                target = "all" if kind == "outage" else "any"
            else:
                target = rng.choice(("leader", "follower",
                                     f"node{rng.randint(1, params.nodes)}"))
            duration = {"crash": rng.randint(200, 4000), "pause": rng.randint(100, 4000),
                        "partition": rng.randint(200, 5000), "slow": rng.randint(200, 2000),
                        "transfer": 0, "membership": 0, "outage": rng.randint(100, 3000),
                        "disk": rng.randint(200, 3000)}[kind]
            faults.append(Fault(at_ms, kind, target, duration))
        params.faults = sorted(faults, key=lambda f: (f.at_ms, f.kind, f.target))
        for key, value in overrides.items():
            setattr(params, key, value)
        return params

    def describe(self) -> str:
        faults = "; ".join(f.describe() for f in self.faults) or "none"
        return (f"nodes={self.nodes} read_mode={self.read_mode} "
                f"snapshot_entries={self.snapshot_entries} clients={self.clients} "
                f"ops={self.ops} keys={self.keys} "
                f"drift={self.max_drift} abort%={self.client_abort_percent} "
                f"safety_ms={self.safety_ms} faults: {faults}")


class SimFailure(Exception):
    """A seed broke a property: everything needed to replay it."""

    def __init__(self, params: Params, prop: str, detail: str, trace: list[str]) -> None:
        self.params = params
        self.prop = prop
        self.detail = detail
        self.trace = trace
        super().__init__(self.report())

    def report(self, lines: int = 40) -> str:
        recent = "\n".join("    " + line for line in self.trace[-lines:])
        return (f"seed {self.params.seed} broke {self.prop}: {self.detail}\n"
                f"  replay: python -m mooncaked.sim --seed {self.params.seed} --trace "
                f"--schedule \"{Fault.format_schedule(self.params.faults)}\"\n"
                f"  parameters: {self.params.describe()}\n"
                f"  last {min(lines, len(self.trace))} trace lines:\n{recent}")


@dataclass
class Stats:
    seed: int
    virtual_ms: int = 0
    callbacks: int = 0
    operations: int = 0
    unknown: int = 0
    elections: int = 0
    crashes: int = 0
    checks: int = 0
    trace_digest: str = ""
    unchecked_keys: list = field(default_factory=list)
    lossy_keys: list = field(default_factory=list)  # keys whose every replica node was lost

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Stop(Exception):
    """The run ends early: a property broke (carries the Violation)."""


class SimClient:
    """One client: operations one at a time on a small key set, recorded for the checker."""

    def __init__(self, run: "Run", index: int) -> None:
        self.run = run
        self.index = index
        self.name = f"client{index}"
        self.rng = random.Random(run.rng.random())
        self.env = ClientEnvironment(self.name, run.loop, self.rng, 0.0, 1.0)
        self.context = contextvars.Context()
        self.context.run(environment.current.set, self.env)
        self.wire: WireClient | None = None
        self.pending = None  # the operation waiting for its answer: (kind, key, since_ms)
        self.done = 0

    def start(self) -> asyncio.Task:
        return self.context.run(self.run.loop.create_task, self.main())

    async def _connect(self) -> WireClient:
        run = self.run
        while True:
            members = sorted(n.node_id for n in run.world.nodes.values()
                             if n.node_id not in run.removed)
            node_id = self.rng.choice(members)
            wire = WireClient(HOST, run.world.nodes[node_id].client_port, self.name)
            try:
                await asyncio.wait_for(wire.connect(), 2.0)
                return wire
            except (OSError, ConnectionLost, MooncakedError, asyncio.TimeoutError):
                wire.abort()
                await asyncio.sleep(0.1)

    async def main(self) -> None:
        run = self.run
        params = run.params
        while self.done < params.ops or (run.liveness and self.done < params.ops + 1):
            if self.wire is None or not self.wire.connected:
                self.wire = await self._connect()
            await self.operation(self.rng.choices(linearizability.KINDS,
                                                  (3, 3, 4, 1, 1))[0])
            self.done += 1
            await asyncio.sleep(self.rng.uniform(0, 0.2))

    async def operation(self, kind: str, key: str | None = None) -> None:
        run = self.run
        key = key or f"k{self.rng.randrange(run.params.keys)}"
        invoke_ns = run.now_ns()
        value_id = None
        payload = b""
        abort = False
        if kind in ("put", "upsert"):
            value_id = run.next_value_id()
            payload = encode_value(key, value_id, self.rng.randint(1, run.params.max_value_bytes))
            abort = self.rng.randrange(100) < run.params.client_abort_percent
        self.pending = (kind, key, run.loop.time())
        params = [key]
        if kind in ("put", "upsert"):
            replica_num = run.params.replica_num
            if not replica_num and self.rng.random() < 0.5:
                replica_num = 2
            if replica_num:
                params.append({"replica_num": replica_num})
        cut_after = None
        if abort:  # the whole request, or only part of its payload, then a reset
            cut_after = self.rng.choice((1 << 30, 20 + self.rng.randrange(len(payload))))
            run.trace(f"{self.name} {kind} {key}={value_id}: its connection drops after "
                      f"{min(cut_after, 1 << 20)} bytes of the request")
        waiter = self.wire.send(kind, params, payload, cut_after)
        try:
            error, result, data = await asyncio.wait_for(
                asyncio.shield(waiter), run.params.client_timeout_ms / 1000)
        except asyncio.TimeoutError:
            self.wire.abort()
            error, result, data = "timeout", None, b""
        except (ConnectionLost, MooncakedError) as exc:
            error, result, data = f"lost: {exc}", None, b""
        self.pending = None
        complete_ns = run.now_ns()
        code = error[0] if type(error) is list else None
        outcome = None
        if kind == "put" and error is None and result is False:
            # The key is present or being written (a put in progress holds it too, while a
            # get does not see it yet): no state of the checker's model; the put changed
            # nothing, so it is left out.
            run.trace(f"{self.name} put {key}={value_id} -> False (nothing changed)")
            return
        if error is None:
            outcome = result
            if kind == "get":
                try:
                    outcome = decode_value(key, data)
                except ValueError as exc:
                    run.fail(Violation("wrong bytes", f"{self.name} get {key}: {exc}"))
                    return
        elif kind == "get" and code == ErrorCode.OBJECT_NOT_FOUND:
            outcome = None
        elif kind == "remove" and code == ErrorCode.OBJECT_NOT_FOUND:
            outcome = False
        elif kind in ("get", "exists") or code in (ErrorCode.OBJECT_HAS_LEASE,
                                                   ErrorCode.INVALID_PARAMS):
            run.trace(f"{self.name} {kind} {key}: {error} (nothing changed)")
            return
        else:
            complete_ns = None  # a write whose outcome is unknown
        if kind == "remove" and error is None:
            outcome = True
        run.record(linearizability.Operation(self.index, kind, key, value_id, outcome,
                                             invoke_ns, complete_ns),
                   f"{self.name} {kind} {key}" + (f"={value_id}" if value_id else "")
                   + (f" -> {outcome!r}" if complete_ns is not None else f" -> ? {error}"))


class Run:
    def __init__(self, params: Params, rng: random.Random, trace_lines: list[str],
                 echo=None) -> None:
        self.params = params
        self.rng = rng
        self.lines = trace_lines
        self.echo = echo
        self.loop = VirtualTimeLoop()
        self.network = Network(self.loop, random.Random(rng.random()), trace=self.trace)
        self.loop.executor_delay = self._sync_delay
        self._sync_rng = random.Random(rng.random())
        self.world = World(params, self.loop, self.network, random.Random(rng.random()),
                           self.trace)
        self.safety = Safety(self.trace)
        self.history: list[linearizability.Operation] = []
        self._value_ids = 0
        self.removed: set[int] = set()
        self.membership_changed = False
        self.liveness = False
        # No acknowledged value is lost while a node holding one of its replicas lives. The
        # replicas of each key's readable version, as the most advanced member's state has
        # them (refreshed every step, at every acknowledgement and before a crash); segments
        # whose memory is gone (their node crashed, was declared down or removed). A key whose
        # every replica is in a dead segment may lose its value; no other may.
        self.replicas: dict[str, set[int]] = {}  # key -> segment ids of its replicas
        self.dead_segments: set[int] = set()
        self.lossy_keys: set[str] = set()
        self._down: set[int] = set()  # nodes the log says are down
        self.violation: Violation | None = None
        self.crashes = 0
        self.clients: list[SimClient] = []
        self.unchecked_keys: list[str] = []  # the linearizability checker ran out of time
        self.loop.set_exception_handler(self._exception)

    # -- bookkeeping ----------------------------------------------------------------------------

    def trace(self, text: str) -> None:
        line = f"{int(self.loop.time() * 1000):7d} {text}"
        self.lines.append(line)
        if self.echo is not None:
            self.echo(line)

    def now_ns(self) -> int:
        return int(self.loop.time() * 1e9)

    def next_value_id(self) -> int:
        self._value_ids += 1
        return self._value_ids

    def record(self, op: linearizability.Operation, text: str) -> None:
        self.history.append(op)
        self.trace(text)
        if op.kind in ("put", "upsert") and op.result is True:
            self.refresh_replicas()  # the leader applied the ArenaPut before it answered

    def _most_advanced_state(self):
        members = self._running_members()
        if not members:
            return None
        node = max(members, key=lambda n: n.daemon.cluster.raft.applied_index)
        return node.daemon.master.state

    def refresh_replicas(self) -> None:
        """Nodes newly declared down lose their replicas (as seen before), then the replicas
        are read again."""
        state = self._most_advanced_state()
        if state is None:
            return
        down = {n.node_id for n in state.nodes.values() if not n.up}
        for node_id in sorted(down - self._down):
            self.lose_replicas(node_id, "declared down")
        self._down = down
        replicas = {}
        for (namespace, key), entry in state.objects.items():
            if namespace == NAMESPACE and entry.complete is not None:
                replicas[key] = {r.segment_id for r in entry.complete.replicas}
        self.replicas = replicas

    def lose_replicas(self, node_id: int, why: str) -> None:
        """A node's memory or replicas are gone: keys with no replica left may lose their
        value."""
        state = self._most_advanced_state()
        segments = {s for segs in self.replicas.values() for s in segs}
        if state is not None:
            segments |= set(state.segments)
        self.dead_segments |= {s for s in segments if c.node_of_segment(s) == node_id}
        keys = {key for key, segs in self.replicas.items() if segs <= self.dead_segments}
        new = sorted(keys - self.lossy_keys)
        if new:
            self.trace(f"node{node_id} {why}: no replica of {', '.join(new)} is left")
        self.lossy_keys |= keys


    def fail(self, violation: Violation) -> None:
        if self.violation is None:
            self.violation = violation
            self.trace(f"VIOLATION {violation}")

    def _exception(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if exc is None:
            return  # "Task was destroyed but it is pending": a crashed node's, seen by the GC
        where = getattr(environment.current.get(), "name", "world")
        text = f"{context.get('message')}: {type(exc).__name__ if exc else ''} {exc or ''}"
        # An error no code handled (a callback that raised, a task whose failure nobody
        # looked at): the daemon would only have logged it and gone on.
        self.fail(Violation("unhandled error", f"in {where}: {text}"))

    def _sync_delay(self) -> float:
        return self._sync_rng.uniform(0.0002, 0.004)

    # -- the run --------------------------------------------------------------------------------

    def check(self) -> None:
        if self.violation is not None:
            raise _Stop()
        try:
            self.safety.check(self.world)
            self.refresh_replicas()
        except Violation as violation:
            self.fail(violation)
            raise _Stop() from None

    async def _checker(self) -> None:
        while True:
            await asyncio.sleep(STEP_MS / 1000)
            self.check()

    def _running_members(self) -> list:
        return [n for n in self.world.nodes.values()
                if n.running and n.node_id not in self.removed]

    def _leader(self):
        for node in self._running_members():
            if node.daemon.cluster.raft.role == Role.LEADER and not node.env.paused:
                return node
        return None

    def _pick(self, target: str):
        members = self._running_members()
        if target == "leader":
            return self._leader()
        if target == "follower":
            followers = [n for n in members if n.daemon.cluster.raft.role != Role.LEADER]
            return self.rng.choice(followers) if followers else None
        return next((n for n in members if n.name == target), None)

    async def _admin(self, method: str, params: list) -> bool:
        """A cluster administration request (mooncakectl's), through any running member;
        whether it was answered without an error."""
        members = [n for n in self._running_members() if not n.env.paused]
        if not members:
            return False
        node = self.rng.choice(members)
        wire = WireClient(HOST, node.client_port, "admin")
        try:
            await asyncio.wait_for(wire.connect(), 2.0)
            result, _ = await asyncio.wait_for(wire.call(method, params), 10.0)
            self.trace(f"admin {method} {params} via {node.name}: {result!r}")
            return True
        except (OSError, ConnectionLost, MooncakedError, asyncio.TimeoutError) as exc:
            self.trace(f"admin {method} {params} via {node.name}: {type(exc).__name__} {exc}")
            return False
        finally:
            wire.abort()

    async def _fault(self, fault: Fault) -> None:
        world = self.world
        self.trace(f"fault {fault.describe()}")
        if fault.kind == "slow":
            self.network.slow_s = 0.02
            await asyncio.sleep(fault.duration_ms / 1000)
            self.network.slow_s = 0.0
            return
        if fault.kind == "transfer":
            members = self._running_members()
            if members:
                await self._admin("cluster_transfer_leader",
                                  [self.rng.choice(members).node_id])
            return
        if fault.kind == "membership":
            await self._membership(fault.target)
            return
        if fault.kind == "outage":  # every node at once: what the disks kept is all there is
            nodes = [n for n in world.nodes.values() if n.daemon is not None]
            self.refresh_replicas()
            for node in nodes:
                node.crash(power_loss=True)
                self.crashes += 1
                self.lose_replicas(node.node_id, "crashed")
            self.check()
            await asyncio.sleep(fault.duration_ms / 1000)
            for node in nodes:
                if node.daemon is None and not self.liveness:
                    node.start()
            return
        node = self._pick(fault.target)
        if node is None:
            return
        if fault.kind == "crash":
            self.refresh_replicas()
            node.crash()
            self.crashes += 1
            self.lose_replicas(node.node_id, "crashed")
            self.check()
            await asyncio.sleep(fault.duration_ms / 1000)
            if node.daemon is None and not self.liveness:
                node.start()
        elif fault.kind == "disk":
            await self._disk_fault(node, fault.duration_ms)
        elif fault.kind == "pause":
            node.pause()
            await asyncio.sleep(fault.duration_ms / 1000)
            node.resume()
        elif fault.kind == "partition":
            if self.rng.random() < 0.3:  # one link only: the others still reach both ends
                others = {self.rng.choice([n.name for n in world.nodes.values()
                                           if n is not node])}
            else:  # the node alone, cut off from the others and from some clients
                others = {n.name for n in world.nodes.values() if n is not node}
                others |= {c.name for c in self.clients if self.rng.random() < 0.5}
            self.network.reset_on_partition = self.rng.random() < 0.3
            self.network.partition({node.name}, others)
            await asyncio.sleep(fault.duration_ms / 1000)
            self.network.heal()
            self.trace(f"healed {node.name} and {', '.join(sorted(others))}")

    async def _disk_fault(self, node, duration_ms: int) -> None:
        """The node's disk fails (EIO on a write or a sync) or fills up: the node must stop
        itself rather than act on a log it could not make durable. Once the disk is fixed
        (the fault's duration), a stopped node is started again, as a supervisor would, with
        empty memory and the log its disk kept."""
        fs = node.filesystem
        how = self.rng.choice(("write", "sync", "full"))
        if how == "write":
            fs.fail_writes()
        elif how == "sync":
            fs.fail_syncs()
        else:
            fs.capacity_bytes = fs.used_bytes + self.rng.randint(0, 8192)
        node.disk_faults += 1
        self.trace(f"{node.name}'s disk fails ({how})")
        deadline = self.loop.time() + duration_ms / 1000
        while self.loop.time() < deadline:
            if node.stop_excused:
                self.restart_stopped(node)
            await asyncio.sleep(STEP_MS / 1000)
        node.disk_faults = max(0, node.disk_faults - 1)
        if not node.disk_faults:
            fs.clear_faults()
        self.trace(f"{node.name}'s disk is fixed")
        if node.stop_excused:
            self.restart_stopped(node)
        if node.daemon is None and not self.liveness:
            node.start()

    def restart_stopped(self, node) -> None:
        """A node that stopped itself after a disk fault is gone with its memory: its process
        is reaped (started again later, with its disk fixed)."""
        node.stop_excused = False
        self.refresh_replicas()
        node.crash()
        self.crashes += 1
        self.lose_replicas(node.node_id, "stopped after a disk fault")
        self.check()

    async def _membership(self, how: str) -> None:
        """Take one voter out (remove or drain), then bring a new node in to replace it."""
        members = self._running_members()
        if len(members) < 3 or self.membership_changed:
            return
        self.membership_changed = True  # one change per run
        victim = self.rng.choice(members)
        method = "cluster_remove" if how == "remove" else "cluster_drain"
        if not await self._admin(method, [victim.node_id]):
            return  # not applied, or its outcome unknown: no new node this run
        self.removed.add(victim.node_id)
        self.lose_replicas(victim.node_id, "removed")
        new_id = max(self.world.nodes) + 1
        via = self.rng.choice(self._running_members())
        self.trace(f"add node{new_id} joining through {via.name}")
        self.world.add_node(new_id, via.node_id)

    async def _heal(self) -> None:
        self.liveness = True
        self.trace("faults stop: heal, resume, restart")
        self.network.heal()
        self.network.slow_s = 0.0
        for node in self.world.nodes.values():
            node.filesystem.clear_faults()
            if node.stop_excused:
                self.restart_stopped(node)
            node.disk_faults = 0
            if node.daemon is None:
                node.start()
            elif node.env.paused:
                node.resume()

    async def main(self) -> None:
        """The run, with the properties checked every STEP_MS beside it: a broken one ends
        the run at once."""
        work = asyncio.ensure_future(self._phases())
        checker = asyncio.ensure_future(self._checker())
        try:
            await asyncio.wait([work, checker], return_when=asyncio.FIRST_COMPLETED)
        finally:
            checker.cancel()
            if not work.done():
                work.cancel()
        if checker.done() and not checker.cancelled() and checker.exception() is not None:
            raise checker.exception()
        work.result()

    async def _phases(self) -> None:
        params = self.params
        for node in self.world.nodes.values():
            node.start()
        self.clients = [SimClient(self, i) for i in range(params.clients)]
        tasks = [client.start() for client in self.clients]
        faults = []
        for fault in params.faults:
            async def later(fault=fault):
                await asyncio.sleep(fault.at_ms / 1000)
                if not self.liveness:
                    await self._fault(fault)
            faults.append(asyncio.ensure_future(later()))
        await asyncio.sleep(params.safety_ms / 1000)
        await self._heal()
        for fault in faults:
            fault.cancel()
        await self._liveness(tasks)

    async def _liveness(self, tasks) -> None:
        params = self.params
        deadline = self.loop.time() + params.liveness_bound_ms / 1000
        self.check()
        done, pending = await asyncio.wait(tasks, timeout=deadline - self.loop.time())
        if pending:
            stuck = [f"{c.name} {c.pending}" for c in self.clients if c.pending]
            raise Violation("liveness", f"requests unanswered {params.liveness_bound_ms} ms "
                            f"after the faults stopped: {stuck or 'clients could not connect'}")
        for task in done:
            if task.exception() is not None and not isinstance(task.exception(), _Stop):
                raise task.exception()
        # A read of every key, answered.
        reader = self.clients[0]
        for index in range(params.keys):
            await self.context_of(reader, reader.operation("get", f"k{index}"))
        # Every member catches up to the same state; a node the cluster removed knows it.
        while True:
            self.check()
            leader = self._leader()
            if leader is not None and self._converged(leader):
                return
            if self.loop.time() > deadline:
                raise Violation("liveness", "the cluster did not settle within "
                                f"{params.liveness_bound_ms} ms of the faults stopping: "
                                + "; ".join(self._describe(n)
                                            for n in self.world.nodes.values() if n.running))
            await asyncio.sleep(0.05)

    def _converged(self, leader) -> bool:
        raft = leader.daemon.cluster.raft
        conf = raft.core.conf_state
        members = set(conf.voters) | set(conf.learners)
        running = [n for n in self.world.nodes.values() if n.running]
        in_cluster = [n for n in running if n.node_id in members]
        if any(not n.daemon.cluster.removed for n in running if n.node_id not in members):
            return False
        states = {self.safety.digest_of(n) for n in in_cluster}
        return len(states) == 1 and next(iter(states))[0] >= raft.core.commit_index \
            and all(n.daemon.cluster.registered_term >= 0 for n in in_cluster)

    @staticmethod
    def _describe(node) -> str:
        cluster = node.daemon.cluster
        return (f"{node.name} {cluster.raft.role.name.lower()} applied "
                f"{cluster.raft.applied_index} registered {cluster.registered_term >= 0} "
                f"removed {cluster.removed}")

    async def context_of(self, client: SimClient, coroutine):
        """Run a client's coroutine in its context (its endpoint name, its environment)."""
        if client.wire is None or not client.wire.connected:
            client.wire = await client.context.run(
                self.loop.create_task, client._connect())
        return await client.context.run(self.loop.create_task, coroutine)

    def linearizable(self) -> linearizability.CheckResult:
        """The history, key by key: a key that may have lost its value with a node's
        replicas may lose it spontaneously; no other may."""
        kept = [op for op in self.history if op.key not in self.lossy_keys]
        lossy = [op for op in self.history if op.key in self.lossy_keys]
        result = linearizability.check(kept, allow_spontaneous_loss=False, time_budget_s=5.0)
        if result.ok:
            self.unchecked_keys += result.timed_out_keys
            result = linearizability.check(lossy, allow_spontaneous_loss=True,
                                           time_budget_s=5.0)
        self.unchecked_keys += result.timed_out_keys
        return result


def run_seed(seed: int, *, echo=None, log_level: int | None = None, **overrides) -> Stats:
    """Run one seed; its Stats, or SimFailure naming the broken property."""
    params = Params.draw(seed, random.Random(seed), **overrides)
    lines: list[str] = []
    # The run's own generator does not follow the draw's: a scenario given in full by
    # overrides replays the same whatever Params.draw does.
    run = Run(params, random.Random(f"mooncaked-sim-run-{seed}"), lines, echo)
    handler = None
    # The daemons' loggers are quieted (or set to log_level) for the run only: a process that
    # runs seeds goes on logging as before (pytest's caplog, the daemon in the same process).
    saved_levels = {name: logging.getLogger(name).level for name in ("mooncaked", "asyncio")}
    if log_level is not None:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(sim_ms)7d %(sim_where)s %(levelname)s "
                                               "%(name)s: %(message)s"))
        handler.addFilter(NodeLogFilter(run.loop))
        logging.getLogger("mooncaked").addHandler(handler)
        logging.getLogger("mooncaked").setLevel(log_level)
    else:
        logging.getLogger("mooncaked").setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    asyncio.set_event_loop(run.loop)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            try:
                run.loop.run_until_complete(run.main())
            except _Stop:
                pass
            except Violation as violation:
                run.fail(violation)
            except Stalled as exc:
                run.fail(Violation("liveness", f"the loop stalled: {exc}"))
            gc.collect()  # what the run dropped is finalized now, not in a later run
        for warning in caught:
            if "never awaited" in str(warning.message):
                # Work created and dropped: a request never sent, and a warning in the log.
                run.fail(Violation("unawaited coroutine", f"{warning.message} "
                                   f"({warning.filename}:{warning.lineno})"))
        if run.violation is None:
            result = run.linearizable()
            if not result.ok:
                run.fail(Violation("linearizability", f"key {result.failed_key}: "
                                   f"{result.explanation}"))
        stats = Stats(seed, virtual_ms=int(run.loop.time() * 1000),
                      callbacks=run.loop.callbacks_run, operations=len(run.history),
                      unknown=sum(op.complete_ns is None for op in run.history),
                      elections=len(run.safety._announced), crashes=run.crashes,
                      checks=run.safety.checks, unchecked_keys=list(run.unchecked_keys),
                      lossy_keys=sorted(run.lossy_keys))
        if run.violation is not None:
            raise SimFailure(params, run.violation.prop, run.violation.detail, lines)
        digest = hashlib.sha256("\n".join(lines).encode())
        digest.update(str((stats.callbacks, stats.virtual_ms)).encode())
        stats.trace_digest = digest.hexdigest()[:16]
        return stats
    finally:
        asyncio.set_event_loop(None)
        _close_loop(run)
        if handler is not None:
            logging.getLogger("mooncaked").removeHandler(handler)
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)


def _close_loop(run: Run) -> None:
    """Drop what the run left: every node's process, the loop, the temporary directory."""
    for node in run.world.nodes.values():
        if node.env is not None:
            node.env.crashed = True
    run.world.close()
    loop = run.loop
    for task in asyncio.all_tasks(loop):
        task._log_destroy_pending = False
        coroutine = task.get_coro()
        if inspect.iscoroutine(coroutine) \
                and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()  # cut off by the end of the run before it started
    loop.close()
    with warnings.catch_warnings():
        # What the end of the run cut off is finalized here, not counted against the next.
        warnings.simplefilter("ignore", RuntimeWarning)
        gc.collect()
