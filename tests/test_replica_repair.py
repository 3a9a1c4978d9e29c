"""Replica repair in the state machine: AddReplicas and the replica_num a version keeps.

Method: a state machine with three nodes of one segment each (real native allocators). A value
is put with two replicas, a node holding one is declared down, and a repair reservation
(PutStart under RESERVED_NAMESPACE) is committed into the value with AddReplicas. Checked:
the replicas and namespace usage after it, that a stale copy (the value upserted, removed or
evicted meanwhile) changes nothing at all (equal digests), the refusals, the snapshot round
trip of replica_num (old snapshots too), the codec, what the leader's repair would queue
(cluster/repair.py `under_replicated`, `repair_targets`), and the leader's repair step over a
fake service whose log applies each proposal at once (a copy, an upsert racing it, a failed
write).
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import msgpack
import pytest

from mooncaked._native import OffsetAllocator
from mooncaked.cluster.repair import ReplicaRepair, repair_targets, under_replicated
from mooncaked.config import ClusterConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec, commands as c
from mooncaked.meta.state_machine import StateMachine
from mooncaked.raft.types import Role

KEY = ("ns", "k")
SIZE = 1000


def seg(node: int) -> int:
    return c.segment_id_of(node, 0, 1)


def new_state(nodes=(1, 2, 3)) -> StateMachine:
    state = StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                         max_objects=100, put_start_discard_timeout_ms=300,
                         put_start_release_timeout_ms=1000)
    for node in nodes:
        state.apply(c.NodeUp(node, f"node{node}", f"h:{node}", f"p:{node}"))
        state.apply(c.MountSegment(seg(node), f"node{node}/0", f"node{node}", 64 * 1024, 64,
                                   1024))
    return state


def put(state, key=KEY, replicas=2, writer=1, now=0, upsert=False, on=()):
    state.apply(c.PutStart(key, SIZE, replicas, tuple(on), None, False, upsert, writer, now, 3))
    state.apply(c.PutEnd(key, writer, now, now))
    return state.readable(key)


def reserve(state, node, name="ns#repair/1", writer=77, now=5, count=1, size=SIZE):
    key = (c.RESERVED_NAMESPACE, name)
    state.apply(c.PutStart(key, size, count, (f"node{node}/0",), None, False, False, writer,
                           now, 9, "ns"))
    return key


def lose_a_replica(state):
    """Put KEY on nodes 1 and 2, declare node 1 down: one replica left, on node 2."""
    version = put(state, on=("node1/0", "node2/0"))
    state.apply(c.NodeDown(1))
    assert [r.segment_id for r in version.replicas] == [seg(2)]
    return version


def test_a_version_keeps_the_replica_num_it_was_put_with():
    state = new_state(nodes=(1, 2))
    version = put(state, replicas=3)
    assert version.replica_num == 3 and len(version.replicas) == 2
    reserved = reserve(state, 1, name="ns#0/1")
    state.apply(c.PutCommit(reserved, ("ns", "committed"), SIZE, None, False, 77, 6))
    assert state.readable(("ns", "committed")).replica_num == 1


def test_add_replicas_gives_the_version_the_reserved_copy():
    state = new_state()
    version = lose_a_replica(state)
    usage = state.usage["ns"].bytes
    reserved = reserve(state, 3)
    [copy] = state.objects[reserved].pending.replicas
    added = state.apply(c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved, 77))
    assert added == 1
    readable = state.readable(KEY)
    assert [r.segment_id for r in readable.replicas] == [seg(2), seg(3)]
    assert readable.replicas[1].offset == copy.offset
    assert reserved not in state.objects and reserved not in state.pending_order
    assert state.usage["ns"].bytes == usage + SIZE  # the copy counts once, as the value's
    state.check_invariants()


def _refused(state, command, code):
    before = state.digest()
    with pytest.raises(MooncakedError) as info:
        state.apply(command)
    assert info.value.code == code
    assert state.digest() == before  # nothing changed
    state.check_invariants()


def test_a_copy_of_a_replaced_value_is_refused_and_its_reservation_revoked():
    state = new_state()
    version = lose_a_replica(state)
    reserved = reserve(state, 3)
    put(state, writer=2, now=10, upsert=True, on=("node2/0", "node3/0"))  # a newer value
    _refused(state, c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved, 77),
             ErrorCode.INVALID_WRITE)
    assert state.readable(KEY).writer_id == 2
    state.apply(c.PutRevoke(reserved, 77))
    assert reserved not in state.objects
    state.check_invariants()


def test_a_copy_of_a_removed_or_evicted_value_is_refused():
    for end in (c.Remove(KEY, 0), c.Evict((KEY,))):
        state = new_state()
        version = lose_a_replica(state)
        reserved = reserve(state, 3)
        state.apply(end)
        _refused(state, c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved,
                                      77), ErrorCode.OBJECT_NOT_FOUND)
        # Put again by the same writer at another time: still not the version copied.
        put(state, writer=version.writer_id, now=20, on=("node2/0",))
        _refused(state, c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved,
                                      77), ErrorCode.INVALID_WRITE)


@pytest.mark.parametrize("case", ["same segment", "too many", "size", "not reserved",
                                  "other writer"])
def test_bad_copies_are_refused_without_change(case):
    state = new_state()
    version = lose_a_replica(state)
    reserved, writer, code = reserve(state, 3), 77, ErrorCode.INVALID_WRITE
    if case == "same segment":
        state.apply(c.PutRevoke(reserved, 77))
        reserved = reserve(state, 2)
    elif case == "too many":
        state.apply(c.PutRevoke(reserved, 77))
        state.apply(c.NodeUp(4, "node4", "h:4", "p:4"))
        state.apply(c.MountSegment(seg(4), "node4/0", "node4", 64 * 1024, 64, 1024))
        key = (c.RESERVED_NAMESPACE, "ns#repair/2")
        state.apply(c.PutStart(key, SIZE, 2, ("node3/0", "node4/0"), None, False, False, 77,
                               5, 9, "ns"))
        reserved = key
    elif case == "size":
        state.apply(c.PutRevoke(reserved, 77))
        reserved, code = reserve(state, 3, size=SIZE + 1), ErrorCode.INVALID_PARAMS
    elif case == "not reserved":
        put(state, key=("ns", "other"), writer=5, on=("node3/0",))
        state.apply(c.PutStart(("ns", "other"), SIZE, 1, ("node3/0",), None, False, True, 6, 7,
                               1))
        reserved, writer = ("ns", "other"), 6
    else:
        writer, code = 78, ErrorCode.ILLEGAL_CLIENT
    _refused(state, c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved,
                                  writer), code)


def test_replica_num_survives_a_snapshot_and_old_snapshots_load():
    state = new_state()
    version = lose_a_replica(state)
    data = state.snapshot()
    copy = new_state(nodes=())
    copy.restore(data)
    assert copy.readable(KEY).replica_num == 2 and copy.digest() == state.digest()
    # The same AddReplicas on both gives the same state.
    for machine in (state, copy):
        reserved = reserve(machine, 3)
        machine.apply(c.AddReplicas(KEY, version.writer_id, version.started_ms, reserved, 77))
    assert copy.digest() == state.digest()
    # Written before versions kept replica_num: four fields, the replicas they have count.
    top = msgpack.unpackb(data)
    for row in top["objects"]:
        row[6] = row[6][:4]
    old = new_state(nodes=())
    old.restore(msgpack.packb(top, use_bin_type=True))
    assert old.readable(KEY).replica_num == 1
    top["objects"][0][6] = top["objects"][0][6] + [2, 3]
    with pytest.raises(ValueError):
        new_state(nodes=()).restore(msgpack.packb(top, use_bin_type=True))


def test_add_replicas_codec_round_trip_and_checks():
    command = c.AddReplicas(KEY, 1 << 50, 123, (c.RESERVED_NAMESPACE, "ns#repair/9"), 7)
    data = codec.encode(command)
    assert codec.decode(data) == command
    assert msgpack.unpackb(data)[0] == codec.TAGS[c.AddReplicas] == 13
    for bad in (c.AddReplicas(KEY, "1", 2, ("a", "b"), 3),
                c.AddReplicas(KEY, 1, 2, ("a",), 3),
                c.AddReplicas(KEY, 1, 2, ("a", "b"), None)):
        with pytest.raises(ValueError):
            codec.encode(bad)
    fields = msgpack.unpackb(data)
    for broken in (fields[:-1], fields + [1]):
        with pytest.raises(ValueError):
            codec.decode(msgpack.packb(broken))


def test_repair_queues_values_that_lost_a_replica_and_targets_other_nodes():
    state = new_state()
    version = lose_a_replica(state)
    put(state, key=("ns", "one"), replicas=1, writer=3, on=("node2/0",))
    put(state, key=("ns", "full"), replicas=2, writer=4, on=("node2/0", "node3/0"))
    assert under_replicated(state) == [KEY]
    missing, targets = repair_targets(state, KEY, version)
    assert missing == 1 and [s.segment_id for s in targets] == [seg(3)]
    # With node 3 down too, no node without a replica is left: nothing to queue.
    state.apply(c.NodeDown(3))
    assert under_replicated(state) == []
    assert repair_targets(state, KEY, state.readable(KEY))[0] == 0


# -- the leader's repair step (cluster/repair.py ReplicaRepair._repair), over a fake service -

class FakeRaft:
    """Applies each proposal at once (through the codec, as the log would)."""

    def __init__(self, state: StateMachine) -> None:
        self.state = state
        self.role = Role.LEADER
        self.core = SimpleNamespace(term=1)
        self.proposed: list = []

    def propose(self, command):
        future = asyncio.get_running_loop().create_future()
        self.proposed.append(command)
        try:
            future.set_result(self.state.apply(codec.decode(codec.encode(command))))
        except MooncakedError as exc:
            future.set_exception(exc)
        return future


class FakeService:
    def __init__(self, state: StateMachine, during_write=None) -> None:
        self.node_id = 2
        self.put_attempts = 0
        self.cluster_config = ClusterConfig()
        self.raft = FakeRaft(state)
        self.master = SimpleNamespace(now_ms=lambda: 50, _rng=random.Random(1))
        self.daemon = SimpleNamespace(master=SimpleNamespace(state=state))
        self.during_write = during_write
        self.written: list = []

    async def read_replica_bytes(self, replicas, size):
        return b"v" * size

    async def write_replicas(self, replicas, payload):
        self.written.append(([r.segment_id for r in replicas], bytes(payload)))
        if self.during_write is not None:
            self.during_write()


def run_repair(service) -> ReplicaRepair:
    repair = ReplicaRepair(service)
    repair._term = 1
    asyncio.run(repair._repair(1, KEY))
    return repair


def reservations(state):
    return [k for k in state.objects if k[0] == c.RESERVED_NAMESPACE]


def test_the_repair_step_copies_to_a_node_without_a_replica():
    state = new_state()
    lose_a_replica(state)
    service = FakeService(state)
    repair = run_repair(service)
    assert service.written == [([seg(3)], b"v" * SIZE)]
    assert [r.segment_id for r in state.readable(KEY).replicas] == [seg(2), seg(3)]
    assert repair.stats["objects_repaired"] == 1 and repair.stats["replicas_added"] == 1
    assert repair.stats["bytes_copied"] == SIZE and not reservations(state)
    state.check_invariants()


def test_the_repair_step_never_undoes_an_upsert_made_while_it_copied():
    state = new_state()
    lose_a_replica(state)
    service = FakeService(state, during_write=lambda: put(
        state, writer=9, now=30, upsert=True, on=("node2/0", "node3/0")))
    repair = run_repair(service)
    assert type(service.raft.proposed[-2]) is c.AddReplicas  # refused, then revoked
    assert type(service.raft.proposed[-1]) is c.PutRevoke
    assert state.readable(KEY).writer_id == 9 and len(state.readable(KEY).replicas) == 2
    assert repair.stats["superseded"] == 1 and repair.stats["objects_repaired"] == 0
    assert not reservations(state)
    state.check_invariants()


def test_a_failed_copy_revokes_its_reservation_with_a_hold():
    state = new_state()
    lose_a_replica(state)

    def fail():
        raise MooncakedError(ErrorCode.TRANSFER_FAIL, "node 3 unreachable")
    service = FakeService(state, during_write=fail)
    with pytest.raises(MooncakedError):
        run_repair(service)
    assert not reservations(state) and state.deferred_bytes > 0  # held, not reused at once
    assert len(state.readable(KEY).replicas) == 1
    state.check_invariants()


def test_copies_are_spaced_to_keep_under_the_byte_rate(monkeypatch):
    """_throttle: each copy's bytes push the next start by bytes / repair_bytes_per_s; a copy
    waits only for what earlier copies used (a fake clock: nothing is timed)."""
    import mooncaked.cluster.repair as repair_module
    now, slept = [100.0], []

    async def fake_sleep(seconds):
        slept.append(seconds)
        now[0] += seconds
    monkeypatch.setattr(repair_module.environment, "monotonic", lambda: now[0])
    monkeypatch.setattr(repair_module.asyncio, "sleep", fake_sleep)
    repair = ReplicaRepair(FakeService(new_state()))
    repair.bytes_per_s = 1000

    async def copies():
        await repair._throttle(500)   # the first goes at once
        await repair._throttle(1000)  # waits for the first's 0.5 s
        now[0] += 5.0                 # idle: unused time is not saved up
        await repair._throttle(2000)
        await repair._throttle(10)    # waits for the previous copy's 2 s
    asyncio.run(copies())
    assert slept == [0.5, 2.0]
