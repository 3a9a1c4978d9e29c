"""The metadata state machine and the master, without I/O: random command sequences.

Method: hypothesis drives random puts, ends, revokes, upserts, removes, reads, evictions and
clock steps against a Master over the real native allocator, and a dumb model of what readers
may see. After every step the state machine's own invariants hold (no overlapping ranges,
every range owned once) and readers see exactly the model's values. Determinism: the same
commands applied to a second state machine give the same tables.
"""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncaked._native import OffsetAllocator
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec, commands as c
from mooncaked.meta.master import Master, ReplicateConfig
from mooncaked.meta.state_machine import StateMachine

KEYS = [("ns", f"k{i}") for i in range(6)] + [("other", "k0")]


def new_master(max_objects=1000, capacity=64 * 1024, segments=2, **store) -> Master:
    state = StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                         max_objects=max_objects, put_start_discard_timeout_ms=300,
                         put_start_release_timeout_ms=1000)
    for i in range(segments):
        state.apply(c.MountSegment(i, f"seg{i}", "node", capacity, 64, 1024))
    config = StoreConfig(lease_ttl_ms=100, **store)
    return Master(state, config, seed=7)


class MasterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.master = new_master()
        self.now = 0
        self.visible: dict = {}  # key -> size readers may see (None: maybe evicted)
        self.writing: dict = {}  # key -> (writer, size)
        self.reserved: dict = {}  # reservation key -> (writer, size)
        self.reservation_names = 0

    @rule(key=st.sampled_from(KEYS), size=st.integers(1, 20000), writer=st.integers(1, 3),
          upsert=st.booleans(), replicas=st.integers(1, 3))
    def put_start(self, key, size, writer, upsert, replicas):
        try:
            placed = self.master.put_start(key, size, ReplicateConfig(replica_num=replicas),
                                           upsert, writer, self.now)
        except MooncakedError as exc:
            assert exc.code in (ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.NO_AVAILABLE_HANDLE)
            if exc.code == ErrorCode.OBJECT_ALREADY_EXISTS:
                assert not upsert and (key in self.visible or key in self.writing)
            self._forget_evicted()
            return
        assert 1 <= len(placed) <= replicas
        self._forget_evicted()
        self.writing[key] = (writer, size)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), revoke=st.booleans())
    def finish(self, data, revoke):
        key = data.draw(st.sampled_from(sorted(self.writing)))
        writer, size = self.writing.pop(key)
        if revoke:
            self.master.put_revoke(key, writer)
        else:
            self.master.put_end(key, writer, self.now)
            self.visible[key] = size

    @rule(size=st.integers(1, 20000), writer=st.integers(1, 3))
    def reserve(self, size, writer):
        self.reservation_names += 1
        reserved_key = (c.RESERVED_NAMESPACE, f"{writer}/{self.reservation_names}")
        try:
            self.master.put_start(reserved_key, size, ReplicateConfig(), False, writer, self.now)
        except MooncakedError as exc:
            assert exc.code == ErrorCode.NO_AVAILABLE_HANDLE
            self._forget_evicted()
            return
        self._forget_evicted()
        self.reserved[reserved_key] = (writer, size)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def commit(self, data, key):
        reserved_key = data.draw(st.sampled_from(sorted(self.reserved)))
        writer, size = self.reserved[reserved_key]
        try:
            self.master.put_commit(reserved_key, key, size, ReplicateConfig(), writer, self.now)
        except MooncakedError as exc:
            assert exc.code == ErrorCode.OBJECT_ALREADY_EXISTS
            assert key in self.visible or key in self.writing
            assert self.master.state.objects[reserved_key].pending.size_bytes == size  # kept
            return
        del self.reserved[reserved_key]
        self.writing.pop(key, None)  # a stale unfinished put of the key was preempted
        self.visible[key] = size
        assert reserved_key not in self.master.state.objects

    @rule(key=st.sampled_from(KEYS), force=st.booleans())
    def remove(self, key, force):
        try:
            self.master.remove(key, force, self.now)
        except MooncakedError as exc:
            assert exc.code in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_HAS_LEASE,
                                ErrorCode.REPLICA_IS_NOT_READY)
            if exc.code == ErrorCode.OBJECT_HAS_LEASE:
                assert not force and self.master.leased(key, self.now)
            return
        assert key in self.visible
        del self.visible[key]
        self.writing.pop(key, None)  # an upsert in flight lost its key

    @rule(key=st.sampled_from(KEYS))
    def read(self, key):
        version = self.master.get(key, self.now)
        if key in self.visible:
            assert version is not None and version.size_bytes == self.visible[key]
        else:
            assert version is None

    @rule(step_ms=st.integers(1, 700))
    def advance(self, step_ms):
        self.now += step_ms
        self.master.tick(self.now)
        # Unfinished writes past the release timeout were revoked.
        for table in (self.writing, self.reserved):
            for key in list(table):
                entry = self.master.state.objects.get(key)
                if entry is None or entry.pending is None:
                    del table[key]
        self._forget_evicted()

    def _forget_evicted(self):
        for key in list(self.visible):
            if self.master.state.readable(key) is None:
                del self.visible[key]

    @invariant()
    def consistent(self):
        self.master.state.check_invariants()
        for key, size in self.visible.items():
            assert self.master.state.readable(key).size_bytes == size


