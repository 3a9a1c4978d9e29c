"""Reconciliation in the state machine: a node declared down that returns with its memory.

NodeDown with keep_until_ms keeps the node's segments (ranges still allocated) and its replicas
aside; NodeReturn of the same generation mounts them again under the next generation and puts
back the replicas of versions that are still the readable ones and lack replicas. A restart
(NodeUp), a NodeDown without keep or ReleaseDownNode drop what is kept. Every step keeps the
state machine's invariants, and snapshots carry what is kept.
"""

from __future__ import annotations

import msgpack
import pytest

from mooncaked._native import OffsetAllocator
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import StateMachine

RELEASE_TIMEOUT_MS = 1000
SIZE = 4096


def new_state() -> StateMachine:
    return StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                        max_objects=100, put_start_discard_timeout_ms=300,
                        put_start_release_timeout_ms=RELEASE_TIMEOUT_MS)


def apply(state: StateMachine, command):
    """Through the log's encoding, as every node applies it; invariants checked after."""
    result = state.apply(codec.decode(codec.encode(command)))
    state.check_invariants()
    return result


def cluster(nodes=(1, 2, 3)) -> StateMachine:
    state = new_state()
    for node in nodes:
        generation = apply(state, c.NodeUp(node, f"n{node}", "c", "p"))
        apply(state, c.MountSegment(c.segment_id_of(node, 0, generation), f"n{node}/0",
                                    f"n{node}", 1 << 20, 64, 256))
    return state


_writers = iter(range(1, 1 << 30))


def put(state: StateMachine, name: str, on: tuple[int, ...], now_ms: int,
        upsert: bool = False) -> None:
    """A put of one SIZE-byte value with a replica on each node of `on`."""
    key = ("ns", name)
    writer = next(_writers)
    preferred = tuple(f"n{node}/0" for node in on)
    apply(state, c.PutStart(key, SIZE, len(on), preferred, None, False, upsert, writer,
                            now_ms, 7))
    apply(state, c.PutEnd(key, writer, now_ms, now_ms))
    assert nodes_of(state, name) == sorted(on)


def nodes_of(state: StateMachine, name: str) -> list[int] | None:
    version = state.readable(("ns", name))
    if version is None:
        return None
    return sorted(c.node_of_segment(r.segment_id) for r in version.replicas)


def node_segment(state: StateMachine, node: int):
    return next(s for s in state.segment_list if c.node_of_segment(s.segment_id) == node)


def test_a_returning_node_gets_back_the_replicas_of_current_versions_only():
    state = cluster()
    for name in ("kept", "also_kept", "upserted", "removed", "evicted"):
        put(state, name, (1, 2), now_ms=10)
    put(state, "elsewhere", (2, 3), now_ms=10)
    generation = state.generations[1]
    lost = apply(state, c.NodeDown(1, keep_until_ms=60_000))
    assert lost == 0 and not state.nodes[1].up
    # Out of reads and placement at once, as with a plain NodeDown.
    assert all(nodes_of(state, n) == [2] for n in ("kept", "upserted", "removed"))
    assert all(c.node_of_segment(s.segment_id) != 1 for s in state.segment_list)
    assert state.kept_replicas(1) == 5
    # Meanwhile: an upsert, a remove and an eviction end three of those versions.
    put(state, "upserted", (2, 3), now_ms=20, upsert=True)
    apply(state, c.Remove(("ns", "removed"), release_at_ms=20))
    apply(state, c.Evict((("ns", "evicted"),)))

    new_generation = apply(state, c.NodeReturn(1, generation, now_ms=30, release_at_ms=500))
    assert new_generation == generation + 1 == state.generations[1]
    assert state.nodes[1].up and not state.down_nodes
    segment = node_segment(state, 1)
    assert c.generation_of_segment(segment.segment_id) == new_generation
    assert nodes_of(state, "kept") == nodes_of(state, "also_kept") == [1, 2]
    assert nodes_of(state, "upserted") == [2, 3]
    assert nodes_of(state, "removed") is None and nodes_of(state, "evicted") is None
    for name in ("kept", "also_kept"):
        replica = next(r for r in state.readable(("ns", name)).replicas
                       if c.node_of_segment(r.segment_id) == 1)
        assert replica.segment_id == segment.segment_id  # renamed to the new mount
    # The three ended versions' ranges stay allocated until release_at_ms, then are free.
    assert segment.allocator.allocation_count == 5
    apply(state, c.ReleaseExpired(499))
    assert segment.allocator.allocation_count == 5
    apply(state, c.ReleaseExpired(500))
    assert segment.allocator.allocation_count == 2
    assert state.owned_bytes(segment.segment_id) == segment.allocator.used_bytes


