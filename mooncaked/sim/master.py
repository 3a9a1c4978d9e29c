"""The leader's side of a simulated node: cluster/master.py's rules, driven by callbacks.

`SimMaster` subclasses the daemon's `ReplicatedMaster` so that its pure parts run unchanged
(the lease floor of a new leader, lease ends, what eviction picks, when an expiry sweep is due).
What the daemon does with asyncio futures (propose, wait for the apply, then answer) is written
here again with callbacks on the simulated Raft node, in the same order and with the same
commands. Time is the simulated node's local clock, continued from the log's cluster clock.

A request's `reply` gets ("ok", value) or ("err", code, info).
"""

from __future__ import annotations

from typing import Callable

from mooncaked.cluster.master import ReplicatedMaster
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.master import Master

Reply = Callable[[tuple], None]


def error_reply(error: MooncakedError, info=None) -> tuple:
    return ("err", error.code, info)


class SimMaster(ReplicatedMaster):
    def __init__(self, node, store_config, seed: int) -> None:
        super().__init__(node.state, store_config, raft=None, seed=seed)
        self.node = node
        self._ending_index: dict[c.ObjectKey, int] = {}  # key -> proposal that may end it
        self._settle_waiters: dict[c.ObjectKey, list[Callable[[], None]]] = {}
        self.duties_running = False
        self.leader_since_ms = 0

    # -- time and leadership (ReplicatedMaster's, on the simulated clock) --------------------

    def now_ms(self) -> int:
        return self.node.local_ms() + self.clock_offset_ms

    def become_leader(self) -> None:
        self.clock_offset_ms = self.state.clock_ms - self.node.local_ms()
        now = self.now_ms()
        self.lease_floor_ms = now + self.lease_ttl_ms
        self.access = {key: self.lease_floor_ms for key, entry in self.state.objects.items()
                       if entry.complete is not None}
        self.leader_since_ms = self.node.local_ms()

    # -- proposals ----------------------------------------------------------------------------

    def _propose(self, command, done: Callable, ending: c.ObjectKey | None = None) -> None:
        """Propose; `done(result, before)` with result the apply result or a MooncakedError."""
        if ending is None:
            self.node.propose(command, done)
            return
        token = object()
        self._ending_index[ending] = token

        def settled(result, before) -> None:
            if self._ending_index.get(ending) is token:
                del self._ending_index[ending]
                for waiter in self._settle_waiters.pop(ending, []):
                    self.node.soon(waiter)
            done(result, before)

        self.node.propose(command, settled)

    def _when_settled(self, key: c.ObjectKey, then: Callable[[], None]) -> None:
        if key in self._ending_index:
            self._settle_waiters.setdefault(key, []).append(lambda: self._when_settled(key, then))
        else:
            then()

    # -- client requests ------------------------------------------------------------------------

    def put_start(self, key, size_bytes: int, replica_num: int, upsert: bool, writer_id: int,
                  reply: Reply) -> None:
        command = c.PutStart(key, size_bytes, replica_num, (), None, False, upsert, writer_id,
                             self.now_ms(), self._rng.getrandbits(32))

        def first(result, before) -> None:
            if isinstance(result, MooncakedError) and result.code == ErrorCode.NO_AVAILABLE_HANDLE:
                self.evict_then(self.now_ms(), size_bytes * replica_num, 1,
                                lambda: self._propose(command, answer),
                                lambda error: reply(error_reply(error)))
                return
            answer(result, before)

        def answer(result, before) -> None:
            if isinstance(result, MooncakedError):
                reply(error_reply(result, before))
                return
            _, generations = before
            reply(("ok", (command.now_ms, [(r.segment_id, r.offset, generation)
                                           for r, generation in zip(result, generations)])))

        self._propose(command, first)

    def put_end(self, key, writer_id: int, reply: Reply) -> None:
        now = self.now_ms()

        def done(result, before) -> None:
            if isinstance(result, MooncakedError):
                reply(error_reply(result))
                return
            self.access.pop(key, None)
            self.access[key] = now
            reply(("ok", None))

        self._propose(c.PutEnd(key, writer_id, now, max(now, self.lease_end_ms(key))), done,
                      ending=key)

    def put_revoke(self, key, writer_id: int, reply: Reply) -> None:
        self._propose(c.PutRevoke(key, writer_id), lambda result, before: reply(
            error_reply(result) if isinstance(result, MooncakedError) else ("ok", None)))

    def remove(self, key, reply: Reply) -> None:
        """A forced remove: hidden now, its bytes kept until the key's lease ends."""
        now = self.now_ms()

        def done(result, before) -> None:
            if isinstance(result, MooncakedError):
                reply(error_reply(result))
                return
            reply(("ok", None))

        self._propose(c.Remove(key, max(now, self.lease_end_ms(key))), done, ending=key)
        self.access.pop(key, None)

    def read(self, key, reply: Reply) -> None:
        """A linearizable read: wait for commands that may end the key's version, then a read
        barrier, then lease the readable version and describe it."""
        def barrier_passed(error: MooncakedError | None) -> None:
            if error is not None:
                reply(error_reply(error))
                return
            if "lease_after_barrier" in self.node.params.fixes and key in self._ending_index:
                # A command that may end this version entered the log during the barrier; its
                # free deadline did not count this lease (proposed fix; the daemon's
                # ReplicatedMaster.read leases it anyway, and an Evict frees it at once).
                self._when_settled(key, lambda: self.node.read_barrier(barrier_passed))
                return
            now = self.now_ms()
            version = Master.get(self, key, now)
            self.node.trace(f"serve read {key[1]} at {now}: " + (
                "none" if version is None else f"version ({version.writer_id}, "
                f"{version.started_ms}, {version.size_bytes}) leased to {self.access[key]}"))
            self.node.sim.checker.read_served(self.node, key, version)
            if version is None:
                reply(("ok", None))
                return
            replicas = [(r.segment_id, r.offset, self.node.gen_of(c.node_of_segment(r.segment_id)))
                        for r in version.replicas]
            reply(("ok", ((version.writer_id, version.started_ms, version.size_bytes),
                          replicas)))

        self._when_settled(key, lambda: self.node.read_barrier(barrier_passed))

    # -- eviction and the leader's duties (cluster/service.py) --------------------------------

    def evict_then(self, now_ms: int, need_bytes: int, need_objects: int,
                   then: Callable[[], None], fail: Callable[[MooncakedError], None]) -> None:
        if now_ms < self.lease_floor_ms:
            then()
            return
        chosen = self.choose_evictions(now_ms, need_bytes, need_objects)
        if not chosen:
            then()
            return
        token = object()
        for key in chosen:
            self._ending_index[key] = token
            self.access.pop(key, None)

        def done(result, before) -> None:
            for key in chosen:
                if self._ending_index.get(key) is token:
                    del self._ending_index[key]
                    for waiter in self._settle_waiters.pop(key, []):
                        self.node.soon(waiter)
            if isinstance(result, MooncakedError):
                fail(result)  # the daemon's evict raises here: the caller's chain stops
                return
            self.evictions.runs += 1
            self.evictions.objects += len(chosen)
            then()

        self.node.propose(c.Evict(tuple(chosen)), done)

    def run_duties(self) -> None:
        """Declare silent nodes down, promote caught-up learners, sweep; one run at a time,
        stopping at the first failed proposal (as the daemon's _leader_duties does)."""
        if self.duties_running:
            return
        self.duties_running = True
        node = self.node
        members = set(node.core.conf_state.voters) | set(node.core.conf_state.learners)
        now_local = node.local_ms()
        commands = []
        for other in list(self.state.nodes.values()):
            if not other.up or other.node_id == node.node_id:
                continue
            last = node.last_contact.get(other.node_id, self.leader_since_ms)
            if now_local - last > node.params.node_ttl_ms or other.node_id not in members:
                commands.append(c.NodeDown(other.node_id))
        self._propose_each(commands, self._promote_learners)

    def _propose_each(self, commands: list, then: Callable[[], None]) -> None:
        if not commands:
            then()
            return

        def done(result, before) -> None:
            if isinstance(result, MooncakedError):
                self._finish_duties()
                return
            self._propose_each(commands[1:], then)

        self.node.propose(commands[0], done)

    def _promote_learners(self) -> None:
        core = self.node.core
        progress = core.status().get("progress", {})
        for learner in core.conf_state.learners:
            if progress.get(learner, {}).get("match", 0) >= core.commit_index:
                self.node.propose_conf_change_promote(learner, lambda result, before:
                                                      self._finish_duties())
                return
        self._sweep()

    def _sweep(self) -> None:
        now = self.now_ms()
        if self.state.expiry_due(now):
            def swept(result, before) -> None:
                if isinstance(result, MooncakedError):
                    self._finish_duties()
                    return
                self.evict_then(now, 0, 0, self._finish_duties, self._finish_duties_error)
            self.node.propose(c.ReleaseExpired(now), swept)
            return
        self.evict_then(now, 0, 0, self._finish_duties, self._finish_duties_error)

    def _finish_duties(self) -> None:
        self.duties_running = False

    def _finish_duties_error(self, error: MooncakedError) -> None:
        self.duties_running = False