TestMasterMachine = MasterMachine.TestCase
TestMasterMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_same_commands_give_the_same_state():
    def run() -> list:
        state = StateMachine(lambda s, a, n: OffsetAllocator(s, a, n), max_objects=100,
                             put_start_discard_timeout_ms=10, put_start_release_timeout_ms=20)
        for i in range(3):
            state.apply(c.MountSegment(i, f"s{i}", "n", 1 << 20, 64, 100))
        for i in range(30):
            key = ("ns", f"k{i % 7}")
            try:
                state.apply(c.PutStart(key, 1000 + i, 2, (), None, False, i % 3 == 0, 1, i, i))
                if i % 4:
                    state.apply(c.PutEnd(key, 1, i, i))
            except MooncakedError:
                pass
            state.apply(c.ReleaseExpired(i))
        return sorted((key, [(r.segment_id, r.offset) for r in entry.complete.replicas])
                      for key, entry in state.objects.items() if entry.complete)
    assert run() == run()


def test_eviction_prefers_unpinned_and_never_takes_leased():
    master = new_master(segments=1, capacity=8 * 1024, eviction_high_watermark_ratio=0.5,
                        eviction_ratio=0.3)
    for name, config in (("soft", ReplicateConfig(soft_pin_ttl_ms=10 ** 6)),
                         ("hard", ReplicateConfig(hard_pin=True)), ("a", ReplicateConfig()),
                         ("b", ReplicateConfig()), ("leased", ReplicateConfig())):
        key = ("ns", name)
        master.put_start(key, 1024, config, False, 1, 0)
        master.put_end(key, 1, 0)
    master.get(("ns", "leased"), 1)  # leased until 101
    evicted = master.evict(50)
    assert evicted >= 1
    assert master.state.readable(("ns", "leased")) is not None
    assert master.state.readable(("ns", "hard")) is not None
    assert master.state.readable(("ns", "a")) is None  # oldest unpinned first
    # Force a large need: soft-pinned objects go in the second pass, hard/leased never.
    master.evict(60, need_bytes=10 * 1024)
    assert master.state.readable(("ns", "soft")) is None
    assert master.state.readable(("ns", "hard")) is not None
    assert master.state.readable(("ns", "leased")) is not None


def test_object_table_bound_is_enforced():
    master = new_master(max_objects=2)
    for name in ("a", "b"):
        master.put_start(("ns", name), 10, ReplicateConfig(hard_pin=True), False, 1, 0)
    with pytest.raises(MooncakedError) as info:
        master.put_start(("ns", "c"), 10, ReplicateConfig(), False, 1, 0)
    assert info.value.code == ErrorCode.NO_AVAILABLE_HANDLE


# -- reservations: PutStart under RESERVED_NAMESPACE, then PutCommit -----------------------

RESERVED = (c.RESERVED_NAMESPACE, "1/1")


def _reserve(state: StateMachine, size=1000, writer=1, now=0, name=RESERVED):
    return state.apply(c.PutStart(name, size, 1, (), None, False, False, writer, now, 5))


def _commit(state, key, size=1000, writer=1, now=10, name=RESERVED, soft_pin_ttl_ms=None,
            hard_pin=False):
    return state.apply(c.PutCommit(name, key, size, soft_pin_ttl_ms, hard_pin, writer, now))