def test_a_restarted_node_gets_nothing_back():
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    # A restart registers with a NodeUp (new memory): what was kept is dropped.
    new_generation = apply(state, c.NodeUp(1, "n1", "c", "p"))
    assert new_generation == generation + 1 and not state.down_nodes
    apply(state, c.MountSegment(c.segment_id_of(1, 0, new_generation), "n1/0", "n1",
                                1 << 20, 64, 256))
    assert node_segment(state, 1).allocator.allocation_count == 0
    assert nodes_of(state, "v") == [2]
    # The old process's late return, with its generation or the new one: nothing changes
    # (the first answers the generation the node is up under, as to a repeat).
    before = state.digest()  # (a command's now_ms at most the log's clock: it stays)
    assert apply(state, c.NodeReturn(1, generation, 10, 40)) == new_generation
    assert apply(state, c.NodeReturn(1, new_generation, 10, 40)) == 0
    assert state.digest() == before and nodes_of(state, "v") == [2]


def test_a_repeated_return_answers_the_same_generation_and_changes_nothing():
    """The node asks again when the first answer was lost (OUTCOME_UNKNOWN): before, the
    repeat answered 0 and the node registered anew, dropping the replicas just restored."""
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    assert apply(state, c.NodeReturn(1, generation, 10, 40)) == generation + 1
    before = state.digest()
    assert apply(state, c.NodeReturn(1, generation, 10, 40)) == generation + 1
    assert state.digest() == before and nodes_of(state, "v") == [1, 2]


def test_a_return_with_another_generation_changes_nothing():
    state = cluster()
    put(state, "v", (1, 3), now_ms=10)
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    before = state.digest()  # (a command's now_ms at most the log's clock: it stays)
    for wrong in (generation - 1, generation + 1, 0):
        assert apply(state, c.NodeReturn(1, wrong, 10, 40)) == 0
    assert apply(state, c.NodeReturn(2, state.generations[2], 10, 40)) == 0  # up, none kept
    assert state.digest() == before
    assert apply(state, c.NodeReturn(1, generation, 40, 40)) == generation + 1


@pytest.mark.parametrize("how", ["grace", "plain node_down", "removed"])
def test_when_the_grace_ends_what_was_kept_is_dropped(how):
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=5_000))
    assert apply(state, c.ReleaseDownNode(1, generation + 1)) is False  # not that one
    assert state.down_nodes
    if how == "grace":
        assert apply(state, c.ReleaseDownNode(1, generation)) is True
    else:  # a clean stop, or the node's removal from the cluster
        apply(state, c.NodeDown(1))
    assert not state.down_nodes and state.kept_replicas(1) == 0
    assert apply(state, c.NodeReturn(1, generation, 40, 40)) == 0
    assert nodes_of(state, "v") == [2]
    # The node registers anew (NodeUp) and its segment starts empty.
    new_generation = apply(state, c.NodeUp(1, "n1", "c", "p"))
    apply(state, c.MountSegment(c.segment_id_of(1, 0, new_generation), "n1/0", "n1",
                                1 << 20, 64, 256))
    assert node_segment(state, 1).allocator.allocation_count == 0


