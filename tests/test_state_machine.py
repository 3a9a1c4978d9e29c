"""The metadata state machine and the master, without I/O: random command sequences.

Method: hypothesis drives random puts, ends, revokes, upserts, removes, reads, evictions and
clock steps against a Master over the real native allocator, and a dumb model of what readers
may see. After every step the state machine's own invariants hold (no overlapping ranges,
every range owned once) and readers see exactly the model's values. Determinism: the same
commands applied to a second state machine give the same tables.
"""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncaked._native import OffsetAllocator
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands as c
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
        for key, _ in list(self.writing.items()):
            entry = self.master.state.objects.get(key)
            if entry is None or entry.pending is None:
                del self.writing[key]
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
