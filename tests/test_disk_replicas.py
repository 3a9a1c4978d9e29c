"""Disk copies in the metadata: AddDiskReplica, DropDiskReplica, eviction to disk, node down,
snapshots, and the master's eviction order (meta/state_machine.py, meta/master.py)."""

from __future__ import annotations

import msgpack
import pytest

from mooncaked._native import OffsetAllocator
from mooncaked.config import StoreConfig
from mooncaked.meta import codec, commands as c
from mooncaked.meta.master import Master, ReplicateConfig
from mooncaked.meta.state_machine import StateMachine

KEY = ("ns", "k")


def new_master(capacity=64 * 1024) -> Master:
    state = StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                         max_objects=100, put_start_discard_timeout_ms=300,
                         put_start_release_timeout_ms=1000)
    state.apply(c.MountSegment(0, "seg0", "node", capacity, 64, 1024))
    return Master(state, StoreConfig(lease_ttl_ms=100), seed=7)


def put(master: Master, key=KEY, size=1000, now=0, writer=1, upsert=False):
    master.put_start(key, size, ReplicateConfig(), upsert, writer, now)
    master.put_end(key, writer, now)
    return master.state.readable(key)


def add_disk(master, key=KEY, region=1, offset=0, node=0, **change):
    version = master.state.readable(key)
    fields = dict(writer_id=version.writer_id, started_ms=version.started_ms,
                  size_bytes=version.size_bytes)
    fields.update(change)
    return master.propose(c.AddDiskReplica(key, fields["writer_id"], fields["started_ms"], node,
                                           region, offset, fields["size_bytes"], 77))


def test_a_disk_copy_is_recorded_only_for_the_version_written():
    master = new_master()
    put(master)
    assert not add_disk(master, writer_id=2)
    assert not add_disk(master, started_ms=5)
    assert not add_disk(master, size_bytes=999)
    assert add_disk(master)
    assert not add_disk(master, region=2)  # it has one already
    disk = master.state.readable(KEY).disk
    assert (disk.node_id, disk.region, disk.offset, disk.size_bytes, disk.disk_version) == \
        (0, 1, 0, 1000, 77)
    assert not master.propose(c.AddDiskReplica(("ns", "none"), 1, 0, 0, 1, 0, 10, 1))
    master.state.check_invariants()


def test_eviction_frees_the_dram_of_a_version_with_a_disk_copy_and_it_stays_readable():
    master = new_master()
    put(master)
    add_disk(master)
    used = master.state.used_bytes()
    assert master.propose(c.Evict((KEY,))) > 0
    version = master.state.readable(KEY)
    assert version is not None and version.replicas == [] and version.disk is not None
    assert master.state.used_bytes() < used
    assert master.state.usage["ns"].bytes == 0 and master.state.usage["ns"].objects == 1
    assert master.propose(c.Evict((KEY,))) == 0  # disk-only: eviction has nothing to free
    assert master.state.readable(KEY) is not None
    master.state.check_invariants()


def test_dropping_the_disk_copy_of_a_disk_only_version_drops_the_object():
    master = new_master()
    put(master)
    add_disk(master, region=3, offset=4096)
    master.propose(c.Evict((KEY,)))
    assert not master.propose(c.DropDiskReplica(KEY, 0, 3, 0))  # another record
    assert not master.propose(c.DropDiskReplica(KEY, 1, 3, 4096))  # another node's
    assert master.propose(c.DropDiskReplica(KEY, 0, 3, 4096))
    assert KEY not in master.state.objects and "ns" not in master.state.usage
    master.state.check_invariants()


def test_dropping_the_disk_copy_of_a_version_in_dram_keeps_it():
    master = new_master()
    put(master)
    add_disk(master)
    assert master.propose(c.DropDiskReplica(KEY, 0, 1, 0))
    assert master.state.readable(KEY).replicas and master.state.readable(KEY).disk is None


def test_a_recovered_record_becomes_a_disk_only_object_only_where_the_key_is_free():
    master = new_master()
    put(master)
    assert not master.propose(c.AddDiskReplica(KEY, 0, 5, 0, 1, 0, 1000, 9, True))
    assert master.propose(c.AddDiskReplica(("ns", "back"), 0, 5, 0, 1, 0, 300, 9, True))
    back = master.state.readable(("ns", "back"))
    assert back.replicas == [] and back.size_bytes == 300 and back.disk.disk_version == 9
    assert not master.propose(c.AddDiskReplica((c.RESERVED_NAMESPACE, "x"), 0, 5, 0, 1, 0, 3,
                                               9, True))
    master.state.check_invariants()


