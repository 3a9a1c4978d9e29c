"""The mount generation that fences stale replica requests never repeats for a node.

A cluster segment id names its node's mount generation (meta/commands.py); a node refuses a
replica request naming another generation than its current one, so a late write aimed at a
range of an earlier mount cannot land in memory handed out again since. That holds only if a
node never gets a generation it had before: the log numbers each node's registrations (NodeUp),
across NodeDown, restarts and snapshots.

The service tests run the real ClusterService registration and replica fence against a
stand-in for the Raft node that applies each proposal to a StateMachine at once (the log of a
one-node cluster); a restart is a new ClusterService over the same state machine (the log
survives a restart) with the same random bytes as before.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from mooncaked import config as config_module
from mooncaked._native import OffsetAllocator
from mooncaked.cluster.service import ClusterService
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import StateMachine
from mooncaked.raft.types import Role

NODE_ID = 3
SEGMENT_BYTES = 1 << 16


def new_state() -> StateMachine:
    return StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                        max_objects=100, put_start_discard_timeout_ms=300,
                        put_start_release_timeout_ms=1000)


class OneNodeLog:
    """A Raft node of a one-node cluster, reduced to what registration uses: a proposal is
    encoded, decoded and applied at once, and the service hears of it as from the real one."""

    def __init__(self, state: StateMachine) -> None:
        self.state = state
        self.role = Role.LEADER
        self.leader_id = NODE_ID
        self.core = SimpleNamespace(term=1)
        self.last_contact: dict[int, float] = {}
        self.on_applied = lambda index, command, result: None
        self.index = 0

    def propose(self, command) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        command = codec.decode(codec.encode(command))
        self.index += 1
        try:
            result = self.state.apply(command)
        except MooncakedError as exc:
            future.set_exception(exc)
            return future
        future.set_result(result)
        self.on_applied(self.index, command, result)
        return future


class Memory:
    size_bytes = SEGMENT_BYTES

    def __init__(self) -> None:
        self.data = bytearray(SEGMENT_BYTES)

    def slice(self, offset: int, size: int) -> memoryview:
        return memoryview(self.data)[offset:offset + size]


def incarnation(state: StateMachine, tmp_path) -> ClusterService:
    """One run of node NODE_ID's daemon (fresh memory) over the cluster's log."""
    config = config_module.from_dict({
        "segments": {"size_bytes": SEGMENT_BYTES, "count": 2, "max_allocations": 64},
        "cluster": {"enabled": True, "node_id": NODE_ID, "data_dir": str(tmp_path)}})
    memories = {index: Memory() for index in range(2)}

    def own_memory(segment_id):
        if c.node_of_segment(segment_id) != NODE_ID:
            return None
        return memories.get(c.slot_of_segment(segment_id))

    daemon = SimpleNamespace(config=config, master=SimpleNamespace(state=state),
                             node_name=f"node{NODE_ID}", tcp_port=1, own_memory=own_memory)
    service = ClusterService(daemon)
    service.peer_address = "127.0.0.1:2"
    service.raft = OneNodeLog(state)
    service.raft.on_applied = service._applied
    service.master = SimpleNamespace(now_ms=lambda: state.clock_ms, lease_ttl_ms=100)
    return service


def own_segments(state: StateMachine) -> list[int]:
    return sorted(s for s in state.segments if c.node_of_segment(s) == NODE_ID)


async def register(service: ClusterService) -> list[int]:
    service.registered_term = -1
    await service._register()
    assert service.registered_term >= 0
    return own_segments(service.daemon.master.state)


def test_a_restarted_node_never_reuses_its_generation_and_refuses_the_old_ones(
        tmp_path, monkeypatch):
    """Before: the generation started at a random byte, so a restart that drew the byte of the
    previous run mounted the very same segment ids, and a late write aimed at the previous
    run's range was accepted into memory the new run hands out."""
    monkeypatch.setattr(os, "urandom", lambda n: bytes(n))  # every run draws the same bytes
    state = new_state()

    async def scenario():
        first = incarnation(state, tmp_path)
        old_ids = await register(first)
        first._local_view(old_ids[0], 0, 8)[:] = b"old run!"  # the old run's own write: fine
        second = incarnation(state, tmp_path)  # restarted: same log, fresh memory
        new_ids = await register(second)
        assert not set(old_ids) & set(new_ids)
        assert second.mount_generation > first.mount_generation
        for segment_id in old_ids:  # a late request of the first run's mount is refused
            with pytest.raises(MooncakedError) as refused:
                second._local_view(segment_id, 0, 8)
            assert refused.value.code == ErrorCode.SEGMENT_NOT_FOUND
        for segment_id in new_ids:
            second._local_view(segment_id, 0, 8)[:] = b"new run!"

    asyncio.run(scenario())