def test_commit_moves_the_reserved_range_to_the_key():
    state = new_master().state
    [replica] = _reserve(state)
    used = state.used_bytes()
    _commit(state, ("ns", "a"), hard_pin=True, soft_pin_ttl_ms=50)
    assert RESERVED not in state.objects and RESERVED not in state.pending_order
    version = state.readable(("ns", "a"))
    assert (version.size_bytes, version.replicas[0].offset) == (1000, replica.offset)
    entry = state.objects[("ns", "a")]
    assert entry.hard_pin and entry.soft_pin_deadline_ms == 60 and entry.pending is None
    assert state.used_bytes() == used  # the same range, now the object's
    state.check_invariants()


def test_commit_of_an_existing_key_changes_nothing():
    state = new_master().state
    _reserve(state, name=(c.RESERVED_NAMESPACE, "1/0"))
    _commit(state, ("ns", "a"), name=(c.RESERVED_NAMESPACE, "1/0"))
    _reserve(state)
    state.apply(c.PutStart(("ns", "w"), 10, 1, (), None, False, False, 2, 0, 1))  # writing
    before = state.digest()
    for key in (("ns", "a"), ("ns", "w")):
        with pytest.raises(MooncakedError) as info:
            _commit(state, key)
        assert info.value.code == ErrorCode.OBJECT_ALREADY_EXISTS
        assert state.digest() == before
    _commit(state, ("ns", "b"))  # the range is still the writer's, for another key
    assert state.readable(("ns", "b")).size_bytes == 1000
    state.check_invariants()


def test_commit_preempts_a_stale_unfinished_put():
    state = new_master().state  # discard timeout 300 ms, release timeout 1000 ms
    state.apply(c.PutStart(("ns", "a"), 10, 1, (), None, False, False, 2, 0, 1))
    _reserve(state, now=100)
    _commit(state, ("ns", "a"), now=400)
    assert state.readable(("ns", "a")).size_bytes == 1000
    assert ("ns", "a") not in state.pending_order
    assert state.deferred_bytes > 0  # the stale writer's range waits for its release timeout
    state.check_invariants()


@pytest.mark.parametrize("change, code", [
    ({"size": 999}, ErrorCode.INVALID_PARAMS),
    ({"writer": 2}, ErrorCode.ILLEGAL_CLIENT),
    ({"name": (c.RESERVED_NAMESPACE, "nope")}, ErrorCode.OBJECT_NOT_FOUND),
    ({"name": ("ns", "pending")}, ErrorCode.INVALID_WRITE),  # not a reservation
])
def test_bad_commits_are_refused_without_change(change, code):
    state = new_master().state
    _reserve(state)
    state.apply(c.PutStart(("ns", "pending"), 1000, 1, (), None, False, False, 1, 0, 1))
    before = state.digest()
    with pytest.raises(MooncakedError) as info:
        _commit(state, ("ns", "a"), now=0, **change)  # now=0: the clock stays as it was
    assert info.value.code == code
    assert state.digest() == before


def test_unused_reservations_are_released_by_the_sweep():
    master = new_master()
    _reserve(master.state, now=0)
    assert master.state.used_bytes() > 0
    assert master.tick(999) == 0
    assert master.tick(1000) == 1  # put_start_release_timeout_ms
    assert master.state.used_bytes() == 0 and not master.state.objects
    with pytest.raises(MooncakedError) as info:
        _commit(master.state, ("ns", "a"), now=1001)
    assert info.value.code == ErrorCode.OBJECT_NOT_FOUND


def test_reserved_ranges_are_never_evicted():
    master = new_master(segments=1, capacity=8 * 1024)
    for i in range(6):
        _reserve(master.state, size=1024, name=(c.RESERVED_NAMESPACE, f"1/{i}"))
    assert master.evict(10, need_bytes=4096) == 0
    assert len(master.state.objects) == 6


def test_master_commit_needs_one_replica_and_orders_access():
    master = new_master()
    _reserve(master.state)
    with pytest.raises(MooncakedError) as info:
        master.put_commit(RESERVED, ("ns", "a"), 1000, ReplicateConfig(replica_num=2), 1, 5)
    assert info.value.code == ErrorCode.INVALID_PARAMS
    master.put_commit(RESERVED, ("ns", "a"), 1000, ReplicateConfig(), 1, 5)
    assert master.access[("ns", "a")] == 5  # evictable like any completed put


