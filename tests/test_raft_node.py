"""cluster/raft_node.py on its own: one voter, a real log in a temp dir, a fake state machine.

Applying is fail-stop: an entry the state machine cannot apply stops the node where it is.
"""

import asyncio

import pytest

from mooncaked.cluster.raft_node import RaftNode
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands
from mooncaked.raft.log_store import LogStore
from mooncaked.raft.types import Role


class RecordingState:
    """Applies NodeUp commands by recording their names; a name starting "bug" raises the
    kind of exception a decoding slip or a bug would."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    def apply(self, command):
        if type(command) is commands.Batch:  # as StateMachine applies one
            results = []
            for one in command.commands:
                try:
                    results.append(self.apply(one))
                except MooncakedError as exc:
                    results.append(exc)
            return results
        if command.name.startswith("bug"):
            raise ValueError(f"cannot apply {command.name}")
        if command.name.startswith("refused"):
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "refused by the state machine")
        self.applied.append(command.name)
        return len(self.applied)

    def snapshot(self) -> bytes:
        return b""

    def restore(self, data: bytes) -> None:
        pass


def _node_up(name: str) -> commands.NodeUp:
    return commands.NodeUp(1, name, "127.0.0.1:1", "127.0.0.1:2")


async def _leader(tmp_path, state) -> RaftNode:
    node = RaftNode(1, state, LogStore(str(tmp_path), fsync="none"), election_ticks=2,
                    heartbeat_ticks=1, tick_ms=5, read_mode="safe", snapshot_entries=10_000,
                    max_pending_proposals=100, proposal_timeout_ms=1000, initial_voters=(1,),
                    send=lambda to, data: True)
    node.start()
    for _ in range(400):
        if node.role == Role.LEADER:
            return node
        await asyncio.sleep(0.005)
    node.stop()
    raise AssertionError("a single voter did not become leader")


def test_a_refused_command_is_an_answer_not_a_failure(tmp_path):
    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        try:
            with pytest.raises(MooncakedError) as refused:
                await node.propose(_node_up("refused-1"))
            assert refused.value.code == ErrorCode.INVALID_PARAMS
            assert await node.propose(_node_up("a")) == 1
            assert node.halted is None
        finally:
            node.stop()
    asyncio.run(scenario())


def test_an_entry_that_cannot_be_applied_stops_the_node(tmp_path):
    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        fatal: list[BaseException] = []
        node.fatal = fatal.append
        unhandled: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        try:
            assert await node.propose(_node_up("first")) == 1
            applied_before = node.applied_index
            # Three proposals in one entry (a Batch): the middle one breaks the state machine.
            waiters = [node.propose(_node_up(name)) for name in ("second", "bug", "third")]
            # Bounded only so that a node that loses a waiter fails rather than hangs.
            results = await asyncio.wait_for(
                asyncio.gather(*waiters, return_exceptions=True), 30)
            # The entry was never applied to its end: none of its commands is answered, and
            # the node stopped before the third (its in-memory state is dropped with it).
            for result in results:
                assert isinstance(result, MooncakedError)
                assert result.code == ErrorCode.INTERNAL_ERROR
            assert state.applied == ["first", "second"]
            assert node.applied_index == applied_before
            assert len(fatal) == 1 and isinstance(fatal[0], ValueError)
            assert node.halted is fatal[0]
            assert unhandled == []  # handled where it happened, not by the loop's handler
            # Halted: it takes nothing more and applies nothing more.
            with pytest.raises(MooncakedError):
                await node.propose(_node_up("later"))
            with pytest.raises(MooncakedError):
                await node.read_barrier()
            await asyncio.sleep(0.05)
            assert state.applied == ["first", "second"]
        finally:
            node.stop()
    asyncio.run(scenario())


def test_commands_proposed_together_share_one_entry_each_with_its_own_result(tmp_path):
    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        try:
            assert await node.propose(_node_up("first")) == 1
            index_before = node.core.last_index
            waiters = [node.propose(_node_up(name))
                       for name in ("a", "refused-b", "c", "d")]
            results = await asyncio.wait_for(
                asyncio.gather(*waiters, return_exceptions=True), 30)
            assert results[0] == 2 and results[2] == 3 and results[3] == 4
            assert isinstance(results[1], MooncakedError)
            assert results[1].code == ErrorCode.INVALID_PARAMS
            assert node.core.last_index == index_before + 1  # one entry for the four
            assert node.stats["batched_proposals"] == 4
            assert state.applied == ["first", "a", "c", "d"]
        finally:
            node.stop()
    asyncio.run(scenario())


def test_a_batch_is_not_proposed_as_a_command(tmp_path):
    """Proposals made together become one Batch entry: a Batch proposed among them would be a
    Batch inside a Batch, which every node refuses to decode (the whole cluster would halt)."""
    from mooncaked.meta.commands import Batch

    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        try:
            waiters = [node.propose(_node_up("a")),
                       node.propose(Batch((_node_up("b"), _node_up("c")))),
                       node.propose(_node_up("d"))]
            results = await asyncio.wait_for(
                asyncio.gather(*waiters, return_exceptions=True), 30)
            assert isinstance(results[1], MooncakedError)
            assert results[1].code == ErrorCode.INVALID_PARAMS
            assert state.applied == ["a", "d"] and node.halted is None
        finally:
            node.stop()
    asyncio.run(scenario())


def test_the_leader_applies_what_it_proposed_without_decoding_it(tmp_path, monkeypatch):
    from mooncaked.cluster import raft_node
    decoded: list[bytes] = []
    decode = raft_node.command_codec.decode
    monkeypatch.setattr(raft_node.command_codec, "decode",
                        lambda data, **kw: decoded.append(data) or decode(data, **kw))

    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        try:
            assert await node.propose(_node_up("a")) == 1
            waiters = [node.propose(_node_up(name)) for name in ("b", "c")]  # one Batch
            assert await asyncio.gather(*waiters) == [2, 3]
            assert state.applied == ["a", "b", "c"] and decoded == []
        finally:
            node.stop()
    asyncio.run(scenario())


def test_a_commit_alone_is_not_written_and_a_restart_applies_every_entry(tmp_path):
    async def scenario():
        state = RecordingState()
        node = await _leader(tmp_path, state)
        appends: list[tuple[int, object]] = []
        append = node.store.append
        node.store.append = lambda entries, hard_state: (
            appends.append((len(entries), hard_state)), append(entries, hard_state))
        try:
            for name in ("a", "b", "c"):
                await node.propose(_node_up(name))
        finally:
            node.stop()
        assert [count for count, _ in appends] == [1, 1, 1]  # no write of a commit alone
        # The commit index on disk lags; the restarted node commits its log again.
        state = RecordingState()
        node = await _leader(tmp_path, state)
        try:
            assert await node.propose(_node_up("d")) == 4
            assert state.applied == ["a", "b", "c", "d"]
        finally:
            node.stop()
    asyncio.run(scenario())
