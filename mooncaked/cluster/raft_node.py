"""The Raft driver: runs the pure core (raft/core.py) against the log on disk, the peers and the
state machine.

One pass of `_process` takes the core's Ready and does what its contract says, in order:
persist the hard state, snapshot and entries (one write and one fdatasync for the whole batch:
group commit), send the messages, apply the committed entries to the state machine, answer the
reads whose index is applied, and advance the core. Proposals made while a pass runs wait for
the next one, so under load every pass carries many; and the commands proposed since the last
pass go into the log as one entry (a Batch command when there are several), so one entry, not
one per command, is appended, replicated and applied for all of them, each with its own result.

A proposal resolves when its entry is applied here, with the state machine's result. If the
entry at its index turns out to be another one (a new leader overwrote it), it was never
applied: NO_LEADER. If it is neither applied nor overwritten within the RPC timeout (a leader
that lost its quorum), the outcome is unknown: OUTCOME_UNKNOWN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
from typing import Callable

from mooncaked import environment
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec as command_codec
from mooncaked.meta.commands import Batch
from mooncaked.raft import codec
from mooncaked.raft.core import RaftConfig, RaftCore
from mooncaked.raft.log_store import LogFailed, LogStore
from mooncaked.raft.types import (ConfChange, ConfState, EntryKind, HardState, NotLeader,
                                  ProposalDropped, Role, Snapshot, SnapshotMeta)

log = logging.getLogger(__name__)


class RaftNode:
    def __init__(self, node_id: int, state, store: LogStore, *, election_ticks: int,
                 heartbeat_ticks: int, tick_ms: int, read_mode: str, snapshot_entries: int,
                 max_pending_proposals: int, proposal_timeout_ms: int,
                 initial_voters: tuple[int, ...] | None,
                 send: Callable[[int, bytes], bool]) -> None:
        self.node_id = node_id
        self.state = state  # the metadata StateMachine
        self.store = store
        self.tick_ms = tick_ms
        self._max_catch_up_ticks = 4 * election_ticks  # enough to lapse any timeout
        self._last_tick_ns = 0
        self.snapshot_entries = snapshot_entries
        self.max_pending_proposals = max_pending_proposals
        self.proposal_timeout_ms = proposal_timeout_ms
        self._send = send
        recovered = store.open()
        if recovered.truncated_bytes:
            log.warning("cut a torn tail of %d bytes off the Raft log",
                        recovered.truncated_bytes)
        if recovered.snapshot is not None:
            state.restore(recovered.snapshot.data)
        fresh = (recovered.snapshot is None and not recovered.entries
                 and recovered.hard_state.term == 0)
        self.core = RaftCore(
            RaftConfig(node_id, election_ticks=election_ticks, heartbeat_ticks=heartbeat_ticks,
                       read_only=read_mode, max_uncommitted_entries=max_pending_proposals,
                       # _process writes a Ready's entries before it applies anything; with
                       # no fdatasync to wait for, that write is all the durability there is.
                       entries_durable_when_written=store.fsync != "batch"),
            random.Random(node_id * 7919 + environment.monotonic_ns()),
            hard_state=recovered.hard_state, snapshot=recovered.snapshot,
            entries=recovered.entries,
            conf_state=ConfState(initial_voters) if fresh and initial_voters else None)
        self.snapshot_index = recovered.snapshot.meta.index if recovered.snapshot else 0
        self.applied_index = self.snapshot_index
        self.applied_term = recovered.snapshot.meta.term if recovered.snapshot else 0
        # index -> (term, future, monotonic s proposed) of proposals made here and not yet
        # applied or dropped.
        self._proposals: dict[int, tuple[int, list[asyncio.Future], float]] = {}
        # Commands proposed since the last pass, encoded and as decoding makes them, with
        # their waiters: the next pass appends them as one entry.
        self._batch: list[tuple[bytes, object, asyncio.Future]] = []
        # index -> the command proposed here at that index, as every node decodes it: applied
        # as it is when the entry at the index is still this node's proposal (same term), so
        # that a leader does not decode what it has just encoded.
        self._proposed_commands: dict[int, object] = {}
        self._reads_unsent: list[asyncio.Future] = []
        self._reads_sent: dict[bytes, list[asyncio.Future]] = {}
        self._reads_waiting_apply: list[tuple[int, asyncio.Future]] = []
        self._read_seq = 0
        self._scheduled = False
        self._persisting: asyncio.Future | None = None  # the fdatasync of the current batch
        self._synced_vote = (recovered.hard_state.term, recovered.hard_state.vote)
        # The term and vote last written, and a hard state that moved only the commit index
        # and is not written yet: it is written with the next entries (or term or vote).
        self._written_vote = self._synced_vote
        self._unwritten_hard_state: HardState | None = None
        self._sync_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="raft-sync")
        self.fatal: Callable[[BaseException], None] = lambda error: None
        # Set when the node cannot go on without diverging from its peers (an entry it cannot
        # apply, a log it cannot sync): from then on it does nothing (fail-stop).
        self.halted: BaseException | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.leader_id = 0
        self.role = Role.FOLLOWER
        self.last_contact: dict[int, float] = {}  # peer -> monotonic s of its last message
        # Hooks the cluster service sets.
        self.on_applied: Callable[[int, object, object], None] = lambda i, c, r: None
        self.on_conf_change: Callable[[ConfChange, ConfState], None] = lambda cc, cs: None
        self.on_role_change: Callable[[Role, int, int], None] = lambda r, l, t: None
        self.on_snapshot_restored: Callable[[], None] = lambda: None
        self.stats = {"proposals": 0, "batched_proposals": 0, "passes": 0, "entries_applied": 0, "snapshots": 0,
                      "messages_sent": 0, "messages_dropped": 0, "elections_seen": 0}

    # -- running ----------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._last_tick_ns = environment.monotonic_ns()
        self._ticker = self._loop.call_later(self.tick_ms / 1000, self._tick)
        self._schedule()

    def _catch_up_ticks(self) -> None:
        """Tick the core once per tick period elapsed since the last tick.

        Timers run late when the process is paused (SIGSTOP, a stall, an overloaded CPU).
        Counting elapsed time rather than timer callbacks makes a leader that was paused past
        its election timeout see that at once: its check-quorum lease has lapsed, so it serves
        no read on the strength of acknowledgements older than the timeout.
        """
        now_ns = environment.monotonic_ns()
        period_ns = self.tick_ms * 1_000_000
        due = (now_ns - self._last_tick_ns) // period_ns
        if due <= 0:
            return
        self._last_tick_ns += due * period_ns
        for _ in range(min(due, self._max_catch_up_ticks)):
            self.core.tick()

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        error = MooncakedError(ErrorCode.SHUTTING_DOWN, "the node is stopping")
        self._fail_all(error)
        self._sync_thread.shutdown(wait=True)
        self.store.close()

    def stop_ticking(self) -> None:
        """For a node removed from the cluster: no more election timeouts, so it never
        campaigns again; messages it still receives are handled."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _tick(self) -> None:
        if self.halted is not None:
            return
        self._catch_up_ticks()
        self._expire_proposals()
        self._schedule()
        self._ticker = self._loop.call_later(self.tick_ms / 1000, self._tick)

    def step(self, data: bytes) -> None:
        if self.halted is not None:
            return
        try:
            message = codec.decode_message(data)
        except ValueError as exc:
            log.warning("dropped a malformed Raft message: %s", exc)
            return
        if message.to != self.node_id:
            return
        self.last_contact[message.from_] = environment.monotonic()
        self.core.step(message)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._process)

    def _process(self) -> None:
        self._scheduled = False
        if self.halted is not None:
            return
        if self._reads_unsent:
            self._catch_up_ticks()
            self._submit_reads()
        if self._persisting is not None:
            return  # the batch being synced comes first; this work joins the next one
        if self._batch:
            self._append_batch()
        core = self.core
        while core.has_ready():
            ready = core.ready()
            self.stats["passes"] += 1
            if ready.soft_state is not None:
                self._soft_state(ready.soft_state.leader, ready.soft_state.role)
            # A leader sends before its own fdatasync, so its disk and its followers' work at
            # the same time: its own entries count toward the quorum only at advance(), after
            # they are durable, and its term and vote were made durable when it campaigned.
            # Everyone else persists first (votes and acknowledgements promise durable state).
            leader_sends_first = self.role == Role.LEADER and ready.snapshot is None
            if leader_sends_first and ready.messages:
                self._send_all(ready.messages)
            hard_state = self._hard_state_to_write(ready)
            try:
                if ready.snapshot is not None:
                    self.store.save_snapshot(ready.snapshot)
                if ready.entries or hard_state is not None:
                    self.store.append(ready.entries, hard_state)
            except (OSError, LogFailed) as exc:
                # What the disk holds is unknown (a partial record, a full disk): acting on it
                # could acknowledge what a restart loses (fail-stop, as for a failed sync).
                self._halt(exc, "the Raft log could not be written")
                return
            if ready.entries or ready.hard_state is not None:
                if self.store.fsync == "batch" and self._needs_sync(ready):
                    # fdatasync in the sync thread: meanwhile the loop keeps serving (reads,
                    # replica bytes, heartbeats) and gathers the next batch's proposals.
                    self._persisting = self._loop.run_in_executor(self._sync_thread,
                                                                  self.store.sync)
                    self._persisting.add_done_callback(
                        lambda done, ready=ready, first=leader_sends_first:
                        self._persisted(done, ready, first))
                    return
            self._finish(ready, leader_sends_first)
            if self.halted is not None:
                return
        self._after_batches()

    def _hard_state_to_write(self, ready) -> HardState | None:
        """The hard state to write with this Ready's entries, if any. One that moves only the
        commit index waits for the next entries: the commit index need not be durable (a
        restarted node learns it again from a leader, or commits its log again as leader),
        so it is not worth a write of its own."""
        hard_state = ready.hard_state
        if hard_state is None:
            hard_state = self._unwritten_hard_state
            if hard_state is None or not ready.entries:
                return None
        elif not ready.entries and ready.snapshot is None \
                and (hard_state.term, hard_state.vote) == self._written_vote:
            self._unwritten_hard_state = hard_state
            return None
        self._unwritten_hard_state = None
        self._written_vote = (hard_state.term, hard_state.vote)
        return hard_state

    def _needs_sync(self, ready) -> bool:
        """Entries, term and vote must be durable before anything depends on them; the
        commit index need not be (a restarted node learns it again from the leader), so a
        batch that only moves it is written but not synced."""
        hard_state = ready.hard_state
        if hard_state is not None:
            vote = (hard_state.term, hard_state.vote)
            if vote != self._synced_vote:
                self._synced_vote = vote
                return True
        return bool(ready.entries)

    def _persisted(self, done: asyncio.Future, ready, leader_sent_first: bool) -> None:
        self._persisting = None
        error = done.exception()
        if error is not None:
            # The log cannot be made durable: stop acting on it rather than acknowledge
            # what a crash could lose (fail-stop, as the log's users expect).
            self._halt(error, "the Raft log could not be synced")
            return
        self._finish(ready, leader_sent_first)
        if self.halted is not None:
            return
        self._after_batches()
        self._schedule()

    def _finish(self, ready, leader_sent_first: bool) -> None:
        """What follows persisting a Ready: send (if not yet), apply, reads, advance."""
        if not leader_sent_first and ready.messages:
            self._send_all(ready.messages)
        if ready.snapshot is not None:
            self._restore(ready.snapshot)
        for entry in ready.committed_entries:
            try:
                self._apply(entry)
            except Exception as error:
                # Every node applies the same entries in the same order; one that skips an
                # entry (or the rest of a batch) holds another state from then on. Stop here,
                # without advancing, rather than serve a state no other node has.
                self._halt(error, f"entry {entry.index} (term {entry.term}) could not be "
                           "applied")
                return
        for read in ready.read_states:
            waiters = self._reads_sent.pop(read.context, [])
            for waiter in waiters:
                self._reads_waiting_apply.append((read.index, waiter))
        self.core.advance(ready)

    def _after_batches(self) -> None:
        if self._reads_waiting_apply:
            self._release_reads()
        if self.applied_index - self.snapshot_index >= self.snapshot_entries:
            self._take_snapshot()

    def _send_all(self, messages) -> None:
        core = self.core
        for message in messages:
            if self._send(message.to, codec.encode_message(message)):
                self.stats["messages_sent"] += 1
            else:
                self.stats["messages_dropped"] += 1
                core.report_unreachable(message.to)
            if message.snapshot is not None:
                core.report_snapshot(message.to, True)

    def _soft_state(self, leader: int, role: Role) -> None:
        changed = leader != self.leader_id or role != self.role
        was_leader = self.role == Role.LEADER
        self.leader_id, self.role = leader, role
        if changed:
            self.stats["elections_seen"] += leader != 0
            log.info("node %d: %s, leader %s, term %d", self.node_id, role.name.lower(),
                     leader or "unknown", self.core.term)
            if was_leader and role != Role.LEADER:
                error = MooncakedError(ErrorCode.NO_LEADER, "this node stopped being the leader")
                self._fail_reads(error)
            self.on_role_change(role, leader, self.core.term)

    # -- applying ---------------------------------------------------------------------------

    def _apply(self, entry) -> None:
        waiters = None
        proposed_command = self._proposed_commands.pop(entry.index, None)
        # Left in _proposals until applied: if applying fails, _halt fails them with the rest.
        proposed = self._proposals.get(entry.index)
        if proposed is not None:
            term, waiters, _ = proposed
            if term != entry.term:  # another leader's entry took this index: ours is gone
                del self._proposals[entry.index]
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(MooncakedError(
                            ErrorCode.NO_LEADER, "leadership changed before the request was "
                            "committed; it was not applied"))
                waiters = None
        if entry.kind == EntryKind.CONF_CHANGE:
            change = codec.decode_conf_change(entry.data)
            conf_state = self.core.apply_conf_change(change)
            self.on_conf_change(change, conf_state)
            result = conf_state
            command = change
        elif entry.data:
            # Ours (same index and term: the same entry): applied as proposed, which is what
            # decoding its bytes gives (codec.encode_checked).
            command = proposed_command if waiters is not None and proposed_command is not None \
                else command_codec.decode(entry.data)
            try:
                result = self.state.apply(command)
            except MooncakedError as exc:
                result = exc
        else:
            command = result = None  # a new leader's no-op
        self.applied_index = entry.index
        self.applied_term = entry.term
        self.stats["entries_applied"] += 1
        batched = type(command) is Batch
        if waiters is not None:
            del self._proposals[entry.index]
            for waiter, one in zip(waiters, result if batched else (result,)):
                if not waiter.done():
                    if isinstance(one, MooncakedError):
                        waiter.set_exception(one)
                    else:
                        waiter.set_result(one)
        if batched:
            for one_command, one in zip(command.commands, result):
                self.on_applied(entry.index, one_command, one)
        elif command is not None:
            self.on_applied(entry.index, command, result)

    def _halt(self, error: BaseException, reason: str) -> None:
        log.critical("node %d: %s: %s: %s; stopping", self.node_id, reason,
                     type(error).__name__, error, exc_info=error)
        self.halted = error
        if self._ticker is not None:
            self._ticker.cancel()
        self._fail_all(MooncakedError(ErrorCode.INTERNAL_ERROR,
                                      f"this node stopped: {reason}"))
        self.fatal(error)

    def _restore(self, snapshot: Snapshot) -> None:
        self.state.restore(snapshot.data)
        self.snapshot_index = self.applied_index = snapshot.meta.index
        self.applied_term = snapshot.meta.term
        for index in [i for i in self._proposed_commands if i <= snapshot.meta.index]:
            del self._proposed_commands[index]
        for index in [i for i in self._proposals if i <= snapshot.meta.index]:
            _, waiters, _ = self._proposals.pop(index)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(MooncakedError(
                        ErrorCode.OUTCOME_UNKNOWN,
                        "replaced by a snapshot before it was applied"))
        log.info("node %d: installed a snapshot at index %d", self.node_id, snapshot.meta.index)
        self.on_snapshot_restored()

    def _take_snapshot(self) -> None:
        snapshot = Snapshot(SnapshotMeta(self.applied_index, self.applied_term,
                                         self.core.conf_state), self.state.snapshot())
        try:
            self.store.save_snapshot(snapshot)
        except (OSError, LogFailed) as exc:
            self._halt(exc, "a snapshot of the state could not be written")
            return
        self.core.compact(snapshot)
        self.snapshot_index = self.applied_index
        self.stats["snapshots"] += 1

    # -- proposals --------------------------------------------------------------------------

    def propose(self, command) -> asyncio.Future:
        """Append a command to the log; the future gives the state machine's result.

        The command joins the entry the next pass appends (see the module's docstring)."""
        waiter = self._loop.create_future()
        if isinstance(command, Batch):
            # Proposals are batched here: one inside another's entry would be a Batch in a
            # Batch, which no node decodes.
            waiter.set_exception(MooncakedError(ErrorCode.INVALID_PARAMS,
                                                "a Batch is made by the log, not proposed"))
            return waiter
        try:
            data, checked = command_codec.encode_checked(command)
        except ValueError as exc:  # refused here: what no node could decode is never logged
            waiter.set_exception(MooncakedError(ErrorCode.INVALID_PARAMS, str(exc)))
            return waiter
        if self._refused(waiter, len(self._batch)):
            return waiter
        self._batch.append((data, checked, waiter))
        self.stats["proposals"] += 1
        self._schedule()
        return waiter

    def _append_batch(self) -> None:
        batch, self._batch = self._batch, []
        if len(batch) == 1:
            data, command = batch[0][0], batch[0][1]
        else:
            data = command_codec.encode_batch([data for data, _, _ in batch])
            command = Batch(tuple(checked for _, checked, _ in batch))
            self.stats["batched_proposals"] += len(batch)
        self._append(lambda: self.core.propose(data), [waiter for _, _, waiter in batch],
                     command)

    def propose_conf_change(self, change: ConfChange) -> asyncio.Future:
        waiter = self._loop.create_future()
        if not self._refused(waiter, 0):
            self._append(lambda: self.core.propose_conf_change(change), [waiter])
            self.stats["proposals"] += 1
            self._schedule()
        return waiter

    def _refused(self, waiter: asyncio.Future, queued: int) -> bool:
        if self.halted is not None:
            waiter.set_exception(MooncakedError(ErrorCode.INTERNAL_ERROR, "this node stopped"))
            return True
        if len(self._proposals) + queued >= self.max_pending_proposals:
            waiter.set_exception(MooncakedError(ErrorCode.BUSY, "too many proposals pending"))
            return True
        return False

    def _append(self, append: Callable[[], int], waiters: list[asyncio.Future],
                command=None) -> None:
        try:
            index = append()
        except (NotLeader, ProposalDropped) as exc:
            if isinstance(exc, NotLeader):
                error = MooncakedError(ErrorCode.NO_LEADER, f"this node is not the leader "
                                       f"(leader: {exc.leader or 'unknown'})")
            else:
                error = MooncakedError(ErrorCode.NO_LEADER, f"not accepted: {exc}")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        self._proposals[index] = (self.core.term, waiters, environment.monotonic())
        if command is not None:
            self._proposed_commands[index] = command

    def _expire_proposals(self) -> None:
        if not self._proposals or self.role == Role.LEADER:
            return
        deadline = environment.monotonic() - self.proposal_timeout_ms / 1000
        for index, (_, waiters, proposed_at) in list(self._proposals.items()):
            if proposed_at < deadline:
                del self._proposals[index]
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(MooncakedError(
                            ErrorCode.OUTCOME_UNKNOWN, "leadership changed while the request "
                            "was in the log; it may or may not take effect"))

    def _fail_all(self, error: MooncakedError) -> None:
        proposals, self._proposals = self._proposals, {}
        batch, self._batch = self._batch, []
        self._proposed_commands = {}
        waiters = [w for _, ws, _ in proposals.values() for w in ws] + [w for _, _, w in batch]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._fail_reads(error)

    # -- linearizable reads -----------------------------------------------------------------

    def read_barrier(self) -> asyncio.Future:
        """Resolves once this leader may answer a read linearizably (read index or lease)."""
        waiter = self._loop.create_future()
        if self.halted is not None:
            waiter.set_exception(MooncakedError(ErrorCode.INTERNAL_ERROR, "this node stopped"))
            return waiter
        self._reads_unsent.append(waiter)
        self._schedule()
        return waiter

    def leads_now(self) -> bool:
        """Whether this node is the leader, sure of it without a round (alone, or within its
        check-quorum lease); else read_barrier confirms it."""
        if self.halted is not None:
            return False
        self._catch_up_ticks()
        return self.core.serves_reads_now()

    def _submit_reads(self) -> None:
        # Only reads that arrived before this call share its index: a read that arrives later
        # may follow a write acknowledged after the index was taken.
        waiters, self._reads_unsent = self._reads_unsent, []
        self._read_seq += 1
        context = self._read_seq.to_bytes(8, "little")
        try:
            self.core.read_index(context)
        except NotLeader as exc:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(MooncakedError(
                        ErrorCode.NO_LEADER, f"not the leader (leader: {exc.leader or '?'})"))
            return
        self._reads_sent[context] = waiters

    def _release_reads(self) -> None:
        still = []
        for index, waiter in self._reads_waiting_apply:
            if index <= self.applied_index:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                still.append((index, waiter))
        self._reads_waiting_apply = still

    def _fail_reads(self, error: MooncakedError) -> None:
        waiters = self._reads_unsent + [w for ws in self._reads_sent.values() for w in ws] \
            + [w for _, w in self._reads_waiting_apply]
        self._reads_unsent, self._reads_sent, self._reads_waiting_apply = [], {}, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)

    # -- administration ---------------------------------------------------------------------

    def transfer_leader(self, target: int) -> None:
        try:
            self.core.transfer_leader(target)
        except NotLeader as exc:
            raise MooncakedError(ErrorCode.NO_LEADER,
                                 f"not the leader (leader: {exc.leader or '?'})") from None
        self._schedule()

    def status(self) -> dict:
        status = dict(self.core.status())
        status.update(applied=self.applied_index, snapshot_index=self.snapshot_index,
                      pending_proposals=len(self._proposals) + len(self._batch),
                      **self.stats)
        return status