def _random_commands(seed: int, count: int) -> list:
    """Reservations, commits, puts, removes and sweeps, generated against a reference run."""
    rng = random.Random(seed)
    reference = new_master().state
    commands, now, names = [], 0, 0
    for _ in range(count):
        now += rng.choice([0, 1, 10, 100, 400])
        reserved = [k for k in reference.objects if k[0] == c.RESERVED_NAMESPACE]
        roll = rng.random()
        if roll < 0.35:
            names += 1
            command = c.PutStart((c.RESERVED_NAMESPACE, f"1/{names}"), rng.randint(1, 9000), 1,
                                 (), None, False, False, rng.randint(1, 2), now,
                                 rng.getrandbits(32))
        elif roll < 0.7 and reserved:
            name = rng.choice(reserved)
            pending = reference.objects[name].pending
            size = pending.size_bytes if rng.random() < 0.9 else pending.size_bytes + 1
            command = c.PutCommit(name, ("ns", f"k{rng.randrange(8)}"), size,
                                  rng.choice([None, 50]), rng.random() < 0.2,
                                  pending.writer_id, now)
        elif roll < 0.8:
            command = c.PutStart(("ns", f"k{rng.randrange(8)}"), rng.randint(1, 9000), 1, (),
                                 None, False, False, 3, now, rng.getrandbits(32))
        elif roll < 0.9 and reference.objects:
            command = c.Remove(rng.choice(list(reference.objects)), now + 50)
        else:
            command = c.ReleaseExpired(now)
        try:
            reference.apply(command)
        except MooncakedError:
            pass
        commands.append(command)
    return commands


def _outcome(state, command):
    try:
        state.apply(command)
        return "ok"
    except MooncakedError as exc:
        return exc.code


@pytest.mark.parametrize("seed", range(6))
def test_commits_replay_identically_after_a_snapshot(seed):
    commands = _random_commands(seed, 300)
    split = random.Random(seed).randrange(len(commands))
    leader = new_master().state
    outcomes = [_outcome(leader, command) for command in commands[:split]]
    follower = new_master(segments=1).state
    follower.restore(leader.snapshot())
    assert follower.digest() == leader.digest()
    for command in commands[split:]:
        outcomes.append(_outcome(leader, command))
        assert _outcome(follower, command) == outcomes[-1], command
        follower.check_invariants()
        assert follower.digest() == leader.digest()
    assert outcomes.count("ok") > 100
    assert any(type(cmd) is c.PutCommit and o == "ok" for cmd, o in zip(commands, outcomes))


def test_put_commit_codec_round_trip_and_checks():
    command = c.PutCommit((c.RESERVED_NAMESPACE, "7/3"), ("ns", "key"), 4096, None, True, 7, 99)
    data = codec.encode(command)
    assert codec.decode(data) == command
    assert msgpack.unpackb(data)[0] == 11  # the tag is part of the log format
    pinned = c.PutCommit((c.RESERVED_NAMESPACE, "7/3"), ("ns", "key"), 1, 500, False, 7, 99)
    assert codec.decode(codec.encode(pinned)) == pinned
    bad = msgpack.unpackb(data, use_list=True)
    for index, value in ((1, "not a key"), (2, ["ns"]), (3, "4096"), (4, "x"), (5, 1),
                         (6, None), (7, 1.5)):
        broken = list(bad)
        broken[index] = value
        with pytest.raises(ValueError):
            codec.decode(msgpack.packb(broken))
    with pytest.raises(ValueError):
        codec.decode(msgpack.packb(bad[:-1]))


def test_encode_checked_gives_what_every_node_decodes():
    # A leader applies the second half instead of decoding its own bytes: it must be the
    # decoded command (tuples where the proposal had lists), for a Batch too.
    proposed = c.PutCommit((c.RESERVED_NAMESPACE, "7/3"), ["ns", "key"], 4096, None, True, 7, 99)
    data, checked = codec.encode_checked(proposed)
    assert data == codec.encode(proposed)
    assert checked == codec.decode(data) and type(checked.object_key) is tuple
    batch = c.Batch((proposed, c.ReleaseExpired(5)))
    data, checked = codec.encode_checked(batch)
    assert data == codec.encode(batch) and checked == codec.decode(data)
    with pytest.raises(ValueError):
        codec.encode_checked(c.Batch((batch,)))


# -- namespace pools ------------------------------------------------------------------------------

