"""Tests for mooncaked._native: OffsetAllocator against a dumb oracle, plus memcopy helpers."""

import mmap
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mooncaked._native import OffsetAllocator, buffer_address, copy_memory


# ---- oracle helpers ----------------------------------------------------------


def round_up(size, alignment):
    return -(-size // alignment) * alignment


def free_gaps(live, capacity):
    """Maximal free extents (offset, size) between sorted live ranges."""
    gaps = []
    cursor = 0
    for offset, size in sorted(live.values()):
        if offset > cursor:
            gaps.append((cursor, offset - cursor))
        cursor = offset + size
    if cursor < capacity:
        gaps.append((cursor, capacity - cursor))
    return gaps


def check_against_oracle(alloc, live):
    capacity = alloc.capacity_bytes
    used = sum(size for _, size in live.values())
    assert alloc.used_bytes == used
    assert alloc.free_bytes == capacity - used
    assert alloc.allocation_count == len(live)
    extents = alloc.free_extents()
    gaps = free_gaps(live, capacity)
    # Exact complement of the live ranges; gaps are maximal, so equality also
    # proves that freed neighbours were merged.
    assert extents == gaps
    for (o1, s1), (o2, _) in zip(extents, extents[1:]):
        assert o1 + s1 < o2, "two free extents touch: merge missed"
    assert alloc.largest_free_bytes() == max((s for _, s in gaps), default=0)
    for handle, (_, size) in live.items():
        assert alloc.allocation_size(handle) == size


def check_new_range(alloc, live, offset, size):
    assert offset % alloc.alignment_bytes == 0
    assert 0 <= offset and offset + size <= alloc.capacity_bytes
    for other_offset, other_size in live.values():
        assert offset + size <= other_offset or other_offset + other_size <= offset, "overlap"


def check_none_is_justified(alloc, live, size):
    """allocate() may return None only if no free block the bin guarantees exists."""
    if len(live) >= alloc.max_allocations:
        return
    largest_gap = max((s for _, s in free_gaps(live, alloc.capacity_bytes)), default=0)
    assert largest_gap < alloc.bin_size_for(size)


# ---- stateful property test ----------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(
        alignment=st.sampled_from([1, 2, 8, 64, 4096]),
        units=st.one_of(st.integers(1, 16), st.integers(1, 5000)),
        slack=st.integers(0, 4095),
        max_allocations=st.one_of(st.integers(1, 12), st.just(65536)),
    )
    def setup(self, alignment, units, slack, max_allocations):
        # slack exercises capacity rounding down to the alignment.
        self.capacity = units * alignment + (slack % alignment)
        self.alloc = OffsetAllocator(self.capacity, alignment, max_allocations)
        assert self.alloc.capacity_bytes == units * alignment
        self.live = {}  # handle -> (offset, rounded size)
        self.dead = []  # handles already freed

    def _allocate(self, size):
        result = self.alloc.allocate(size)
        rounded = round_up(size, self.alloc.alignment_bytes)
        if result is None:
            check_none_is_justified(self.alloc, self.live, size)
            return
        offset, handle = result
        assert len(self.live) < self.alloc.max_allocations
        assert handle not in self.live
        assert handle not in self.dead, "a freed handle was handed out again"
        check_new_range(self.alloc, self.live, offset, rounded)
        self.live[handle] = (offset, rounded)

    @rule(data=st.data())
    def allocate_small(self, data):
        cap = self.alloc.capacity_bytes
        self._allocate(data.draw(st.integers(1, max(1, cap // 8))))

    @rule(data=st.data())
    def allocate_any(self, data):
        # Up to beyond capacity, so "no space" and "too large" both happen.
        cap = self.alloc.capacity_bytes
        self._allocate(data.draw(st.integers(1, cap + cap // 4 + 1)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_one(self, data):
        handle = data.draw(st.sampled_from(sorted(self.live)))
        _, size = self.live.pop(handle)
        assert self.alloc.free(handle) == size
        self.dead.append(handle)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def free_stale_handle(self, data):
        # Node slots are reused, but a freed handle must never become valid again.
        handle = data.draw(st.sampled_from(self.dead))
        with pytest.raises(ValueError):
            self.alloc.free(handle)

    @rule()
    def free_all_then_full(self):
        for handle, (_, size) in list(self.live.items()):
            assert self.alloc.free(handle) == size
            self.dead.append(handle)
        self.live.clear()
        cap = self.alloc.capacity_bytes
        assert self.alloc.free_extents() == [(0, cap)]
        offset, handle = self.alloc.allocate(cap)
        assert offset == 0
        assert self.alloc.free_extents() == []
        assert self.alloc.allocate(1) is None
        assert self.alloc.free(handle) == cap
        self.dead.append(handle)

    @rule()
    def reset(self):
        self.alloc.reset()
        self.dead.extend(self.live)
        self.live.clear()

    @invariant()
    def matches_oracle(self):
        if hasattr(self, "alloc"):
            check_against_oracle(self.alloc, self.live)


AllocatorMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


# ---- long random sequence (many nodes, deep splits/merges) ----------------------


@pytest.mark.parametrize("seed", range(4))
def test_long_random_sequence(seed):
    rng = random.Random(seed)
    alignment = rng.choice([1, 64, 512])
    capacity = alignment * rng.randint(2000, 200000)
    alloc = OffsetAllocator(capacity, alignment, max_allocations=rng.choice([50, 500, 65536]))
    live = {}
    for step in range(6000):
        if live and rng.random() < 0.45:
            handle = rng.choice(list(live))
            assert alloc.free(handle) == live.pop(handle)[1]
        else:
            # Mix of small and large requests so bins across many exponents fill.
            size = rng.choice([rng.randint(1, 4 * alignment), rng.randint(1, capacity // 20 + 1)])
            result = alloc.allocate(size)
            if result is None:
                check_none_is_justified(alloc, live, size)
            else:
                offset, handle = result
                rounded = round_up(size, alignment)
                check_new_range(alloc, live, offset, rounded)
                live[handle] = (offset, rounded)
        if step % 200 == 0:
            check_against_oracle(alloc, live)
    check_against_oracle(alloc, live)
    for handle in list(live):
        alloc.free(handle)
    assert alloc.free_extents() == [(0, capacity)]
    assert alloc.allocate(capacity)[0] == 0


# ---- unit tests -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        (0,),
        (63, 64),
        (1024, 0),
        (1024, 3),
        (1024, 96),
        (1024, -64),
        (1024, 64, 0),
        (1024, 64, -1),
        (2**64, 1),
        (1024, 64, 2**40),
    ],
)
def test_bad_constructor_args(args):
    with pytest.raises(ValueError):
        OffsetAllocator(*args)


def test_non_int_args_raise_type_error():
    with pytest.raises(TypeError):
        OffsetAllocator(1024.0)
    alloc = OffsetAllocator(1024)
    with pytest.raises(TypeError):
        alloc.allocate(1.5)
    with pytest.raises(TypeError):
        alloc.free("1")


def test_properties_and_capacity_rounding():
    alloc = OffsetAllocator(1000, 64, 7)
    assert alloc.capacity_bytes == 960
    assert alloc.alignment_bytes == 64
    assert alloc.max_allocations == 7
    assert (alloc.used_bytes, alloc.free_bytes, alloc.allocation_count) == (0, 960, 0)
    offset, handle = alloc.allocate(65)
    assert offset == 0
    assert alloc.allocation_size(handle) == 128
    assert (alloc.used_bytes, alloc.free_bytes, alloc.allocation_count) == (128, 832, 1)
    assert alloc.free_extents() == [(128, 832)]
    assert alloc.free(handle) == 128
    assert alloc.free_extents() == [(0, 960)]


def test_size_zero_or_negative_raises():
    alloc = OffsetAllocator(4096)
    for size in (0, -1, -(2**70)):
        with pytest.raises(ValueError):
            alloc.allocate(size)
    with pytest.raises(ValueError):
        alloc.bin_size_for(0)


def test_oversized_request_returns_none():
    alloc = OffsetAllocator(4096, 64)
    assert alloc.allocate(4097) is None
    assert alloc.allocate(2**64) is None
    assert alloc.allocate(2**200) is None
    assert alloc.allocation_count == 0
    assert alloc.allocate(4096)[0] == 0


def test_double_free_raises_and_keeps_state():
    alloc = OffsetAllocator(4096, 64)
    _, a = alloc.allocate(64)
    _, b = alloc.allocate(64)
    alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free(a)
    with pytest.raises(ValueError):
        alloc.allocation_size(a)
    assert alloc.allocation_count == 1
    assert alloc.free_extents() == [(0, 64), (128, 4096 - 128)]
    alloc.free(b)
    assert alloc.free_extents() == [(0, 4096)]


def test_stale_handle_after_slot_reuse_raises():
    alloc = OffsetAllocator(4096, 64)
    _, a = alloc.allocate(64)
    alloc.free(a)
    _, b = alloc.allocate(64)  # very likely the same node slot
    with pytest.raises(ValueError):
        alloc.free(a)
    assert alloc.allocation_count == 1
    assert alloc.free(b) == 64


@pytest.mark.parametrize("handle", [-1, 2**32 - 1, 12345, 2**64 - 1, 2**64, 2**100, 2 << 32])
def test_garbage_handle_raises(handle):
    alloc = OffsetAllocator(4096, 64, max_allocations=4)
    alloc.allocate(64)
    with pytest.raises(ValueError):
        alloc.free(handle)
    assert alloc.allocation_count == 1


def test_max_allocations_hit_returns_none():
    alloc = OffsetAllocator(1 << 20, 64, max_allocations=3)
    handles = [alloc.allocate(64)[1] for _ in range(3)]
    assert alloc.allocate(64) is None
    assert alloc.allocation_count == 3
    alloc.free(handles[1])
    assert alloc.allocate(64) is not None
    assert alloc.allocate(64) is None


def test_fill_tiny_capacity_exactly():
    alloc = OffsetAllocator(5 * 64, 64)
    results = [alloc.allocate(64) for _ in range(5)]
    assert [offset for offset, _ in results] == [0, 64, 128, 192, 256]
    assert alloc.allocate(1) is None
    assert alloc.largest_free_bytes() == 0
    assert alloc.free_extents() == []
    # Free the middle then its neighbours: must merge back into one block.
    for index in (2, 1, 3):
        alloc.free(results[index][1])
    assert alloc.free_extents() == [(64, 192)]
    assert alloc.allocate(192)[0] == 64


def test_bin_size_for_values():
    alloc = OffsetAllocator(1 << 40, 1)
    # Exact below the mantissa range, then 3-bit-mantissa float steps.
    assert [alloc.bin_size_for(n) for n in range(1, 9)] == list(range(1, 9))
    assert alloc.bin_size_for(9) == 9
    assert alloc.bin_size_for(17) == 18
    assert alloc.bin_size_for(1000) == 1024
    assert alloc.bin_size_for(1024) == 1024
    assert alloc.bin_size_for(1025) == 1152
    for n in range(1, 5000):
        b = alloc.bin_size_for(n)
        assert n <= b <= n + n // 8 + 1
    aligned = OffsetAllocator(1 << 20, 64)
    assert aligned.bin_size_for(1) == 64
    assert aligned.bin_size_for(17 * 64) == 18 * 64


def test_guaranteed_fit_found_with_fragmentation():
    # Many free blocks just below the bin size, one exactly at it: allocate
    # must find the one the bin guarantees, not give up.
    alloc = OffsetAllocator(1 << 20, 1)
    n = 1000
    need = alloc.bin_size_for(n)
    assert need == 1024
    small, guards = [], []
    for _ in range(50):
        small.append(alloc.allocate(need - 1)[1])
        guards.append(alloc.allocate(1)[1])
    big_offset, big = alloc.allocate(need)
    guards.append(alloc.allocate(1)[1])
    rest = alloc.free_extents()[0][1]
    alloc.allocate(rest)
    assert alloc.free_extents() == []
    for handle in small + [big]:
        alloc.free(handle)
    # The 1023-byte blocks sit in a lower bin than the request's rounded-up
    # bin (1024), so the only candidate is the exact-fit block.
    offset, _ = alloc.allocate(n)
    assert offset == big_offset
    assert alloc.free_extents()[-1] == (big_offset + n, need - n)


def test_full_capacity_alignment_one_large():
    alloc = OffsetAllocator(2**64 - 1, 1)
    assert alloc.capacity_bytes == 2**64 - 1
    offset, handle = alloc.allocate(2**63)
    assert offset == 0
    assert alloc.free_extents() == [(2**63, 2**63 - 1)]
    assert alloc.free(handle) == 2**63
    assert alloc.allocate(2**64 - 1)[0] == 0


def test_reset_invalidates_handles():
    alloc = OffsetAllocator(4096, 64)
    _, a = alloc.allocate(100)
    alloc.allocate(100)
    alloc.reset()
    assert alloc.allocation_count == 0
    assert alloc.free_extents() == [(0, 4096)]
    with pytest.raises(ValueError):
        alloc.free(a)
    assert alloc.allocate(4096)[0] == 0


# ---- memcopy -----------------------------------------------------------------------


def test_copy_memory_between_bytearrays():
    source = bytearray(range(256)) * 4
    target = bytearray(len(source))
    copy_memory(buffer_address(target) + 10, buffer_address(source) + 20, 500)
    assert target[10:510] == source[20:520]
    assert target[:10] == bytes(10) and target[510:] == bytes(len(target) - 510)


def test_copy_memory_bytearray_and_mmap():
    region = mmap.mmap(-1, 1 << 16)
    try:
        payload = bytearray(random.Random(1).randbytes(3000))
        copy_memory(buffer_address(region) + 4096, buffer_address(payload), len(payload))
        assert region[4096 : 4096 + 3000] == payload
        back = bytearray(3000)
        copy_memory(buffer_address(back), buffer_address(region) + 4096, 3000)
        assert back == payload
    finally:
        region.close()


def test_buffer_address_readonly_and_bad_args():
    data = b"hello world"
    assert buffer_address(data) != 0
    copy_target = bytearray(5)
    copy_memory(buffer_address(copy_target), buffer_address(data) + 6, 5)
    assert copy_target == b"world"
    with pytest.raises(TypeError):
        buffer_address(12)
    with pytest.raises(ValueError):
        copy_memory(0, buffer_address(data), 1)
    copy_memory(0, 0, 0)  # zero-length copy is a no-op
    with pytest.raises(OverflowError):
        copy_memory(-1, 0, 1)