def test_repair_copies_made_meanwhile_count_and_the_surplus_replica_is_freed():
    state = cluster()
    put(state, "repaired", (1, 2), now_ms=10)
    put(state, "not_repaired", (1, 2), now_ms=10)
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    # Repair gives "repaired" its second replica on node 3 (reservation, then AddReplicas).
    version = state.readable(("ns", "repaired"))
    reserved = (c.RESERVED_NAMESPACE, "ns#repair/1")
    apply(state, c.PutStart(reserved, SIZE, 1, ("n3/0",), None, False, False, 999, 20, 1,
                            "ns"))
    assert apply(state, c.AddReplicas(("ns", "repaired"), version.writer_id,
                                      version.started_ms, reserved, 999)) == 1
    assert nodes_of(state, "repaired") == [2, 3]
    apply(state, c.NodeReturn(1, generation, now_ms=30, release_at_ms=100))
    # Never more replicas than the put asked for: the returning copy of the repaired value
    # is surplus, freed; the other value has its replica back.
    assert nodes_of(state, "repaired") == [2, 3]
    assert nodes_of(state, "not_repaired") == [1, 2]
    apply(state, c.ReleaseExpired(100))
    assert node_segment(state, 1).allocator.allocation_count == 1
    # A repair copy that was still in flight when the node returned is refused, not added.
    version = state.readable(("ns", "not_repaired"))
    reserved = (c.RESERVED_NAMESPACE, "ns#repair/2")
    apply(state, c.PutStart(reserved, SIZE, 1, ("n3/0",), None, False, False, 998, 40, 1,
                            "ns"))
    with pytest.raises(MooncakedError) as refused:
        apply(state, c.AddReplicas(("ns", "not_repaired"), version.writer_id,
                                   version.started_ms, reserved, 998))
    assert refused.value.code == ErrorCode.INVALID_WRITE
    assert nodes_of(state, "not_repaired") == [1, 2]


def test_unfinished_writes_on_the_node_are_held_until_their_release_timeout():
    state = cluster()
    key = ("ns", "pending")
    apply(state, c.PutStart(key, SIZE, 2, ("n1/0", "n2/0"), None, False, False, 77, 10, 3))
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    assert [c.node_of_segment(r.segment_id) for r in state.objects[key].pending.replicas] \
        == [2]
    apply(state, c.NodeReturn(1, generation, now_ms=30, release_at_ms=30))
    segment = node_segment(state, 1)
    # Its writer may still be copying: the range waits for the put's release timeout.
    apply(state, c.ReleaseExpired(10 + RELEASE_TIMEOUT_MS - 1))
    assert segment.allocator.allocation_count == 1
    apply(state, c.ReleaseExpired(10 + RELEASE_TIMEOUT_MS))
    assert segment.allocator.allocation_count == 0


def test_a_late_mount_of_a_kept_segment_is_refused():
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    segment_id = node_segment(state, 1).segment_id
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    with pytest.raises(MooncakedError) as refused:
        apply(state, c.MountSegment(segment_id, "n1/0", "n1", 1 << 20, 64, 256))
    assert refused.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS
    assert state.kept_replicas(1) == 1


def test_snapshots_carry_what_is_kept_and_older_formats_load():
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    apply(state, c.PutStart(("ns", "w"), SIZE, 2, ("n1/0", "n3/0"), None, False, False, 5,
                            10, 3))
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    restored = new_state()
    restored.restore(state.snapshot())
    restored.check_invariants()
    assert restored.digest() == state.digest() and restored.kept_replicas(1) == 1
    for machine in (state, restored):
        apply(machine, c.NodeReturn(1, generation, 30, 40))
    assert restored.digest() == state.digest()
    assert nodes_of(restored, "v") == [1, 2]
    # A snapshot of format 3 (before anything was kept) still loads.
    top = msgpack.unpackb(cluster().snapshot(), raw=False)
    top["format"] = 3
    del top["down_nodes"], top["arenas"], top["arena_seq"], top["arena_term"]
    old = new_state()
    old.restore(msgpack.packb(top, use_bin_type=True))
    assert not old.down_nodes and len(old.segments) == 3


