"""A simulated mooncaked node: the real Raft core and state machine, driven the way
cluster/raft_node.py and cluster/service.py drive them, on simulated time, disk and network.

Per Ready (as the daemon's `_process`): a leader sends first; everyone persists the snapshot,
entries and hard state, and while the sync runs (`fsync_ms`, in the daemon's sync thread) the node
keeps taking messages and ticks but produces no new Ready; once synced it sends (if not a
leader), installs the snapshot, applies the committed entries, queues the read states and
advances. Ticks are counted from the node's local clock, so after a pause the missed ticks
happen at once. A pause (SIGSTOP) makes the node busy: whatever arrives meanwhile waits in
`inbox`, in order.

Replica bytes are a dict {(segment_id, offset): (version tag, value id)}; a crash empties it.
Every registration uses a new memory generation, carried in the NodeUp's peer address; a
replica request names the generation its sender's log shows for the node, and the node refuses
another one (fix "replica_generation"; without it the node checks only what the daemon checks: the
segment is mounted in its own applied state, which lets a restarted node serve the fresh
memory of a segment its log still lists).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from typing import Callable

from mooncaked._native import OffsetAllocator
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec as command_codec
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import StateMachine
from mooncaked.raft import codec as raft_codec
from mooncaked.raft.core import RaftConfig, RaftCore
from mooncaked.raft.types import (ConfChange, ConfChangeKind, ConfState, EntryKind, Message,
                                  NotLeader, ProposalDropped, Role, Snapshot, SnapshotMeta)
from mooncaked.sim.disk import SimDisk
from mooncaked.sim.events import MS
from mooncaked.sim.master import SimMaster

SEGMENT_ALIGNMENT = 64
SEGMENT_MAX_ALLOCATIONS = 64


def new_state(params) -> StateMachine:
    return StateMachine(lambda size, alignment, max_allocations:
                        OffsetAllocator(size, alignment, max_allocations),
                        max_objects=1024,
                        put_start_discard_timeout_ms=params.discard_timeout_ms,
                        put_start_release_timeout_ms=params.release_timeout_ms,
                        allocation_strategy="random")


def store_config(params) -> StoreConfig:
    return StoreConfig(lease_ttl_ms=params.lease_ttl_ms,
                       put_start_discard_timeout_ms=params.discard_timeout_ms,
                       put_start_release_timeout_ms=params.release_timeout_ms,
                       max_objects=1024)


class RpcClient:
    """Request/response over the simulated network, with a timeout; replies after it are
    ignored. `done` gets the reply tuple, or ("timeout",)."""

    def __init__(self, owner: int, sim) -> None:
        self.owner = owner
        self.sim = sim
        self._pending: dict[int, Callable[[tuple], None]] = {}

    def call(self, dst: int, method: str, args: tuple, done: Callable[[tuple], None],
             timeout_ms: float) -> None:
        # Ids are unique over the whole run: a reply to a crashed incarnation's request must
        # not match a request of the next one (a new process has new connections).
        request_id = self.sim.new_request_id()
        self._pending[request_id] = done
        self.sim.network.send_rpc(self.owner, dst, ("req", request_id, method, args))
        self.sim.scheduler.after(int(timeout_ms * MS), self._expire, request_id)

    def on_reply(self, request_id: int, result: tuple) -> None:
        done = self._pending.pop(request_id, None)
        if done is not None:
            done(result)

    def _expire(self, request_id: int) -> None:
        done = self._pending.pop(request_id, None)
        if done is not None:
            done(("timeout",))


class SimNode:
    def __init__(self, sim, node_id: int, initial_voters: tuple[int, ...] | None) -> None:
        self.sim = sim
        self.params = sim.params
        self.node_id = node_id
        self.initial_voters = initial_voters  # None: joins an existing cluster
        self.rng = sim.derive_rng()
        self.disk = SimDisk(sim.derive_rng(), mutant=self.params.mutant)
        self.alive = False
        self.ever_started = False
        self.incarnation = 0
        self.generation = 0  # memory generation; new at every start and registration
        self.segment_bytes = sim.segment_bytes
        self.crashes = 0
        self.checked_term = 0  # the last term the checker saw this node lead
        self._reset_volatile()

    def _reset_volatile(self) -> None:
        self.core: RaftCore | None = None
        self.state: StateMachine | None = None
        self.master: SimMaster | None = None
        self.rpc = RpcClient(self.node_id, self.sim)
        self.memory: dict[tuple[int, int], tuple] = {}
        self.busy_until = 0
        self.inbox: deque[tuple[Callable, tuple]] = deque()
        self.boot_ns = 0
        self.rate = 1.0
        self.role = Role.FOLLOWER
        self.leader_id = 0
        self.applied_index = self.applied_term = self.snapshot_index = 0
        self.last_contact: dict[int, int] = {}
        self._proposals: dict[int, tuple[int, int, Callable]] = {}  # index -> (term, at, done)
        self._reads_unsent: list[Callable] = []
        self._reads_sent: dict[bytes, list[Callable]] = {}
        self._reads_waiting: list[tuple[int, Callable]] = []
        self._read_seq = 0
        self._soon: list[Callable[[], None]] = []
        self._processing = False
        self._persisting = False
        self._last_tick_ns = 0
        self.registered_term = -1
        self._registering = False
        self._register_again = False
        self._own_up_applied = False  # the NodeUp of this node's current generation applied
        self._fresh_generation = True
        self.since_check = 0

    # -- clocks -------------------------------------------------------------------------------

    def local_ns(self) -> int:
        """This node's monotonic clock: starts at boot, runs at its own (drifting) rate."""
        return int((self.sim.scheduler.now - self.boot_ns) * self.rate)

    def local_ms(self) -> int:
        return self.local_ns() // MS

    def trace(self, text: str) -> None:
        self.sim.trace(f"n{self.node_id} {text}")

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        params = self.params
        self._reset_volatile()
        self.alive = True
        self.ever_started = True
        self.incarnation += 1
        self.generation += 1
        self.boot_ns = self.sim.scheduler.now
        self.rate = 1.0 + self.rng.uniform(-params.drift, params.drift)
        hard_state, snapshot, entries = self.disk.recover()
        self.state = new_state(params)
        if snapshot is not None:
            self.state.restore(snapshot.data)
        fresh = snapshot is None and not entries and hard_state.term == 0
        self.core = RaftCore(
            RaftConfig(self.node_id, election_ticks=params.election_ticks,
                       heartbeat_ticks=params.heartbeat_ticks, read_only=params.read_mode),
            random.Random(self.rng.getrandbits(64)),
            hard_state=hard_state, snapshot=snapshot, entries=entries,
            conf_state=ConfState(self.initial_voters) if fresh and self.initial_voters else None)
        self.snapshot_index = self.applied_index = snapshot.meta.index if snapshot else 0
        self.applied_term = snapshot.meta.term if snapshot else 0
        self.master = SimMaster(self, store_config(params), seed=self.rng.getrandbits(32))
        self.trace(f"start #{self.incarnation} term={hard_state.term} vote={hard_state.vote} "
                   f"commit={hard_state.commit} snapshot={self.snapshot_index} "
                   f"entries={len(entries)} rate={self.rate:.4f}")
        self.sim.checker.node_started(self)
        self._schedule_tick()
        self._process()

    def crash(self) -> None:
        lost = self.disk.crash()
        self.trace(f"crash (lost {lost} unsynced records)")
        self.alive = False
        self.crashes += 1
        self._reset_volatile()

    def pause(self, duration_ns: int) -> None:
        self.trace(f"pause {duration_ns // MS} ms")
        self._busy(duration_ns)

    def unpause(self) -> None:
        if self.busy_until > self.sim.scheduler.now:
            self.busy_until = self.sim.scheduler.now
            self.sim.scheduler.after(0, self._wake, self.incarnation)

    def _busy(self, duration_ns: int) -> None:
        until = self.sim.scheduler.now + duration_ns
        if until > self.busy_until:
            self.busy_until = until
            self.sim.scheduler.at(until, self._wake, self.incarnation)

    def _wake(self, incarnation: int) -> None:
        if incarnation != self.incarnation or not self.alive:
            return
        while self.inbox and self.sim.scheduler.now >= self.busy_until and self.alive \
                and incarnation == self.incarnation:
            fn, args = self.inbox.popleft()
            fn(*args)

    def _run(self, fn: Callable, *args) -> None:
        """Run an event now, or queue it until the node is no longer busy."""
        if not self.alive:
            return
        if self.sim.scheduler.now < self.busy_until or self.inbox:
            self.inbox.append((fn, args))
            if self.sim.scheduler.now >= self.busy_until:
                self.sim.scheduler.after(0, self._wake, self.incarnation)
            return
        fn(*args)

    # -- ticks and messages -------------------------------------------------------------------

    def _schedule_tick(self) -> None:
        interval = int(self.params.tick_ms * MS / self.rate)
        self.sim.scheduler.after(interval, self._tick_due, self.incarnation)

    def _tick_due(self, incarnation: int) -> None:
        if incarnation == self.incarnation and self.alive:
            self._run(self._tick)

    def _tick(self) -> None:
        self._catch_up_ticks()
        self._expire_proposals()
        if self.core.role == Role.LEADER and self.role == Role.LEADER:
            self.master.run_duties()
        self._process()
        self._schedule_tick()

    def _catch_up_ticks(self) -> None:
        """Tick the core once per tick period of local time since the last tick, as the
        daemon does, so a node back from a pause sees its timeouts lapse at once."""
        period_ns = self.params.tick_ms * MS
        due = (self.local_ns() - self._last_tick_ns) // period_ns
        if due <= 0:
            return
        self._last_tick_ns += due * period_ns
        for _ in range(min(due, 4 * self.params.election_ticks)):
            self.core.tick()

    def receive(self, src: int, payload) -> None:
        if self.alive:
            self._run(self._handle, src, payload)

    def _handle(self, src: int, payload) -> None:
        if isinstance(payload, Message):
            self.last_contact[src] = self.local_ms()
            self.core.step(payload)
            self._process()
            return
        if payload[0] == "rep":
            self.rpc.on_reply(payload[1], payload[2])
        else:
            _, request_id, method, args = payload
            self._on_request(src, request_id, method, args)
        self._process()

    def soon(self, fn: Callable[[], None]) -> None:
        """Run after the current Ready pass (what asyncio's call_soon gives the daemon)."""
        self._soon.append(fn)

    # -- the Ready loop -----------------------------------------------------------------------

    def _process(self) -> None:
        if self._processing or not self.alive:
            return
        self._processing = True
        try:
            while True:
                self._process_once()
                if not self._soon:
                    break
                callbacks, self._soon = self._soon, []
                for fn in callbacks:
                    if self.alive:
                        fn()
                if not self.alive:
                    break
        finally:
            self._processing = False
        if self.alive:
            self.sim.checker.after_event(self)

    def _process_once(self) -> None:
        if self._reads_unsent:
            self._catch_up_ticks()
            self._submit_reads()
        if self._persisting:
            return  # the batch being synced comes first; this work joins the next one
        core, disk = self.core, self.disk
        while core.has_ready():
            ready = core.ready()
            if ready.soft_state is not None:
                self._soft_state(ready.soft_state.leader, ready.soft_state.role)
            # The daemon's leader sends before its own fdatasync; everyone else persists first.
            leader_sends_first = self.role == Role.LEADER and ready.snapshot is None
            if leader_sends_first:
                self._send_all(ready.messages)
            now = self.sim.scheduler.now
            if ready.snapshot is not None:
                disk.save_snapshot(ready.snapshot, now)
            if ready.entries or ready.hard_state is not None:
                voted = ready.hard_state is not None and ready.hard_state.vote not in (
                    0, self.node_id) and ready.hard_state.vote != disk.written.hard_state.vote
                disk.append(ready.entries, ready.hard_state, now)
                self.sim.checker.persisted(self, ready.entries)
                # fdatasync runs in the daemon's sync thread; the loop keeps serving meanwhile.
                self._persisting = True
                latency = int(self.params.fsync_ms * MS * 2 * self.rng.random())
                self.sim.scheduler.after(latency, self._persisted, self.incarnation, ready,
                                         leader_sends_first, voted)
                return
            self._finish(ready, leader_sends_first)
        self._after_batches()

    def _persisted(self, incarnation: int, ready, leader_sent_first: bool, voted: bool) -> None:
        if incarnation != self.incarnation or not self.alive:
            return  # crashed while syncing: the disk kept what it kept
        self._run(self._persisted_now, ready, leader_sent_first, voted)

    def _persisted_now(self, ready, leader_sent_first: bool, voted: bool) -> None:
        self.disk.sync(self.sim.scheduler.now)
        if ready.hard_state is not None:
            self.sim.checker.synced(self, ready.hard_state)
        self._persisting = False
        self._finish(ready, leader_sent_first)
        if voted:
            self.sim.vote_granted(self)  # the grant is on its way: a fault site
        self._after_batches()
        self._process()

    def _finish(self, ready, leader_sent_first: bool) -> None:
        """What follows persisting a Ready: send (if not yet), apply, reads, advance."""
        if not leader_sent_first:
            self._send_all(ready.messages)
        if ready.snapshot is not None:
            self._restore(ready.snapshot)
        for entry in ready.committed_entries:
            self._apply(entry)
        for read in ready.read_states:
            for waiter in self._reads_sent.pop(read.context, []):
                self._reads_waiting.append((read.index, waiter))
        self.core.advance(ready)

    def _after_batches(self) -> None:
        if self._reads_waiting:
            self._release_reads()
        snapshot_entries = self.params.snapshot_entries
        if snapshot_entries and self.applied_index - self.snapshot_index >= snapshot_entries:
            self._take_snapshot()

    def _send_all(self, messages) -> None:
        core = self.core
        for message in messages:
            if not self.sim.network.send_raft(self.node_id, message.to, message):
                core.report_unreachable(message.to)
            if message.snapshot is not None:
                core.report_snapshot(message.to, True)

    def _soft_state(self, leader: int, role: Role) -> None:
        changed = leader != self.leader_id or role != self.role
        was_leader = self.role == Role.LEADER
        self.leader_id, self.role = leader, role
        if not changed:
            return
        self.trace(f"{role.name.lower()} term={self.core.term} leader={leader}")
        if was_leader and role != Role.LEADER:
            self._fail_reads(MooncakedError(ErrorCode.NO_LEADER, "stopped being the leader"))
        if role == Role.LEADER:
            self.sim.checker.became_leader(self)
            self.master.become_leader()
            now = self.local_ms()
            for node_id in self.state.nodes:
                self.last_contact[node_id] = now
        if leader and self.registered_term < 0:
            self.soon(self._register)

    # -- applying -----------------------------------------------------------------------------

    def _apply(self, entry) -> None:
        waiter = None
        proposed = self._proposals.pop(entry.index, None)
        if proposed is not None:
            term, _, waiter = proposed
            if term != entry.term:
                self.soon(lambda w=waiter: w(MooncakedError(
                    ErrorCode.NO_LEADER, "another leader's entry took its index"), None))
                waiter = None
        self.sim.checker.applying(self, entry)
        before = None
        if entry.kind == EntryKind.CONF_CHANGE:
            change = raft_codec.decode_conf_change(entry.data)
            result = self.core.apply_conf_change(change)
            self.trace(f"apply {entry.index} {change.kind.name} {change.node_id} -> "
                       f"voters={result.voters} learners={result.learners}")
            command = None
        elif entry.data:
            command = command_codec.decode(entry.data)
            before = self._before(command)
            try:
                result = self.state.apply(command)
            except MooncakedError as exc:
                result = exc
            if isinstance(command, c.PutStart) and not isinstance(result, MooncakedError):
                # The generations the log shows now, with this placement; a later NodeUp in the
                # same batch must not lend the replicas a newer generation's.
                before = (before, [self.gen_of(c.node_of_segment(r.segment_id)) for r in result])
            self.sim.checker.applied_command(self, entry.index, command, result, before)
        else:
            command = result = None
        self.applied_index, self.applied_term = entry.index, entry.term
        if waiter is not None:
            self.soon(lambda: waiter(result, before))
        if command is not None:
            self._on_applied(command)
        self.since_check += 1
        self.sim.checker.applied(self, entry.index)

    def _before(self, command):
        """What a caller needs to know about the state just before its command applied (for a
        PutStart that succeeds, with the replicas' generations just after)."""
        if isinstance(command, c.PutStart):
            return self.state.readable(command.object_key) is not None
        if isinstance(command, c.PutEnd):
            # The version the PutEnd completes: the writer's pending one, or its preempted
            # upsert's (which may have been superseded by a later one: then it never shows).
            record = self.state.preempted.get(command.object_key, {}).get(command.writer_id)
            entry = self.state.objects.get(command.object_key)
            if entry is not None and entry.pending is not None \
                    and (record is None or entry.pending.writer_id == command.writer_id):
                pending = entry.pending
                return (pending.writer_id, pending.started_ms, pending.size_bytes)
            if record is not None:
                tag = (command.writer_id, record.started_ms, record.size_bytes)
                return ("superseded", tag) if record.superseded else tag
        return None

    def _on_applied(self, command) -> None:
        own_up = isinstance(command, c.NodeUp) and command.node_id == self.node_id
        if own_up and command.peer_address == self.peer_address():
            self._own_up_applied = True
        stale_up = (own_up and self._own_up_applied and "reregister" in self.params.fixes
                    and command.peer_address != self.peer_address())
        if stale_up and not self._registering:
            # A NodeUp of an earlier registration (a dead incarnation's, committed late) undid
            # ours: its segments are gone from the log (proposed fix; the daemon cannot tell,
            # its NodeUp carries no generation, and it stays unregistered until it restarts).
            self.trace("an older registration of this node was applied: registering again")
            self.registered_term = -1
            self.soon(self._register)
        elif stale_up:
            self._register_again = True
        if isinstance(command, c.NodeDown) and command.node_id == self.node_id:
            self.trace("declared down: registering again")
            self.registered_term = -1
            if self._registering and "reregister" in self.params.fixes:
                self._register_again = True
            self.soon(self._register)

    def _restore(self, snapshot: Snapshot) -> None:
        self.state.restore(snapshot.data)  # in place, as the daemon does
        self.snapshot_index = self.applied_index = snapshot.meta.index
        self.applied_term = snapshot.meta.term
        for index in [i for i in self._proposals if i <= snapshot.meta.index]:
            _, _, waiter = self._proposals.pop(index)
            self.soon(lambda w=waiter: w(MooncakedError(ErrorCode.OUTCOME_UNKNOWN,
                                                        "replaced by a snapshot"), None))
        self.trace(f"installed snapshot {snapshot.meta.index}")
        self.sim.checker.snapshot_installed(self, snapshot)
        own = [s for s in self.state.segments if c.node_of_segment(s) == self.node_id]
        if self.registered_term >= 0 and not own:
            self.registered_term = -1
            self.soon(self._register)

    def _take_snapshot(self) -> None:
        snapshot = Snapshot(SnapshotMeta(self.applied_index, self.applied_term,
                                         self.core.conf_state), self.state.snapshot())
        self.disk.save_snapshot(snapshot, self.sim.scheduler.now)
        self.core.compact(snapshot)
        self.snapshot_index = self.applied_index
        self.trace(f"compacted to {self.applied_index}")

    # -- proposals ----------------------------------------------------------------------------

    def propose(self, command, done: Callable) -> None:
        self._propose(lambda: self.core.propose(command_codec.encode(command)), done)

    def propose_conf_change_promote(self, node_id: int, done: Callable) -> None:
        self._propose(lambda: self.core.propose_conf_change(
            ConfChange(ConfChangeKind.PROMOTE, node_id)), done)

    def _propose(self, append: Callable[[], int], done: Callable) -> None:
        try:
            index = append()
        except (NotLeader, ProposalDropped) as exc:
            error = MooncakedError(ErrorCode.NO_LEADER, str(exc))
            self.soon(lambda: done(error, None))
            return
        self._proposals[index] = (self.core.term, self.local_ms(), done)
        self._process()

    def _expire_proposals(self) -> None:
        if not self._proposals or self.role == Role.LEADER:
            return
        deadline = self.local_ms() - self.params.rpc_timeout_ms
        for index, (_, at, waiter) in list(self._proposals.items()):
            if at < deadline:
                del self._proposals[index]
                self.soon(lambda w=waiter: w(MooncakedError(ErrorCode.OUTCOME_UNKNOWN,
                                                            "leadership changed"), None))

    # -- linearizable reads -------------------------------------------------------------------

    def read_barrier(self, done: Callable[[MooncakedError | None], None]) -> None:
        self._reads_unsent.append(done)
        self._process()

    def _submit_reads(self) -> None:
        waiters, self._reads_unsent = self._reads_unsent, []
        self._read_seq += 1
        context = self._read_seq.to_bytes(8, "little")
        try:
            self.core.read_index(context)
        except (NotLeader, ProposalDropped) as exc:
            error = MooncakedError(ErrorCode.NO_LEADER, str(exc))
            for waiter in waiters:
                self.soon(lambda w=waiter: w(error))
            return
        self._reads_sent[context] = waiters

    def _release_reads(self) -> None:
        still = []
        for index, waiter in self._reads_waiting:
            if index <= self.applied_index:
                self.soon(lambda w=waiter: w(None))
            else:
                still.append((index, waiter))
        self._reads_waiting = still

    def _fail_reads(self, error: MooncakedError) -> None:
        waiters = self._reads_unsent + [w for ws in self._reads_sent.values() for w in ws] \
            + [w for _, w in self._reads_waiting]
        self._reads_unsent, self._reads_sent, self._reads_waiting = [], {}, []
        for waiter in waiters:
            self.soon(lambda w=waiter: w(error))

    # -- registration (cluster/service.py) ----------------------------------------------------

    def peer_address(self) -> str:
        return f"sim-{self.node_id}/{self.generation}"

    def gen_of(self, node_id: int) -> int:
        """The memory generation this node's log shows for `node_id` (0: none registered)."""
        node = self.state.nodes.get(node_id)
        if node is None:
            return 0
        return int(node.peer_address.rsplit("/", 1)[1])

    def _register(self) -> None:
        if self._registering:
            return
        self._registering = True
        if not self._fresh_generation:
            # Every later registration gets a new generation: replicas the log placed on this
            # node before it are gone from the log, and requests still naming them are refused.
            self.generation += 1
        self._fresh_generation = False
        self._own_up_applied = False
        name = f"node{self.node_id}"
        commands = [c.NodeUp(self.node_id, name, f"client-{self.node_id}", self.peer_address()),
                    c.MountSegment(c.segment_id_of(self.node_id, 0), f"{name}/0", name,
                                   self.segment_bytes, SEGMENT_ALIGNMENT,
                                   SEGMENT_MAX_ALLOCATIONS)]
        incarnation = self.incarnation

        def done(result: tuple) -> None:
            if incarnation != self.incarnation:
                return
            self._registering = False
            if result[0] == "redirect":
                result = ("err", ErrorCode.NO_LEADER, None)
            if result[0] == "ok" and self._register_again:
                # Declared down while this registration was in flight (proposed fix; the
                # daemon's service.py forgets it and stays down until it restarts).
                self._register_again = False
                self.soon(self._register)
                return
            if result[0] == "ok":
                self.registered_term = self.core.term
                self.trace(f"registered generation {self.generation}")
                return
            self.sim.scheduler.after(2 * self.params.tick_ms * MS, self._retry_register,
                                     incarnation)

        leader = self.leader_id
        if leader == self.node_id:
            self._leader_register(commands, done)
        elif leader:
            self.rpc.call(leader, "register", (commands,), done, self.params.rpc_timeout_ms)
        else:
            done(("err", ErrorCode.NO_LEADER, None))

    def _retry_register(self, incarnation: int) -> None:
        if incarnation == self.incarnation and self.alive and self.registered_term < 0:
            self._run(self._register_and_process)

    def _register_and_process(self) -> None:
        self._register()
        self._process()

    def _leader_register(self, commands: list, reply: Callable[[tuple], None]) -> None:
        if not commands:
            reply(("ok", None))
            return

        def done(result, before) -> None:
            if isinstance(result, MooncakedError) and \
                    result.code != ErrorCode.SEGMENT_ALREADY_EXISTS:
                reply(("err", result.code, None))
                return
            rest = commands[1:]
            if isinstance(commands[0], c.NodeUp):  # mounted under the generation it got
                rest = [dataclasses.replace(x, segment_id=c.segment_id_of(
                    commands[0].node_id, c.slot_of_segment(x.segment_id), result))
                    for x in rest]
            self._leader_register(rest, reply)

        self.propose(commands[0], done)

    # -- requests from clients and peers ------------------------------------------------------

    def _on_request(self, src: int, request_id: int, method: str, args: tuple) -> None:
        incarnation = self.incarnation

        def reply(result: tuple) -> None:
            if self.alive and incarnation == self.incarnation:
                self.sim.network.send_rpc(self.node_id, src, ("rep", request_id, result))

        if method == "write_replica":
            reply(self._write_replica(*args))
        elif method == "read_replica":
            reply(self._read_replica(*args))
        elif self.role != Role.LEADER:
            reply(("redirect", self.leader_id))  # the daemon forwards; a client may as well
        elif method == "register":
            self._leader_register(list(args[0]), reply)
        else:
            getattr(self.master, method)(*args, reply)

    def _replica_refusal(self, segment_id: int, generation: int) -> tuple | None:
        if c.node_of_segment(segment_id) != self.node_id or segment_id not in self.state.segments:
            return ("err", ErrorCode.SEGMENT_NOT_FOUND, None)
        if "replica_generation" in self.params.fixes and generation != self.generation:
            return ("err", ErrorCode.SEGMENT_NOT_FOUND, None)
        return None

    def _write_replica(self, segment_id: int, offset: int, generation: int, tag: tuple,
                       value: int) -> tuple:
        refusal = self._replica_refusal(segment_id, generation)
        if refusal is not None:
            return refusal
        self.memory[(segment_id, offset)] = (tag, value)
        self.trace(f"write {segment_id}@{offset} v{value} {tag}")
        return ("ok", None)

    def _read_replica(self, segment_id: int, offset: int, generation: int) -> tuple:
        refusal = self._replica_refusal(segment_id, generation)
        if refusal is not None:
            return refusal
        return ("ok", self.memory.get((segment_id, offset)))