def pooled_master() -> Master:
    """Two shared segments (0, 1) and a pool of namespace "a" (segment 2)."""
    master = new_master(capacity=64 * 1024, segments=2)
    master.state.apply(c.MountSegment(2, "pool-a", "node", 64 * 1024, 64, 1024, "a"))
    return master


def test_objects_lie_in_their_namespaces_pool():
    master = pooled_master()
    state = master.state
    assert state.pool_of("a") == "a" and state.pool_of("b") == c.SHARED_POOL
    for i in range(20):
        for namespace in ("a", "b"):
            replicas = master.put_start((namespace, f"k{i}"), 512,
                                        ReplicateConfig(replica_num=3), False, 1, i)
            ids = {r.segment_id for r in replicas}
            # preferred segments of another pool are ignored, replica_num is best effort
            assert ids == {2} if namespace == "a" else ids <= {0, 1}
            master.put_end((namespace, f"k{i}"), 1, i)
    reserved = master.put_start((c.RESERVED_NAMESPACE, "1/1"), 64, ReplicateConfig(), False,
                                1, 50, owner_namespace="a")
    assert [r.segment_id for r in reserved] == [2]
    state.check_invariants()


def test_a_reservation_commits_only_into_its_pool():
    master = pooled_master()
    master.put_start((c.RESERVED_NAMESPACE, "1/1"), 64, ReplicateConfig(), False, 1, 0,
                     owner_namespace="b")
    with pytest.raises(MooncakedError) as info:
        master.put_commit((c.RESERVED_NAMESPACE, "1/1"), ("a", "k"), 64, ReplicateConfig(), 1, 1)
    assert info.value.code == ErrorCode.INVALID_WRITE
    assert master.state.readable(("a", "k")) is None
    master.put_commit((c.RESERVED_NAMESPACE, "1/1"), ("b", "k"), 64, ReplicateConfig(), 1, 1)
    master.state.check_invariants()


def test_eviction_for_a_full_pool_takes_only_that_pools_objects():
    master = pooled_master()
    for i in range(8):
        master.put_start(("b", f"k{i}"), 4096, ReplicateConfig(), False, 1, i)
        master.put_end(("b", f"k{i}"), 1, i)
    for i in range(64):  # four times the pool
        master.put_start(("a", f"k{i}"), 4096, ReplicateConfig(), False, 1, 1000 + i)
        master.put_end(("a", f"k{i}"), 1, 1000 + i)
    assert all(master.state.readable(("b", f"k{i}")) for i in range(8))
    master.tick(10_000)
    assert all(master.state.readable(("b", f"k{i}")) for i in range(8))
    master.state.check_invariants()


def test_pools_survive_a_snapshot_and_old_snapshots_load():
    master = pooled_master()
    master.put_start(("a", "k"), 64, ReplicateConfig(), False, 1, 0)
    data = master.state.snapshot()
    copy = new_master(segments=0).state
    copy.restore(data)
    assert copy.segments[2].pool_namespace == "a" and copy.pool_of("a") == "a"
    assert copy.digest() == master.state.digest()
    top = msgpack.unpackb(data)
    top["segments"] = [row[:6] for row in top["segments"] if row[6] == ""]
    top["segment_list"] = [0, 1]
    top["objects"], top["pending_order"] = [], []
    old = new_master(segments=0).state
    old.restore(msgpack.packb(top, use_bin_type=True))
    assert old.pool_namespaces == set() and len(old.segment_list) == 2


def test_commands_written_before_pools_decode_with_the_shared_pool():
    mount = c.MountSegment(3, "s", "n", 4096, 64, 8, "tenant")
    assert codec.decode(codec.encode(mount)) == mount
    fields = msgpack.unpackb(codec.encode(mount))
    assert codec.decode(msgpack.packb(fields[:-1])) == c.MountSegment(3, "s", "n", 4096, 64, 8)
    put = c.PutStart(("ns", "k"), 1, 1, (), None, False, False, 1, 2, 3, "owner")
    assert codec.decode(codec.encode(put)) == put
    fields = msgpack.unpackb(codec.encode(put))
    assert codec.decode(msgpack.packb(fields[:-1])).owner_namespace is None
    for broken in (fields[:-2], fields[:-1] + [7], fields + ["x"]):
        with pytest.raises(ValueError):
            codec.decode(msgpack.packb(broken))


# -- concurrent upserts of one key: last writer wins, both succeed ---------------------------

KEY = ("ns", "hot")