def test_a_bad_snapshot_of_what_is_kept_is_refused():
    state = cluster()
    put(state, "v", (1, 2), now_ms=10)
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    top = msgpack.unpackb(state.snapshot(), raw=False)
    node_id, generation, keep_until, segments, parked, held, arenas = top["down_nodes"][0]
    for bad in ([node_id, generation + 1, keep_until, segments, parked, held, arenas],
                [2, generation, keep_until, segments, parked, held, arenas],  # an up node
                [node_id, generation, keep_until, segments, parked + parked, held, arenas],
                [node_id, generation, keep_until, segments, [], held, arenas]):  # unowned
        top["down_nodes"] = [bad]
        with pytest.raises(ValueError):
            new_state().restore(msgpack.packb(top, use_bin_type=True))


def test_the_service_returns_with_its_memory_and_a_restart_registers_anew(tmp_path):
    """The real ClusterService registration over a one-node log (tests/test_mount_generation):
    declared down with keep, the same process returns (NodeReturn), under a new generation,
    with its replica and bytes; the old ids stay refused. A restarted process (fresh memory)
    registers with a NodeUp and gets nothing back."""
    import asyncio

    from test_mount_generation import NODE_ID, incarnation, register

    state = new_state()
    key = ("ns", "v")

    async def scenario():
        service = incarnation(state, tmp_path)
        old_ids = await register(service)
        other = c.segment_id_of(9, 0, service.raft.propose(c.NodeUp(9, "n9", "c", "p"))
                                .result())
        service.raft.propose(c.MountSegment(other, "n9/0", "n9", 4096, 64, 8))
        service.raft.propose(c.PutStart(key, 8, 2, (f"node{NODE_ID}/0", "n9/0"), None, False,
                                        False, 1, 10, 3))
        service.raft.propose(c.PutEnd(key, 1, 10, 10))
        replica, _ = state.readable(key).replicas
        assert replica.segment_id == old_ids[0]
        service._local_view(replica.segment_id, replica.offset, 8)[:] = b"my bytes"

        service.raft.propose(c.NodeDown(NODE_ID, keep_until_ms=60_000))
        await service._registering  # registers again by itself: a return
        assert service.stats["returns"] == 1 and service.registered_term >= 0
        replica = next(r for r in state.readable(key).replicas
                       if c.node_of_segment(r.segment_id) == NODE_ID)
        assert c.generation_of_segment(replica.segment_id) == service.mount_generation == 2
        assert bytes(service._local_view(replica.segment_id, replica.offset, 8)) \
            == b"my bytes"
        for segment_id in old_ids:
            with pytest.raises(MooncakedError) as refused:
                service._local_view(segment_id, 0, 8)
            assert refused.value.code == ErrorCode.SEGMENT_NOT_FOUND

        # The process dies (it hears of nothing more) and a new one starts: new memory.
        restarted = incarnation(state, tmp_path)
        restarted.raft.propose(c.NodeDown(NODE_ID, keep_until_ms=60_000))
        assert state.down_nodes
        await register(restarted)
        assert restarted.stats["returns"] == 0 and restarted.mount_generation == 3
        assert [c.node_of_segment(r.segment_id) for r in state.readable(key).replicas] == [9]
        assert not state.down_nodes
        state.check_invariants()

    asyncio.run(scenario())