def test_remove_and_upsert_hand_the_replaced_version_with_its_disk_copy_to_the_caller():
    master = new_master()
    master.released = []
    put(master)
    add_disk(master)
    put(master, upsert=True, writer=2, now=1)
    (key, replaced), = master.released
    assert key == KEY and replaced.disk is not None and replaced.writer_id == 1
    master.released.clear()
    master.remove(KEY, True, 2)
    assert master.released[0][0] == KEY and master.released[0][1].disk is None
    master.state.check_invariants()


def test_eviction_takes_objects_with_a_disk_copy_first_and_never_one_being_written():
    master = new_master(capacity=16 * 1024)
    master.tiered = True
    keys = [("ns", f"k{i}") for i in range(14)]
    for i, key in enumerate(keys):
        put(master, key, size=1024, now=i, writer=i + 1)
    for key in keys[10:12]:
        add_disk(master, key, region=int(key[1][1:]))
    master.offloading.add(keys[0])
    chosen = master.choose_evictions(10_000, need_bytes=3 * 1024)
    assert chosen[:2] == keys[10:12]
    assert keys[0] not in chosen
    master.evict(10_000, need_bytes=3 * 1024)
    assert master.evictions.to_disk == 2 and master.evictions.without_offload >= 1
    assert all(master.state.readable(k) is not None for k in keys[10:12])


def test_a_node_declared_down_loses_its_disk_copies():
    master = new_master()
    state = master.state
    state.apply(c.NodeUp(3, "n3", "h:1", "h:2"))
    put(master)
    add_disk(master, node=3)
    assert master.propose(c.AddDiskReplica(("ns", "only"), 0, 1, 3, 2, 0, 10, 1, True))
    state.apply(c.NodeDown(3))
    assert state.readable(KEY).disk is None and state.readable(KEY).replicas
    assert ("ns", "only") not in state.objects
    assert not master.propose(c.AddDiskReplica(("ns", "only"), 0, 1, 3, 2, 0, 10, 1, True))
    state.check_invariants()


def test_disk_copies_survive_a_snapshot_and_format_4_still_restores():
    master = new_master()
    put(master)
    add_disk(master)
    master.propose(c.AddDiskReplica(("ns", "only"), 0, 1, 0, 2, 0, 10, 1, True))
    snapshot = master.state.snapshot()
    other = new_master()
    other.state.restore(snapshot)
    assert other.state.snapshot() == snapshot
    assert other.state.readable(("ns", "only")).disk.region == 2
    other.state.check_invariants()
    top = msgpack.unpackb(snapshot, use_list=True)
    assert top["format"] == 5
    old = new_master()
    put(old)
    old_top = msgpack.unpackb(old.state.snapshot(), use_list=True)
    old_top["format"] = 4
    for row in old_top["objects"]:
        row[6] = row[6][:5]
    restored = new_master()
    restored.state.restore(msgpack.packb(old_top, use_bin_type=True))
    assert restored.state.readable(KEY).disk is None
    restored.state.check_invariants()


@pytest.mark.parametrize("command", [
    c.AddDiskReplica(KEY, 1, 2, 0, 3, 4096, 10, 99),
    c.AddDiskReplica(KEY, 0, 2, 5, 3, 0, 10, 1 << 63, True),
    c.DropDiskReplica(KEY, 0, 3, 4096),
])
def test_disk_commands_round_trip_through_the_codec(command):
    assert codec.decode(codec.encode(command)) == command


def test_disk_commands_with_bad_fields_are_refused_by_the_codec():
    with pytest.raises(ValueError):
        codec.encode(c.AddDiskReplica(KEY, 1, 2, 0, 3, 4096, 10, 99, recovered=1))
    with pytest.raises(ValueError):
        codec.encode(c.DropDiskReplica(KEY, 0, "3", 4096))
    with pytest.raises(ValueError):
        codec.decode(msgpack.packb([22, ["ns", "k"], 1, 2, 0, 3]))
    assert codec.TAGS[c.AddDiskReplica] == 22 and codec.TAGS[c.DropDiskReplica] == 23


def test_objects_being_written_to_disk_are_evicted_last_when_nothing_else_frees_enough():
    master = new_master(capacity=8 * 1024)
    master.tiered = True
    keys = [("ns", f"k{i}") for i in range(8)]
    for i, key in enumerate(keys):
        put(master, key, size=1024, now=i, writer=i + 1)
    master.offloading.update(keys)
    chosen = master.choose_evictions(10_000, need_bytes=2048)
    assert chosen == keys[:2]  # a put is not refused while values are written to disk
    master.offloading.difference_update(keys[4:])
    assert master.choose_evictions(10_000, need_bytes=2048) == keys[4:6]