def _upsert_start(state, writer, now, size=100, key=KEY):
    return state.apply(c.PutStart(key, size, 1, (), None, False, True, writer, now, writer))


def _end(state, writer, now, key=KEY):
    return state.apply(c.PutEnd(key, writer, now, now))


def test_a_preempted_upsert_superseded_by_a_later_one_succeeds_and_changes_nothing():
    state = new_master().state
    _upsert_start(state, 1, 0, size=100)
    _upsert_start(state, 2, 1, size=200)  # preempts writer 1
    _end(state, 2, 2)
    replicas = state.readable(KEY).replicas
    _end(state, 1, 3)  # superseded: done just before writer 2's value replaced it
    assert state.readable(KEY).size_bytes == 200
    assert state.readable(KEY).replicas == replicas
    assert not state.preempted
    state.check_invariants()


def test_a_preempted_upsert_that_ends_first_takes_effect_then_the_later_one():
    state = new_master().state
    _upsert_start(state, 1, 0, size=100)
    _upsert_start(state, 2, 1, size=200)
    _end(state, 1, 2)  # writer 2 still writing: writer 1's value becomes readable now
    assert state.readable(KEY).size_bytes == 100
    assert state.objects[KEY].pending.writer_id == 2
    state.check_invariants()
    _end(state, 2, 3)
    assert state.readable(KEY).size_bytes == 200
    state.check_invariants()
    assert state.apply(c.ReleaseExpired(5000)) >= 1
    state.check_invariants()
    assert state.deferred_bytes == 0


def test_the_ranges_of_an_ended_preempted_upsert_are_not_freed_twice():
    state = new_master().state
    _upsert_start(state, 1, 0, size=100)
    _upsert_start(state, 2, 1, size=200)
    _end(state, 1, 2)
    _end(state, 2, 3)
    state.apply(c.ReleaseExpired(10 ** 6))  # every deadline passed
    state.check_invariants()
    assert state.deferred_bytes == 0 and not state.preempted
    assert state.readable(KEY).size_bytes == 200


def test_a_preempted_upsert_whose_write_expired_fails():
    state = new_master().state  # release timeout 1000 ms
    _upsert_start(state, 1, 0)
    _upsert_start(state, 2, 1)
    _end(state, 2, 2)
    state.apply(c.ReleaseExpired(1000))  # writer 1's ranges are released: its write is void
    with pytest.raises(MooncakedError) as info:
        _end(state, 1, 1001)
    assert info.value.code == ErrorCode.INVALID_WRITE
    assert not state.preempted
    state.check_invariants()


def test_a_preempted_upsert_of_a_removed_key_fails():
    state = new_master().state
    _upsert_start(state, 1, 0)
    _upsert_start(state, 2, 1)
    _end(state, 2, 2)
    state.apply(c.Remove(KEY, 3))
    with pytest.raises(MooncakedError) as info:
        _end(state, 1, 4)
    assert info.value.code == ErrorCode.OBJECT_NOT_FOUND
    assert state.readable(KEY) is None
    state.check_invariants()


def test_a_preempted_upsert_revoked_by_its_writer_is_forgotten():
    state = new_master().state
    _upsert_start(state, 1, 0)
    _upsert_start(state, 2, 1)
    state.apply(c.PutRevoke(KEY, 1))
    assert not state.preempted
    with pytest.raises(MooncakedError):
        _end(state, 1, 2)
    state.check_invariants()


def test_a_put_preempted_by_an_upsert_still_fails():
    """Write-once puts are not replayed: a put whose key an upsert took over stored nothing."""
    state = new_master().state
    state.apply(c.PutStart(KEY, 100, 1, (), None, False, False, 1, 0, 1))
    _upsert_start(state, 2, 1)
    _end(state, 2, 2)
    with pytest.raises(MooncakedError) as info:
        _end(state, 1, 3)
    assert info.value.code == ErrorCode.INVALID_WRITE
    state.check_invariants()