def test_random_logs_with_nodes_kept_and_returning_follow_from_snapshots():
    """Random commands (tests/test_state_snapshot.py's generator) with NodeDown keeping what a
    node held, NodeReturn (right and wrong generations) and ReleaseDownNode mixed in: the
    invariants hold after every command, and a follower restored from a snapshot at any point
    applies the rest to the same state, digest for digest."""
    import random

    from test_state_snapshot import apply as apply_result
    from test_state_snapshot import NODES, new_state as snapshot_state, next_command

    kinds: set[str] = set()
    for seed in range(10):
        rng, mine = random.Random(seed), random.Random(seed + 100)
        leader = snapshot_state()
        commands, now = [], 0
        for _ in range(600):
            now += rng.choice([0, 1, 5, 20, 50, 300])
            roll = mine.random()
            node = mine.choice(NODES)
            kept = leader.down_nodes.get(node)
            generation = kept.generation if kept is not None and mine.random() < 0.8 \
                else leader.generations.get(node, 1)
            if roll < 0.05:
                command = c.NodeDown(node, keep_until_ms=now + mine.choice([0, 100, 5000]))
            elif roll < 0.10:
                command = c.NodeReturn(node, generation, now, now + mine.choice([0, 200]))
            elif roll < 0.14:
                command = c.ReleaseDownNode(node, generation)
            else:
                command = next_command(rng, leader, now)
            result = apply_result(leader, command)
            leader.check_invariants()
            if result[0] == "ok" and result[1] not in (0, False):
                kinds.add(type(command).__name__)
            commands.append(command)
        for split in sorted(mine.sample(range(len(commands)), 4)):
            reference, follower = snapshot_state(), snapshot_state()
            for command in commands[:split]:
                apply_result(reference, command)
            follower.restore(reference.snapshot())
            follower.check_invariants()
            for command in commands[split:]:
                assert apply_result(follower, command) == apply_result(reference, command)
                follower.check_invariants()
            assert follower.digest() == reference.digest() == leader.digest()
    assert {"NodeReturn", "ReleaseDownNode"} <= kinds, kinds  # each kind succeeded


def arena_put(state: StateMachine, name: str, on: tuple[int, ...], term: int, now_ms: int):
    """A put as a cluster leader makes it: one ArenaPut in parts of arenas of `term`, one
    arena per node's segment (taken on first use)."""
    key = ("ns", name)
    parts = []
    for node in on:
        sid = c.segment_id_of(node, 0, state.generations[node])
        arena = next((a for a in state.arenas.values() if a.segment_id == sid
                      and a.term == term and a.closed_ms is None), None)
        if arena is None:
            arena_id, offset = apply(state, c.ReserveArena(sid, 16 * SIZE, term, 500, now_ms))
            arena = state.arenas[arena_id]
        used = sum(1 for e in state.objects.values() if e.complete is not None
                   for r in e.complete.replicas if r.handle == -arena.arena_id)
        parts.append((arena.arena_id, arena.offset + used * SIZE))
    apply(state, c.ArenaPut(key, SIZE, len(on), tuple(parts), None, False, False,
                            next(_writers), now_ms, now_ms, now_ms, term))
    assert nodes_of(state, name) == sorted(on)


def test_a_returning_node_gets_back_its_parts_of_arenas_and_the_arenas_closed():
    """Cluster puts live in parts of arenas: a node kept while down keeps its arenas (their
    live counts cover its parked parts), and its return brings them back closed under the
    new segment ids, with the parts restored; snapshots carry kept arenas."""
    state = cluster()
    for i in range(3):
        arena_put(state, f"a{i}", (1, 2), term=1, now_ms=10)
    on_node_1 = [a.arena_id for a in state.arenas.values()
                 if c.node_of_segment(a.segment_id) == 1]
    generation = state.generations[1]
    apply(state, c.NodeDown(1, keep_until_ms=60_000))
    assert not any(arena_id in state.arenas for arena_id in on_node_1)
    assert state.kept_replicas(1) == 3
    restored = new_state()
    restored.restore(state.snapshot())
    restored.check_invariants()
    assert restored.digest() == state.digest()
    for machine in (state, restored):
        new_generation = apply(machine, c.NodeReturn(1, generation, 30, 40))
        assert new_generation == generation + 1
        for i in range(3):
            assert nodes_of(machine, f"a{i}") == [1, 2]
        for arena_id in on_node_1:
            arena = machine.arenas[arena_id]
            assert arena.closed_ms is not None and arena.live == 3
            assert arena.segment_id == c.segment_id_of(1, 0, new_generation)
    assert restored.digest() == state.digest()
    # Removing the values frees the parts; the closed arena returns to its segment after its
    # hold, and the segment's allocator is whole again.
    for i in range(3):
        apply(state, c.Remove(("ns", f"a{i}"), 50))
    apply(state, c.ReleaseExpired(10_000))
    assert not any(arena_id in state.arenas for arena_id in on_node_1)
    segment = state.segments[c.segment_id_of(1, 0, generation + 1)]
    assert segment.allocator.used_bytes == 0