def test_every_registration_gets_a_new_generation_across_restarts_and_snapshots(tmp_path):
    """Before: an 8-bit counter, so the 257th registration of a node repeated the first's."""
    state = new_state()
    seen: set[int] = set()
    generations = []

    async def scenario(state):
        service = incarnation(state, tmp_path)
        for round_ in range(300):
            if round_ % 100 == 99:  # a restart, from a snapshot of the log
                restored = new_state()
                restored.restore(state.snapshot())
                state = restored
                service = incarnation(state, tmp_path)
                ids = await register(service)
            elif round_ % 7 == 3:  # declared down: the service registers again by itself
                service.raft.propose(c.NodeDown(NODE_ID))
                await service._registering
                ids = own_segments(service.daemon.master.state)
            else:
                ids = await register(service)
            assert len(ids) == 2 and not seen & set(ids), round_
            seen.update(ids)
            generations.append(service.mount_generation)

    asyncio.run(scenario(state))
    assert generations == sorted(set(generations)) and len(generations) == 300


def test_the_log_numbers_registrations_and_refuses_a_stale_mount():
    state = new_state()
    assert state.apply(c.NodeUp(1, "n1", "c", "p")) == 1
    state.apply(c.MountSegment(c.segment_id_of(1, 0, 1), "n1/0", "n1", 4096, 64, 8))
    state.apply(c.NodeDown(1))
    assert state.apply(c.NodeUp(1, "n1", "c", "p")) == 2
    # The first registration's mount, committed late, after the second NodeUp: refused.
    with pytest.raises(MooncakedError) as refused:
        state.apply(c.MountSegment(c.segment_id_of(1, 1, 1), "n1/1", "n1", 4096, 64, 8))
    assert refused.value.code == ErrorCode.INVALID_PARAMS
    state.apply(c.MountSegment(c.segment_id_of(1, 1, 2), "n1/1", "n1", 4096, 64, 8))
    assert list(state.segments) == [c.segment_id_of(1, 1, 2)]
    restored = new_state()
    restored.restore(state.snapshot())
    assert restored.apply(c.NodeUp(1, "n1", "c", "p")) == 3
    assert restored.apply(c.NodeUp(2, "n2", "c", "p")) == 1  # each node counts its own


def test_the_generation_is_wide_and_the_old_layout_still_decodes():
    segment_id = c.segment_id_of(65535, 255, c.MAX_GENERATION)
    assert segment_id < 1 << 63  # a msgpack int every client reads
    assert c.node_of_segment(segment_id) == 65535 and c.slot_of_segment(segment_id) == 255
    assert c.generation_of_segment(segment_id) == c.MAX_GENERATION
    assert c.MAX_GENERATION == (1 << 32) - 1
    with pytest.raises(ValueError):
        c.segment_id_of(1, 0, c.MAX_GENERATION + 1)
    # A log written with the 8-bit layout (node << 16 | generation << 8 | index): its
    # segments still belong to their node, so the node's NodeUp drops them.
    old = (7 << 16) | (200 << 8) | 1
    assert c.node_of_segment(old) == 7 and c.slot_of_segment(old) == 1
    assert c.generation_of_segment(old) is None
    state = new_state()
    state.apply(c.NodeUp(7, "n7", "c", "p"))
    state.apply(c.MountSegment(old, "n7/1", "n7", 4096, 64, 8))
    assert state.apply(c.NodeUp(7, "n7", "c", "p")) == 2 and not state.segments


def test_a_registration_must_be_a_node_up_then_that_nodes_mounts():
    from mooncaked.cluster import meta_requests
    up = codec.encode(c.NodeUp(2, "n2", "a", "b"))
    mine = codec.encode(c.MountSegment(c.segment_id_of(2, 0), "n2/0", "n2", 4096, 64, 8))
    other = codec.encode(c.MountSegment(c.segment_id_of(3, 0), "n3/0", "n3", 4096, 64, 8))
    meta_requests.check("register", [[up, mine]])
    for bad in ([], [mine], [up, other], [mine, up], [up, up]):
        with pytest.raises(MooncakedError) as refused:
            meta_requests.check("register", [bad])
        assert refused.value.code == ErrorCode.INVALID_PARAMS