def test_concurrent_upserts_in_any_order_all_succeed_and_the_last_end_is_read():
    rng = random.Random(5)
    for _ in range(200):
        master = new_master()
        state = master.state
        writers = list(range(1, rng.randint(2, 6)))
        now = 0
        for writer in writers:
            now += rng.randint(0, 3)
            master.put_start(KEY, 10 * writer, ReplicateConfig(), True, writer, now)
        order = writers[:]
        rng.shuffle(order)
        for writer in order:
            now += rng.randint(0, 3)
            master.put_end(KEY, writer, now)
            state.check_invariants()
        # Earlier writers that end before the last one take effect in turn; those that end
        # after it were superseded by it: the last to start is what stays.
        assert state.readable(KEY).size_bytes == 10 * writers[-1], (writers, order)
        master.tick(now + 10 ** 6)
        state.check_invariants()
        [replica] = state.readable(KEY).replicas
        segment = state.segments[replica.segment_id]
        assert state.used_bytes() == segment.allocator.allocation_size(replica.handle)
        assert state.deferred_bytes == 0 and not state.preempted


def test_preempted_upserts_survive_a_snapshot():
    state = new_master().state
    _upsert_start(state, 1, 0)
    _upsert_start(state, 2, 1)
    _upsert_start(state, 3, 2)
    _end(state, 3, 3)
    follower = new_master().state
    follower.restore(state.snapshot())
    assert follower.digest() == state.digest()
    for s in (state, follower):
        _end(s, 1, 4)
        s.apply(c.PutRevoke(KEY, 2))
    assert follower.digest() == state.digest()


# -- moves (cluster drain): conditional on the version copied --------------------------------

MOVE = (c.RESERVED_NAMESPACE, "ns#move/9")


def _readable_then_copy(state, size=100):
    state.apply(c.PutStart(KEY, size, 1, ("seg0",), None, False, True, 1, 0, 1))
    state.apply(c.PutEnd(KEY, 1, 1, 1))
    version = state.readable(KEY)
    [copy] = state.apply(c.PutStart(MOVE, size, 1, ("seg1",), None, False, False, 9, 2, 1,
                                    "ns"))
    return version, copy


def _move(state, version, now=5):
    return state.apply(c.MoveCommit(MOVE, KEY, 9, version.writer_id, version.started_ms, now,
                                    now + 100))


def test_a_move_of_the_current_version_gives_it_the_new_ranges():
    state = new_master().state
    version, copy = _readable_then_copy(state)
    _upsert_start(state, 2, 3)  # a write in progress is left alone
    assert _move(state, version) is True
    moved = state.readable(KEY)
    assert [(r.segment_id, r.offset) for r in moved.replicas] == [(copy.segment_id, copy.offset)]
    assert (moved.writer_id, moved.started_ms) == (version.writer_id, version.started_ms)
    assert MOVE not in state.objects and state.objects[KEY].pending.writer_id == 2
    assert state.deferred_bytes > 0  # the old range waits for its read leases
    state.check_invariants()


@pytest.mark.parametrize("change", ["upsert", "remove", "remove_then_put"])
def test_a_move_of_a_version_replaced_meanwhile_changes_nothing_but_the_copy(change):
    state = new_master().state
    version, _ = _readable_then_copy(state)
    if change == "upsert":
        _upsert_start(state, 2, 3, size=100)
        _end(state, 2, 4)
    else:
        state.apply(c.Remove(KEY, 3))
        if change == "remove_then_put":
            state.apply(c.PutStart(KEY, 100, 1, (), None, False, False, 1, 3, 1))
            state.apply(c.PutEnd(KEY, 1, 3, 3))
    before = state.readable(KEY)
    assert _move(state, version) is False
    assert state.readable(KEY) is before  # the concurrent write stands
    assert MOVE not in state.objects and MOVE not in state.pending_order
    state.check_invariants()


def test_move_commit_codec_round_trip():
    command = c.MoveCommit(MOVE, KEY, 9, 1, 1, 5, 105)
    assert codec.decode(codec.encode(command)) == command
    with pytest.raises(ValueError):
        codec.encode(c.MoveCommit(MOVE, KEY, "9", 1, 1, 5, 105))


def test_a_preempted_upsert_never_replaces_a_later_started_one():
    state = new_master().state
    for writer in (1, 2, 3):
        _upsert_start(state, writer, writer, size=100 * writer)
    _end(state, 2, 4)  # preempted by 3, which is still writing: 2 takes effect
    assert state.readable(KEY).size_bytes == 200
    _end(state, 1, 5)  # started before 2, which has completed: superseded
    assert state.readable(KEY).size_bytes == 200
    state.apply(c.PutRevoke(KEY, 3))
    assert state.readable(KEY).size_bytes == 200  # the last to start of those that succeeded
    state.check_invariants()
