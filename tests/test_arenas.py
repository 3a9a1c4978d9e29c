"""One log command per cluster put: arenas (meta/commands.py ReserveArena, cluster/arenas.py).

State machine level: ArenaPut records a whole put in parts of arenas; the term fence closes an
older leader's arenas; an arena returns to its segment only once closed, unused and held;
snapshots carry arenas and every node that applies the same commands has the same digest.
Leader level (ReplicatedMaster over a log that applies at once): a put is one command, puts
share an arena, nothing is handed out twice, a revoke needs no command, limits count the puts
in progress, and a put that reaches a later leader is refused rather than committed.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from mooncaked._native import OffsetAllocator
from mooncaked.cluster.master import ReplicatedMaster
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec, commands as c
from mooncaked.meta.master import ReplicateConfig
from mooncaked.meta.state_machine import StateMachine
from mooncaked.raft.types import Role

SEGMENT_BYTES = 1 << 20
HOLD_MS = 500
RELEASE_MS = 1000


def new_state(max_objects: int = 1000) -> StateMachine:
    state = StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                         max_objects=max_objects, put_start_discard_timeout_ms=300,
                         put_start_release_timeout_ms=RELEASE_MS)
    for i in (1, 2):
        state.apply(c.MountSegment(i, f"seg{i}", f"node{i}", SEGMENT_BYTES, 64, 1024))
    return state


def arena_put(key, arena_replicas, *, size=100, upsert=False, writer=1, started=10, now=20,
              term=1, release_at=None):
    return c.ArenaPut(key, size, len(arena_replicas), tuple(arena_replicas), None, False,
                      upsert, writer, started, now, now if release_at is None else release_at,
                      term)


def apply_all(commands, state=None):
    """Apply through the codec (what a log entry carries); returns (state, results)."""
    state = state or new_state()
    results = []
    for command in commands:
        try:
            results.append(state.apply(codec.decode(codec.encode(command))))
        except MooncakedError as exc:
            results.append(exc.code)
        state.check_invariants()
    return state, results


# -- the state machine ---------------------------------------------------------------------------

def test_a_put_is_one_command_in_parts_of_an_arena():
    state, results = apply_all([c.ReserveArena(1, 64 * 1024, 1, HOLD_MS, 5)])
    arena_id, offset = results[0]
    used = state.used_bytes()
    state, results = apply_all([
        arena_put(("ns", "a"), [(arena_id, offset)]),
        arena_put(("ns", "b"), [(arena_id, offset + 128)], writer=2),
    ], state)
    assert results == [None, None]
    assert state.readable(("ns", "a")).replicas[0].offset == offset
    assert state.readable(("ns", "b")).replicas[0].offset == offset + 128
    assert state.used_bytes() == used  # the arena's range holds them: no allocation each
    assert state.arenas[arena_id].live == 2
    assert state.usage["ns"].bytes == 200 and state.usage["ns"].objects == 2


def test_a_part_outside_its_arena_or_of_another_term_is_refused():
    state, results = apply_all([c.ReserveArena(1, 4096, 1, HOLD_MS, 5)])
    arena_id, offset = results[0]
    _, results = apply_all([
        arena_put(("ns", "a"), [(arena_id, offset + 4096 - 50)]),  # runs past its end
        arena_put(("ns", "a"), [(arena_id + 1, offset)]),  # no such arena
        arena_put(("ns", "a"), [(arena_id, offset)], term=2),  # another term's arena
        arena_put(("ns", "a"), [(arena_id, offset)], term=1),  # term 2 came: too late
    ], state)
    assert results == [ErrorCode.INVALID_WRITE] * 4
    assert ("ns", "a") not in state.objects


def test_a_later_term_closes_older_arenas_which_return_once_unused_and_held():
    state, results = apply_all([c.ReserveArena(1, 8192, 1, HOLD_MS, 5)])
    old_id, offset = results[0]
    state, _ = apply_all([arena_put(("ns", "a"), [(old_id, offset)], now=20)], state)
    free_before = state.segments[1].allocator.free_bytes
    state, results = apply_all([c.ReserveArena(1, 8192, 2, HOLD_MS, 100)], state)
    assert state.arenas[old_id].closed_ms == 100  # the new term closed it
    state, _ = apply_all([c.Remove(("ns", "a"), 150),  # leased until 150
                          c.ReleaseExpired(160)], state)
    assert old_id in state.arenas and state.arenas[old_id].live == 0  # held until 100 + hold
    state, _ = apply_all([c.ReleaseExpired(100 + HOLD_MS - 1)], state)
    assert old_id in state.arenas
    state, _ = apply_all([c.ReleaseExpired(100 + HOLD_MS)], state)
    assert old_id not in state.arenas
    assert state.segments[1].allocator.free_bytes == free_before - 8192 + 8192


def test_an_arena_closed_with_no_put_in_flight_needs_no_hold():
    state, results = apply_all([c.ReserveArena(1, 4096, 1, HOLD_MS, 5)])
    arena_id, offset = results[0]
    state, results = apply_all([arena_put(("ns", "a"), [(arena_id, offset)]),
                                c.CloseArenas(1, (arena_id,), 0, 30),
                                c.Evict((("ns", "a"),)),
                                c.ReleaseExpired(31)], state)
    assert results[1] == 1
    assert arena_id not in state.arenas
    assert state.used_bytes() == 0


def test_upserts_the_last_to_start_wins_whatever_the_commit_order():
    state, results = apply_all([c.ReserveArena(1, 4096, 1, HOLD_MS, 5)])
    arena_id, offset = results[0]
    state, results = apply_all([
        arena_put(("ns", "k"), [(arena_id, offset)], size=10, upsert=True, writer=2, started=12),
        arena_put(("ns", "k"), [(arena_id, offset + 64)], size=20, upsert=True, writer=1,
                  started=11),  # started first, ends last: superseded
    ], state)
    assert results == [None, None]
    version = state.readable(("ns", "k"))
    assert (version.size_bytes, version.writer_id) == (10, 2)
    assert state.arenas[arena_id].live == 1


def test_a_put_of_an_existing_key_and_a_late_put_are_refused():
    state, results = apply_all([c.ReserveArena(1, 4096, 1, HOLD_MS, 5)])
    arena_id, offset = results[0]
    _, results = apply_all([
        arena_put(("ns", "k"), [(arena_id, offset)]),
        arena_put(("ns", "k"), [(arena_id, offset + 128)], writer=2),
        arena_put(("ns", "late"), [(arena_id, offset + 256)], started=10,
                  now=10 + RELEASE_MS + 1),
    ], state)
    assert results == [None, ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.INVALID_WRITE]


def test_arena_puts_keep_quotas_and_the_object_limit():
    state = new_state(max_objects=1)
    state, results = apply_all([c.ReserveArena(1, 4096, 1, HOLD_MS, 5),
                                c.SetQuota("q", 150, 0)], state)
    arena_id, offset = results[0]
    _, results = apply_all([
        arena_put(("q", "a"), [(arena_id, offset)], size=200),
        arena_put(("ns", "a"), [(arena_id, offset)]),
        arena_put(("ns", "b"), [(arena_id, offset + 128)]),
    ], state)
    assert results == [ErrorCode.QUOTA_EXCEEDED, None, ErrorCode.NO_AVAILABLE_HANDLE]


def _history():
    return [c.ReserveArena(1, 8192, 1, HOLD_MS, 5), c.ReserveArena(2, 8192, 1, HOLD_MS, 6)]


def test_snapshots_carry_arenas_and_equal_commands_give_equal_digests():
    state, results = apply_all(_history())
    (a1, o1), (a2, o2) = results
    more = [arena_put(("ns", "x"), [(a1, o1), (a2, o2)]),
            arena_put(("ns", "y"), [(a1, o1 + 128)], writer=2),
            c.Remove(("ns", "y"), 40), c.CloseArenas(1, (a2,), HOLD_MS, 30),
            c.ReserveArena(2, 4096, 3, HOLD_MS, 50)]
    state, _ = apply_all(more, state)
    other, _ = apply_all(_history() + more)
    assert state.digest() == other.digest()
    restored = new_state()
    restored.restore(state.snapshot())
    restored.check_invariants()
    assert restored.digest() == state.digest()
    assert restored.arenas[a1].live == 2 and restored.arena_term == 3
    # The same commands after the restore give the same state again.
    tail = [c.ReleaseExpired(10_000), c.Evict((("ns", "x"),)), c.ReleaseExpired(20_000)]
    apply_all(tail, state)
    apply_all(tail, restored)
    assert restored.digest() == state.digest()
    assert a1 not in state.arenas and a2 not in state.arenas


def test_a_snapshot_whose_arena_counts_do_not_match_is_refused():
    state, results = apply_all(_history())
    (a1, o1), _ = results
    state, _ = apply_all([arena_put(("ns", "x"), [(a1, o1)])], state)
    top = msgpack.unpackb(state.snapshot(), use_list=True, raw=False)
    top["arenas"][0][8] += 1  # live
    with pytest.raises(ValueError, match="arena"):
        new_state().restore(msgpack.packb(top, use_bin_type=True))
    top["arenas"][0][8] -= 1
    top["arenas"][0][0] = 99  # an id past arena_seq
    with pytest.raises(ValueError, match="arena"):
        new_state().restore(msgpack.packb(top, use_bin_type=True))


# -- the leader -------------------------------------------------------------------------------

class ImmediateLog:
    """A one-node log that applies each command at once (the leader's view of a commit)."""

    def __init__(self, state: StateMachine, term: int = 1) -> None:
        self.state = state
        self.proposed: list = []
        self.core = type("Core", (), {"term": term})()
        self.cut_off = False  # a leader that lost its quorum: barriers fail

    def leads_now(self):
        return not self.cut_off

    def read_barrier(self):
        future = asyncio.get_running_loop().create_future()
        if self.cut_off:
            future.set_exception(MooncakedError(ErrorCode.NO_LEADER, "no quorum"))
        else:
            future.set_result(None)
        return future

    def propose(self, command):
        self.proposed.append(type(command).__name__)
        future = asyncio.get_running_loop().create_future()
        if self.cut_off:
            future.set_exception(MooncakedError(ErrorCode.NO_LEADER, "no quorum"))
            return future
        try:
            future.set_result(self.state.apply(codec.decode(codec.encode(command))))
        except MooncakedError as exc:
            future.set_exception(exc)
        return future


def new_leader(state=None, arena_bytes=64 * 1024, **store):
    state = state or new_state()
    raft = ImmediateLog(state)
    master = ReplicatedMaster(state, StoreConfig(lease_ttl_ms=100, **store), raft, seed=3,
                              arena_bytes=arena_bytes, late_write_ms=HOLD_MS)
    master.become_leader()
    master.lease_floor_ms = 0  # no predecessor's leases to respect here
    return master, raft


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_leader_put_is_one_command_and_puts_share_an_arena():
    async def main():
        master, raft = new_leader()
        seen = set()
        for i in range(20):
            replicas = await master.put_start_async(("ns", f"k{i}"), 1000, ReplicateConfig(2),
                                                    False, i + 1)
            assert len(replicas) == 2
            for r in replicas:
                assert (r.segment_id, r.offset) not in seen  # never handed out twice
                seen.add((r.segment_id, r.offset))
            await master.put_end_async(("ns", f"k{i}"), i + 1)
        assert raft.proposed.count("ArenaPut") == 20
        assert raft.proposed.count("ReserveArena") == 2  # one per segment, for all 20
        assert "PutStart" not in raft.proposed and "PutEnd" not in raft.proposed
        master.state.check_invariants()
        assert all(master.state.readable(("ns", f"k{i}")) for i in range(20))
    run(main())


def test_a_revoke_needs_no_command_and_its_part_is_not_handed_out_again():
    async def main():
        master, raft = new_leader()
        first = await master.put_start_async(("ns", "k"), 1000, ReplicateConfig(), False, 1)
        before = list(raft.proposed)
        await master.put_revoke_async(("ns", "k"), 1, hold_ms=100)
        assert raft.proposed == before
        second = await master.put_start_async(("ns", "k"), 1000, ReplicateConfig(), False, 2)
        assert (first[0].segment_id, first[0].offset) != (second[0].segment_id,
                                                          second[0].offset)
        with pytest.raises(MooncakedError) as info:
            await master.put_end_async(("ns", "k"), 1)  # revoked: nothing to commit
        assert info.value.code == ErrorCode.INVALID_WRITE
        await master.put_end_async(("ns", "k"), 2)
    run(main())


def test_a_second_put_of_a_key_in_progress_is_refused_before_any_command():
    async def main():
        master, raft = new_leader()
        await master.put_start_async(("ns", "k"), 100, ReplicateConfig(), False, 1)
        with pytest.raises(MooncakedError) as info:
            await master.put_start_async(("ns", "k"), 100, ReplicateConfig(), False, 2)
        assert info.value.code == ErrorCode.OBJECT_ALREADY_EXISTS
        await master.put_start_async(("ns", "k"), 100, ReplicateConfig(), True, 3)  # upsert
    run(main())


def test_quotas_count_the_puts_in_progress():
    async def main():
        state = new_state()
        state.apply(c.SetQuota("q", 1500, 0))
        master, _ = new_leader(state)
        await master.put_start_async(("q", "a"), 1000, ReplicateConfig(), False, 1)
        with pytest.raises(MooncakedError) as info:
            await master.put_start_async(("q", "b"), 1000, ReplicateConfig(), False, 2)
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        await master.put_revoke_async(("q", "a"), 1)
        await master.put_start_async(("q", "b"), 1000, ReplicateConfig(), False, 3)
    run(main())


def test_a_put_started_under_an_earlier_leadership_is_not_committed():
    async def main():
        master, raft = new_leader()
        await master.put_start_async(("ns", "k"), 100, ReplicateConfig(), False, 1)
        raft.core.term = 2
        master.become_leader()  # leadership lost and won again
        with pytest.raises(MooncakedError) as info:
            await master.put_end_async(("ns", "k"), 1)
        assert info.value.code == ErrorCode.INVALID_WRITE
        assert ("ns", "k") not in master.state.objects
        # The new term hands out parts of its own arenas only, and its first arena command
        # closed the old ones.
        replicas = await master.put_start_async(("ns", "k"), 100, ReplicateConfig(), False, 2)
        arena = master.state.arenas[-replicas[0].handle]
        assert arena.term == 2
        assert all(a.closed_ms is not None for a in master.state.arenas.values() if a.term == 1)
        await master.put_end_async(("ns", "k"), 2)
    run(main())


def test_a_full_arena_is_closed_and_returns_once_its_objects_are_gone():
    async def main():
        state = new_state()
        master, raft = new_leader(state, arena_bytes=16 * 1024)
        for i in range(12):  # 1 KiB parts: 16 fill an arena of one segment
            await master.put_start_async(("ns", f"k{i}"), 1024, ReplicateConfig(), False, i + 1)
            await master.put_end_async(("ns", f"k{i}"), i + 1)
        for i in range(12, 40):
            await master.put_start_async(("ns", f"k{i}"), 1024, ReplicateConfig(), False, i + 1)
            await master.put_end_async(("ns", f"k{i}"), i + 1)
        assert "CloseArenas" in raft.proposed
        closed = [a for a in state.arenas.values() if a.closed_ms is not None]
        assert closed and all(a.hold_ms == 0 for a in closed)  # no put of theirs in flight
        keys = [k for k in state.objects if any(-r.handle in {a.arena_id for a in closed}
                                                for r in state.objects[k].complete.replicas)]
        await master._propose(c.Evict(tuple(keys)))
        await master._propose(c.ReleaseExpired(master.now_ms()))
        assert not any(a.arena_id in state.arenas for a in closed)
        state.check_invariants()
    run(main())


def test_no_room_evicts_then_places():
    async def bounded():
        state = new_state()
        master, raft = new_leader(state, arena_bytes=64 * 1024)
        for i in range(1, 80):  # 2 MiB of segments, 80 x 60 KiB = 4.8 MiB put
            await master.put_start_async(("ns", f"v{i}"), 60 * 1024, ReplicateConfig(),
                                         False, i)
            await master.put_end_async(("ns", f"v{i}"), i)
        assert "Evict" in raft.proposed
        assert master.state.readable(("ns", "v79")) is not None
        state.check_invariants()
    run(bounded())


def test_an_upsert_that_starts_after_another_ended_wins_even_within_one_millisecond():
    async def main():
        master, _ = new_leader()
        key = ("ns", "k")
        # Two upserts in progress at once get start times a millisecond apart...
        await master.put_start_async(key, 10, ReplicateConfig(), True, 1)
        await master.put_start_async(key, 20, ReplicateConfig(), True, 2)
        await master.put_end_async(key, 2)
        await master.put_end_async(key, 1)  # started first: superseded
        assert master.state.readable(key).size_bytes == 20
        # ...so one that starts once the last has ended must still come after it.
        await master.put_start_async(key, 30, ReplicateConfig(), True, 3)
        await master.put_end_async(key, 3)
        assert master.state.readable(key).size_bytes == 30
    run(main())


def test_a_leader_cut_off_from_its_quorum_neither_refuses_nor_places_a_put():
    """A put of an existing key answers `false` only once a command after it commits: a
    cut-off old leader's state may be stale (the key removed meanwhile). And it
    hands out no part of its arenas: a later leader may have closed them, and may free them
    once its hold has passed."""
    async def main():
        master, raft = new_leader()
        await master.put_start_async(("ns", "k"), 10, ReplicateConfig(), False, 1)
        await master.put_end_async(("ns", "k"), 1)
        raft.cut_off = True
        with pytest.raises(MooncakedError) as info:
            await master.put_start_async(("ns", "k"), 10, ReplicateConfig(), False, 2)
        assert info.value.code == ErrorCode.NO_LEADER
        # Nor does it hand out a part of its arenas: another leader may have closed them.
        for upsert in (False, True):
            with pytest.raises(MooncakedError) as info:
                await master.put_start_async(("ns", "new"), 10, ReplicateConfig(), upsert, 4)
            assert info.value.code == ErrorCode.NO_LEADER
        raft.cut_off = False
        with pytest.raises(MooncakedError) as info:
            await master.put_start_async(("ns", "k"), 10, ReplicateConfig(), False, 3)
        assert info.value.code == ErrorCode.OBJECT_ALREADY_EXISTS
    run(main())


def test_a_batch_entry_decodes_to_its_commands_and_refuses_nesting():
    commands = (c.Remove(("ns", "a"), 3), c.ReleaseExpired(5))
    data = codec.encode(c.Batch(commands))
    assert codec.decode(data) == c.Batch(commands)
    nested = codec.encode_batch([data])
    with pytest.raises(ValueError, match="inside a batch"):
        codec.decode(nested)
    with pytest.raises(ValueError):  # encode refuses what decode would
        codec.encode(c.Batch((c.Batch(commands),)))
    deep = codec.encode(c.ReleaseExpired(1))
    for _ in range(3000):  # no recursion: refused at the first level
        deep = codec.encode_batch([deep])
    with pytest.raises(ValueError):
        codec.decode(deep)
    for bad in ([19], [19, [1]], [19, [b"\xc1"]], [19, []] + [1]):
        with pytest.raises(ValueError):
            codec.decode(msgpack.packb(bad, use_bin_type=True))
    state = new_state()
    results = state.apply(c.Batch((c.SetQuota("q", 1, 0), c.SetQuota("bad name", 1, 0))))
    assert results[0] is None and results[1].code == ErrorCode.INVALID_PARAMS


def test_puts_in_progress_count_on_the_leader():
    async def main():
        master, raft = new_leader()
        raft.role = Role.LEADER
        await master.put_start_async(("ns", "a"), 10, ReplicateConfig(), False, 1)
        await master.put_start_async(("ns", "b"), 10, ReplicateConfig(), True, 2)
        assert master.puts_in_progress() == 2
        await master.put_end_async(("ns", "a"), 1)
        assert master.puts_in_progress() == 1
        raft.role = Role.FOLLOWER
        assert master.puts_in_progress() == 0  # a follower knows only the log's
    run(main())
