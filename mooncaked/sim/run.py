"""One seed, start to end: build the cluster, run the safety phase under the seed's faults,
heal, run the liveness phase, and check the end-of-run properties.

Everything random comes from one `random.Random(seed)`: the seed's parameters are drawn from it
first, then every component gets its own generator from it, in a fixed order. Nothing reads a
wall clock or the global `random`, so a seed always replays the same run (the trace digest says
so).

Phases:
- safety: faults on, until the clients have issued `ops` operations and got them back (or
  `max_safety_ms` of virtual time passed);
- liveness: faults off, partitions healed, crashed nodes restarted, paused ones resumed. A
  leader must be elected and every client must get an answer to a new request within 10
  election timeouts; then every node must register and catch up, and a final read of every key
  must complete. Then the end checks run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mooncaked.checks import linearizability
from mooncaked.meta import commands as c
from mooncaked.raft.types import (ConfChange, ConfChangeKind, Message, NotLeader,
                                  ProposalDropped, Role)
from mooncaked.sim import params as sim_params
from mooncaked.sim.checks import Checker, Violation
from mooncaked.sim.events import MS, Scheduler, Trace
from mooncaked.sim.network import Network
from mooncaked.sim.node import SimNode
from mooncaked.sim.workload import Client


class SimFailure(Exception):
    """A seed broke a property (or crashed the code under test): everything to replay it."""

    def __init__(self, params, prop: str, detail: str, recent: list[str], stats: dict) -> None:
        self.params = params
        self.prop = prop
        self.detail = detail
        self.recent = recent
        self.stats = stats
        super().__init__(self.report())

    def report(self, lines: int = 60) -> str:
        trace = "\n".join("    " + line for line in self.recent[-lines:])
        return (f"seed {self.params.seed} broke {self.prop}: {self.detail}\n"
                f"  replay: python -m mooncaked.sim --seed {self.params.seed} --trace"
                f"{_cli_overrides(self.params)} (plus any --nodes/--ops/... it ran with)\n"
                f"  parameters: {self.params.describe()}\n"
                f"  stats: {self.stats}\n"
                f"  last {min(lines, len(self.recent))} trace lines:\n{trace}")


def _cli_overrides(params) -> str:
    parts = []
    if params.mutant:
        parts.append(f" --mutant {params.mutant}")
    for fix in sim_params.FIXES:
        if fix not in params.fixes:
            parts.append(f" --without-fix {fix}")
    return "".join(parts)


@dataclass
class Stats:
    seed: int
    events: int = 0
    virtual_ms: int = 0
    elections: int = 0
    ops: int = 0
    history: int = 0
    crashes: int = 0
    messages: int = 0
    liveness_ms: int = 0  # from healing to every client answered
    trace_digest: str = ""
    unchecked_keys: list = field(default_factory=list)  # linearizability checker ran out of time

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "trace_digest"}


class Simulation:
    def __init__(self, params, rng: random.Random, echo=None) -> None:
        self.params = params
        self._root = rng
        self.scheduler = Scheduler()
        self.trace = Trace(self.scheduler, echo)
        self.checker = Checker(self.trace)
        self.network = Network(self.scheduler, self.derive_rng(), params, self._deliver)
        self.faults_rng = self.derive_rng()
        self.segment_bytes = params.segment_kib * 1024
        voters = tuple(range(1, params.voters + 1))
        self.nodes: dict[int, SimNode] = {n: SimNode(self, n, voters) for n in voters}
        self.learner_id = params.voters + 1 if params.learner else 0
        if self.learner_id:
            self.nodes[self.learner_id] = SimNode(self, self.learner_id, None)
        self.clients = [Client(self, i) for i in range(params.clients)]
        self.history: list = []
        self.phase = "safety"
        self.ops_left = params.ops
        self._values = 0
        self._requests = 0
        self._partition_id = 0
        self.heal_ns = 0
        self.stats = Stats(params.seed)

    def derive_rng(self) -> random.Random:
        return random.Random(self._root.getrandbits(64))

    def new_request_id(self) -> int:
        self._requests += 1
        return self._requests

    def new_value(self) -> int:
        self._values += 1
        return self._values

    def started_node_ids(self) -> list[int]:
        return [n for n, node in self.nodes.items() if node.ever_started]

    def leader(self) -> SimNode | None:
        """The live node that believes it leads in the highest term, if any."""
        best = None
        for node in self.nodes.values():
            if node.alive and node.core.role == Role.LEADER and (
                    best is None or node.core.term > best.core.term):
                best = node
        return best

    def _deliver(self, dst: int, src: int, payload) -> None:
        target = self.nodes.get(dst)
        if target is not None:
            if isinstance(payload, Message):
                self.trace(f"n{dst} <- n{src} {payload.type.name} t{payload.term} "
                           f"i{payload.index} n{len(payload.entries)} c{payload.commit}"
                           f"{' reject' if payload.reject else ''}")
            target.receive(src, payload)
        else:
            self.clients[dst - 1000].receive(src, payload)

    # -- running ------------------------------------------------------------------------------

    def run(self) -> Stats:
        p, scheduler = self.params, self.scheduler
        self.trace(f"seed {p.seed}: {p.describe()}")
        for node_id in range(1, p.voters + 1):
            self.nodes[node_id].start()
        for client in self.clients:
            scheduler.after(client.rng.randrange(0, 20 * MS), client.next_op)
        self._schedule_faults()
        safety_end = p.max_safety_ms * MS
        try:
            while self.phase != "done":
                if not scheduler.run_one():
                    raise Violation("liveness", "nothing left to do")
                if self.phase == "safety" and (scheduler.now >= safety_end or (
                        self.ops_left <= 0 and all(c.op is None for c in self.clients))):
                    self._start_liveness()
                elif self.phase != "safety" and scheduler.now > self._deadline_ns:
                    raise Violation("liveness", f"{self._waiting_for()} not done "
                                    f"{(scheduler.now - self.heal_ns) // MS} ms after healing")
            self._end_checks()
        except Violation as exc:
            raise self._failure(exc.prop, exc.detail) from None
        except Exception as exc:  # the code under test (or the sim) crashed: same report
            raise self._failure("no exception", f"{type(exc).__name__}: {exc}") from exc
        return self._final_stats()

    def _final_stats(self) -> Stats:
        s = self.stats
        s.events = self.scheduler.events
        s.virtual_ms = self.scheduler.now // MS
        s.elections = self.checker.elections
        s.history = len(self.history)
        s.ops = sum(c.completed for c in self.clients)
        s.crashes = sum(n.crashes for n in self.nodes.values())
        s.messages = self.network.sent
        s.trace_digest = self.trace.digest()
        return s

    def _failure(self, prop: str, detail: str) -> SimFailure:
        return SimFailure(self.params, prop, detail, list(self.trace.recent),
                          self._final_stats().as_dict())

    # -- faults (safety phase only) -----------------------------------------------------------

    def _schedule_faults(self) -> None:
        p = self.params
        for every, fault in ((p.partition_every_ms, self._partition),
                             (p.crash_every_ms, self._crash),
                             (p.pause_every_ms, self._pause),
                             (p.outage_every_ms, self._outage),
                             (p.transfer_every_ms, self._transfer)):
            if every:
                self._next_fault(every, fault)
        if self.learner_id:
            self.scheduler.after(int(self.faults_rng.uniform(100, 1500) * MS), self._join)

    def _next_fault(self, every_ms: float, fault) -> None:
        delay = int(self.faults_rng.expovariate(1.0 / every_ms) * MS)
        self.scheduler.after(delay, self._fault, every_ms, fault)

    def _fault(self, every_ms: float, fault) -> None:
        if self.phase != "safety":
            return
        fault()
        self._next_fault(every_ms, fault)

    def _leader_or_random(self, candidates: list[int]) -> int:
        leader = self.leader()
        if leader is not None and leader.node_id in candidates and self.faults_rng.random() < 0.4:
            return leader.node_id
        return self.faults_rng.choice(candidates)

    def _partition(self) -> None:
        rng, network = self.faults_rng, self.network
        ids = self.started_node_ids()
        network.heal()
        if rng.random() < 0.5:
            side = [self._leader_or_random(ids)]
        else:
            side = rng.sample(ids, rng.randint(1, len(ids) - 1))
        others = [n for n in ids if n not in side]
        one_way = rng.random() < 0.3
        network.partition(side, others, one_way)
        self._partition_id += 1
        duration = int(rng.expovariate(1.0 / self.params.partition_ms) * MS) + MS
        self.trace(f"partition {sorted(side)} | {others}{' one-way' if one_way else ''} "
                   f"for {duration // MS} ms")
        self.scheduler.after(duration, self._heal, self._partition_id)

    def _heal(self, partition_id: int) -> None:
        if partition_id == self._partition_id and self.phase == "safety":
            self.network.heal()
            self.trace("partition healed")

    def _crash(self) -> None:
        alive = [n for n in self.started_node_ids() if self.nodes[n].alive]
        if not alive:
            return
        node = self.nodes[self._leader_or_random(alive)]
        node.crash()
        down = int(self.faults_rng.expovariate(1.0 / self.params.down_ms) * MS) + MS
        self.scheduler.after(down, self._restart, node.node_id, node.incarnation)

    def _outage(self) -> None:
        """Every node goes down at once and comes back within a few ms: elections start from
        recovered disks with timers that all began together."""
        self.trace("outage: every node crashes")
        for node in self.nodes.values():
            if node.alive:
                node.crash()
                back = int(self.faults_rng.uniform(0.0, 20.0) * MS)
                self.scheduler.after(back, self._restart, node.node_id, node.incarnation)

    def vote_granted(self, node: SimNode) -> None:
        """A fault site (FoundationDB's BUGGIFY idea): crash a node just after it voted, when
        forgetting the vote would matter most, and bring it back at once."""
        if self.phase == "safety" and self.faults_rng.random() < self.params.crash_after_vote:
            self.scheduler.after(0, self._crash_now, node.node_id, node.incarnation)

    def _crash_now(self, node_id: int, incarnation: int) -> None:
        node = self.nodes[node_id]
        if node.alive and node.incarnation == incarnation and self.phase == "safety":
            node.crash()
            down = int(self.faults_rng.uniform(0.05, 2.0) * MS)
            self.scheduler.after(down, self._restart, node_id, node.incarnation)

    def _restart(self, node_id: int, incarnation: int) -> None:
        node = self.nodes[node_id]
        if not node.alive and node.incarnation == incarnation and self.phase == "safety":
            node.start()

    def _pause(self) -> None:
        alive = [n for n in self.started_node_ids() if self.nodes[n].alive]
        if alive:
            node = self.nodes[self._leader_or_random(alive)]
            node.pause(int(self.faults_rng.uniform(0, 3 * self.params.election_ms) * MS))

    def _transfer(self) -> None:
        leader = self.leader()
        if leader is None:
            return
        others = [v for v in leader.core.conf_state.voters if v != leader.node_id]
        if not others:
            return
        target = self.faults_rng.choice(others)
        self.trace(f"n{leader.node_id} transfer leadership to n{target}")
        try:
            leader.core.transfer_leader(target)
        except (NotLeader, ProposalDropped):
            return
        leader._process()

    def _join(self) -> None:
        """The extra node joins as a learner; the leader promotes it once it has caught up.
        Not a fault: if the safety phase ends first, joining goes on while things settle.
        Retried every 50 ms until the membership holds the node (a proposal can be lost)."""
        if self.phase == "done" or self._joined():
            return
        node = self.nodes[self.learner_id]
        if not node.ever_started:
            node.start()
        self.scheduler.after(50 * MS, self._join)
        leader = self.leader()
        if leader is None:
            return
        self.trace(f"n{leader.node_id} adds n{self.learner_id} as a learner")
        leader._propose(lambda: leader.core.propose_conf_change(
            ConfChange(ConfChangeKind.ADD_LEARNER, self.learner_id)), lambda result, before: None)

    def _joined(self) -> bool:
        for node in self.nodes.values():
            if node.alive and node.node_id != self.learner_id and self.learner_id in (
                    node.core.conf_state.learners + node.core.conf_state.voters):
                return True
        return False

    # -- liveness -----------------------------------------------------------------------------

    def _start_liveness(self) -> None:
        self.phase = "liveness"
        self.heal_ns = self.scheduler.now
        self._deadline_ns = self.heal_ns + 10 * self.params.election_ms * MS
        self.trace("=== liveness: faults off, everything healed ===")
        self.network.calm(self.params)
        for node in self.nodes.values():
            if node.ever_started and not node.alive:
                node.start()
            elif node.alive:
                node.unpause()
        for client in self.clients:
            client.abandon()
        for client in self.clients:
            self.scheduler.after(0, client.next_op)

    def op_finished(self, client, op, answered: bool) -> None:
        if self.phase == "liveness" and all(c.probe_done for c in self.clients):
            self.stats.liveness_ms = (self.scheduler.now - self.heal_ns) // MS
            self.phase = "settling"
            self._deadline_ns = self.scheduler.now + 30 * self.params.election_ms * MS
            self.trace("=== every client answered; waiting for the nodes to settle ===")
            self.scheduler.after(0, self._poll_settled)
        elif self.phase == "final reads" and client is self.clients[0]:
            self._final_read()

    def _poll_settled(self) -> None:
        if self.phase != "settling":
            return
        if self._settled():
            self.phase = "final reads"
            self._final_keys = [f"k{i}" for i in range(self.params.keys)]
            self.trace("=== settled; reading every key ===")
            self._final_read()
        else:
            self.scheduler.after(self.params.tick_ms * MS, self._poll_settled)

    def _settled(self) -> bool:
        """A leader has applied everything it committed, every live member caught up, and every
        started node is registered with its current memory generation."""
        leader = self.leader()
        if leader is None or leader.applied_index < leader.core.commit_index:
            return False
        for node in self.nodes.values():
            if not node.ever_started:
                continue
            if node.applied_index != leader.applied_index or node.registered_term < 0:
                return False
            if leader.gen_of(node.node_id) != node.generation:
                return False
            registered = leader.state.nodes.get(node.node_id)
            if registered is None or not registered.up:
                return False
        return True

    def _final_read(self) -> None:
        if self._final_keys:
            self.clients[0].read_key(self._final_keys.pop(0))
        else:
            self.phase = "done"

    def _waiting_for(self) -> str:
        if self.phase == "liveness":
            waiting = [c.client_id for c in self.clients if not c.probe_done]
            leader = self.leader()
            return (f"answers to clients {waiting} (leader: "
                    f"{leader.node_id if leader else 'none'})")
        if self.phase == "settling":
            leader = self.leader()
            nodes = {}
            for n in self.nodes.values():
                if n.ever_started:
                    logged = leader.state.nodes.get(n.node_id) if leader else None
                    nodes[n.node_id] = (n.alive, n.applied_index, n.registered_term, n.generation,
                                        leader.gen_of(n.node_id) if leader else None,
                                        logged.up if logged else None)
            return (f"settling (leader {leader.node_id if leader else None}, "
                    f"commit {leader.core.commit_index if leader else None}; nodes: (alive, "
                    f"applied, registered term, generation, generation in the log, up in the "
                    f"log): {nodes})")
        return "the final reads"

    # -- end of run ---------------------------------------------------------------------------

    def _end_checks(self) -> None:
        leader = self.leader()
        for node in self.nodes.values():
            if node.alive:
                self.checker.invariants(node)
        self._check_memory(leader)
        self.checker.durability(leader.state, leader.applied_index)
        result = linearizability.check(self.history, allow_spontaneous_loss=True,
                                       time_budget_s=10.0)
        if not result.ok:
            raise Violation("linearizability", f"key {result.failed_key}: {result.explanation}")
        self.stats.unchecked_keys = list(result.timed_out_keys)

    def _check_memory(self, leader) -> None:
        """Every replica the settled log lists holds its version's bytes."""
        for key, entry in leader.state.objects.items():
            version = entry.complete
            if version is None:
                continue
            tag = (version.writer_id, version.started_ms, version.size_bytes)
            expected = (tag, self.checker.values.get((key, tag)))
            for replica in version.replicas:
                node = self.nodes[c.node_of_segment(replica.segment_id)]
                held = node.memory.get((replica.segment_id, replica.offset))
                if held != expected:
                    raise Violation("exact bytes", f"after settling, {key} version {tag} lists a"
                                    f" replica on node {node.node_id} (segment "
                                    f"{replica.segment_id} offset {replica.offset}) that holds "
                                    f"{held}")


def run_seed(seed: int, echo=None, **overrides) -> Stats:
    """Run one seed; raises SimFailure if it breaks a property."""
    rng = random.Random(seed)
    params = sim_params.draw(seed, rng, **overrides)
    return Simulation(params, rng, echo).run()

