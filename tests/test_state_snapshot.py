"""Snapshots for Raft log compaction: OffsetAllocator.dump/load and StateMachine.snapshot/restore.

Method: an allocator or a state machine runs random operations; at a random point its state is
dumped and loaded into a clone (a fresh object, or one with other state already in it); then the
same further operations go to both, and every result (offsets, handles, byte counts, return
values, error codes) and the final dump or digest must be equal. That is what a lagging Raft node
relies on when it installs a snapshot and then applies the log after it. Loading checks its
input: every truncation, every bit flip, and hand-made structural corruptions (with the checksum
recomputed, so the structural checks themselves are hit) raise ValueError and change nothing.
"""

from __future__ import annotations

import random
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncaked._native import OffsetAllocator
from mooncaked.errors import MooncakedError
from mooncaked.meta import commands as c
from mooncaked.meta.state_machine import Replica, StateMachine, Version

# ---- the dump format, re-read in Python (for the corruption tests) ----------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def parse_dump(data: bytes) -> dict:
    assert data[:4] == b"MCOA" and data[4] == 1
    body, pos = data[:-4], 5

    def get():
        nonlocal pos
        value = shift = 0
        while True:
            byte = body[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    names = ("shift", "capacity_units", "max_allocations", "allocation_count", "free_units",
             "high", "chain_len", "bin_count")
    f = {name: get() for name in names}
    f["gens"] = [get() for _ in range(f["high"])]
    f["chain"] = []
    for _ in range(f["chain_len"]):
        value = get()
        f["chain"].append([value >> 1, value & 1, get()])
    f["stack"] = [get() for _ in range(f["high"] - f["chain_len"])]
    f["bins"] = []
    for _ in range(f["bin_count"]):
        bin_index, length = get(), get()
        f["bins"].append([bin_index, [get() for _ in range(length)]])
    assert pos == len(body)
    return f


def encode_dump(f: dict, *, magic=b"MCOA", version=1, tail=b"") -> bytes:
    """f's fields as a dump; high/chain_len/bin_count default to the lists' lengths."""
    out = bytearray(magic + bytes([version]))
    for name in ("shift", "capacity_units", "max_allocations", "allocation_count", "free_units"):
        out += _varint(f[name])
    out += _varint(f.get("high_override", len(f["gens"])))
    out += _varint(f.get("chain_len_override", len(f["chain"])))
    out += _varint(f.get("bin_count_override", len(f["bins"])))
    for gen in f["gens"]:
        out += _varint(gen)
    for index, used, size in f["chain"]:
        out += _varint(index << 1 | used) + _varint(size)
    for index in f["stack"]:
        out += _varint(index)
    for bin_index, entries in f["bins"]:
        out += _varint(bin_index) + _varint(len(entries))
        for index in entries:
            out += _varint(index)
    out += tail
    return bytes(out) + zlib.crc32(out).to_bytes(4, "little")


def fragmented_allocator() -> OffsetAllocator:
    """Several free blocks in several bins, and pooled nodes pushed back on the stack."""
    alloc = OffsetAllocator(64 * 64, 64, 16)
    handles = [alloc.allocate(64 * (i % 3 + 1))[1] for i in range(10)]
    for i in (1, 3, 5, 7):
        alloc.free(handles[i])
    alloc.free(handles[2])  # merges 1, 2, 3: two nodes go back to the pool
    alloc.free(handles[9])  # merges with the tail: one more
    alloc.allocate(64)
    return alloc


def state_of(alloc: OffsetAllocator) -> tuple:
    return (alloc.dump(), alloc.used_bytes, alloc.free_bytes, alloc.allocation_count,
            alloc.largest_free_bytes(), alloc.free_extents())


# ---- allocator: clone equivalence ---------------------------------------------------------------


def run_op(alloc: OffsetAllocator, live: list, op: tuple):
    kind, value = op
    if kind == "alloc":
        result = alloc.allocate(value)
        if result is not None:
            live.append(result[1])
        return result
    if not live:
        return None
    handle = live.pop(value % len(live))
    return alloc.free(handle), handle


ops_strategy = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(1, 3000)),
              st.tuples(st.just("free"), st.integers(0, 1 << 16))),
    max_size=80)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(alignment=st.sampled_from([1, 8, 64, 512]), units=st.integers(1, 400),
       max_allocations=st.one_of(st.integers(1, 12), st.just(256)),
       before=ops_strategy, after=ops_strategy)
def test_allocator_clone_behaves_identically(alignment, units, max_allocations, before, after):
    alloc = OffsetAllocator(units * alignment + alignment // 2, alignment, max_allocations)
    live: list = []
    for op in before:
        run_op(alloc, live, op)
    dump = alloc.dump()
    clone = OffsetAllocator.load(dump)
    assert clone.dump() == dump
    assert state_of(clone) == state_of(alloc)
    clone_live = list(live)
    for handle in live:
        assert clone.allocation_size(handle) == alloc.allocation_size(handle)
        assert clone.allocation_offset(handle) == alloc.allocation_offset(handle)
    for op in after:
        assert run_op(clone, clone_live, op) == run_op(alloc, live, op)
        assert clone.used_bytes == alloc.used_bytes
        assert clone.largest_free_bytes() == alloc.largest_free_bytes()
    assert state_of(clone) == state_of(alloc)


def test_allocator_long_run_with_repeated_snapshots():
    rng = random.Random(1234)
    alloc = OffsetAllocator(1 << 20, 64, 300)
    clone = OffsetAllocator.load(alloc.dump())
    live: list = []
    clone_live: list = []
    for step in range(6000):
        op = ("alloc", rng.randint(1, 20000)) if rng.random() < 0.55 else ("free", rng.randrange(1 << 20))
        assert run_op(clone, clone_live, op) == run_op(alloc, live, op)
        if step % 500 == 499:  # the lagging node installs a newer snapshot
            clone = OffsetAllocator.load(alloc.dump())
            clone_live = list(live)
            assert clone.dump() == alloc.dump()
    assert state_of(clone) == state_of(alloc)
    alloc.reset()
    clone.reset()
    assert state_of(clone) == state_of(alloc)  # generations survive reset identically
    assert clone.allocate(64) == alloc.allocate(64)


def test_fresh_and_reset_allocators_round_trip():
    for args in ((64, 64, 1), ((1 << 64) - 1, 1, 65536), (4096 * 3 + 5, 4096, 7)):
        alloc = OffsetAllocator(*args)
        for _ in range(2):
            clone = OffsetAllocator.load(alloc.dump())
            assert state_of(clone) == state_of(alloc)
            assert clone.capacity_bytes == alloc.capacity_bytes
            assert clone.alignment_bytes == alloc.alignment_bytes
            assert clone.max_allocations == alloc.max_allocations
            assert clone.allocate(alloc.capacity_bytes) == alloc.allocate(alloc.capacity_bytes)
            alloc.reset()
            clone.reset()


def test_load_accepts_bytes_likes_and_rejects_other_types():
    dump = fragmented_allocator().dump()
    for data in (bytearray(dump), memoryview(dump)):
        assert OffsetAllocator.load(data).dump() == dump
    for data in (None, 5, "MCOA", [1, 2]):
        with pytest.raises(TypeError):
            OffsetAllocator.load(data)


def test_stale_handles_stay_stale_in_the_clone():
    alloc = OffsetAllocator(4096, 64, 8)
    _, stale = alloc.allocate(64)
    alloc.free(stale)
    _, fresh = alloc.allocate(64)  # same node, next generation
    clone = OffsetAllocator.load(alloc.dump())
    with pytest.raises(ValueError):
        clone.free(stale)
    with pytest.raises(ValueError):
        clone.allocation_offset(stale)
    assert clone.allocation_offset(fresh) == 0
    assert clone.free(fresh) == 64


def test_dump_size_for_10k_live_allocations():
    rng = random.Random(5)
    alloc = OffsetAllocator(1 << 34, 64, 65536)
    handles = [alloc.allocate(rng.randint(1, 1 << 20))[1] for _ in range(10_000)]
    assert len(alloc.dump()) < 60_000  # about 5 bytes per allocation
    rng.shuffle(handles)
    for handle in handles[:5000]:
        alloc.free(handle)
    for _ in range(5000):
        assert alloc.allocate(rng.randint(1, 1 << 20)) is not None
    dump = alloc.dump()
    assert alloc.allocation_count == 10_000
    assert len(dump) < 100_000  # fragmented: the free blocks and bins cost a little more
    assert OffsetAllocator.load(dump).dump() == dump


# ---- allocator: bad input ------------------------------------------------------------------------


def test_every_truncation_and_extension_is_rejected():
    dump = fragmented_allocator().dump()
    for length in range(len(dump)):
        with pytest.raises(ValueError):
            OffsetAllocator.load(dump[:length])
    for extra in (b"\x00", dump[-4:], b"\x00" * 100):
        with pytest.raises(ValueError):
            OffsetAllocator.load(dump + extra)


def test_every_bit_flip_is_rejected():
    dump = fragmented_allocator().dump()
    for position in range(len(dump)):
        for bit in range(8):
            corrupt = bytearray(dump)
            corrupt[position] ^= 1 << bit
            with pytest.raises(ValueError):
                OffsetAllocator.load(bytes(corrupt))


def _corruptions(f: dict):
    """(name, dump) pairs of structurally wrong dumps, each with a valid checksum."""
    def variant(**changes):
        g = {k: ([list(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v)
             for k, v in f.items()}
        for name in ("high", "chain_len", "bin_count"):
            g.pop(name)
        g["bins"] = [[b, list(e)] for b, e in f["bins"]]
        g.update(changes)
        return g

    chain, bins, stack = f["chain"], f["bins"], f["stack"]
    used = [i for i, (_, u, _) in enumerate(chain) if u]
    free = [i for i, (_, u, _) in enumerate(chain) if not u]
    yield "bad magic", encode_dump(variant(), magic=b"MCOB")
    yield "bad version", encode_dump(variant(), version=2)
    yield "trailing byte", encode_dump(variant(), tail=b"\x00")
    yield "shift 64", encode_dump(variant(shift=64))
    yield "capacity 0", encode_dump(variant(capacity_units=0))
    yield "capacity overflows", encode_dump(variant(capacity_units=1 << 63, shift=1))
    yield "max_allocations 0", encode_dump(variant(max_allocations=0))
    yield "max_allocations huge", encode_dump(variant(max_allocations=1 << 31))
    yield "max_allocations below count", encode_dump(variant(max_allocations=len(used) - 1))
    yield "count off", encode_dump(variant(allocation_count=f["allocation_count"] + 1))
    yield "free units off", encode_dump(variant(free_units=f["free_units"] - 1))
    yield "high too big", encode_dump(variant(gens=f["gens"] + [0] * (2 * f["max_allocations"] + 3)))
    yield "high short", encode_dump(variant(high_override=len(f["gens"]) + 1))
    yield "chain_len 0", encode_dump(variant(chain_len_override=0))
    yield "chain_len long", encode_dump(variant(chain_len_override=len(chain) + 1))
    yield "bin_count 513", encode_dump(variant(bin_count_override=513))
    yield "generation overflow", encode_dump(variant(gens=[1 << 32] + f["gens"][1:]))
    for name, raw in (("varint of 11 bytes", b"MCOA\x01" + b"\xff" * 10 + b"\x01"),
                      ("varint past 64 bits", b"MCOA\x01" + b"\xff" * 9 + b"\x02")):
        yield name, raw + zlib.crc32(raw).to_bytes(4, "little")
    dup = variant()
    dup["chain"][1][0] = dup["chain"][0][0]
    yield "chain index twice", encode_dump(dup)
    out_of_range = variant()
    out_of_range["chain"][0][0] = len(f["gens"])
    yield "chain index >= high", encode_dump(out_of_range)
    empty = variant()
    empty["chain"][used[0]][2] = 0
    yield "empty block", encode_dump(empty)
    short = variant(free_units=f["free_units"] - 1)
    short["chain"][free[-1]][2] -= 1
    yield "blocks short of capacity", encode_dump(short)
    over = variant()
    over["chain"][used[-1]][2] += 1
    yield "blocks past capacity", encode_dump(over)
    # A used block between two free ones, turned free: adjacent free blocks.
    middle = next(i for i in used if 0 < i < len(chain) - 1
                  and not chain[i - 1][1] and not chain[i + 1][1])
    adjacent = variant(allocation_count=f["allocation_count"] - 1,
                       free_units=f["free_units"] + chain[middle][2])
    adjacent["chain"][middle][1] = 0
    yield "adjacent free blocks", encode_dump(adjacent)
    swapped = variant()
    swapped["chain"][used[0]][1], swapped["chain"][free[0]][1] = 0, 1
    yield "used and free swapped", encode_dump(swapped)
    assert stack, "the fixture must have pooled nodes above the untouched stack bottom"
    assert len(stack) >= 2
    dup_stack = variant()
    dup_stack["stack"][-1] = dup_stack["stack"][0]
    yield "stack entry twice", encode_dump(dup_stack)
    block_on_stack = variant()
    block_on_stack["stack"][0] = chain[0][0]
    yield "block on the stack", encode_dump(block_on_stack)
    high_on_stack = variant()
    high_on_stack["stack"][0] = len(f["gens"])
    yield "stack entry >= high", encode_dump(high_on_stack)
    assert len(bins) >= 2, "the fixture must have several bins"
    wrong_bin = variant()
    wrong_bin["bins"][0][0] = (wrong_bin["bins"][0][0] + 1) % 512 if bins[1][0] != bins[0][0] + 1 else 0
    yield "block in the wrong bin", encode_dump(wrong_bin)
    order = variant()
    order["bins"].reverse()
    yield "bins out of order", encode_dump(order)
    missing = variant()
    missing["bins"].pop(0)
    yield "free block in no bin", encode_dump(missing)
    listed_twice = variant()
    listed_twice["bins"][0][1].append(listed_twice["bins"][0][1][0])
    yield "free block binned twice", encode_dump(listed_twice)
    used_binned = variant()
    used_binned["bins"][0][1][0] = chain[used[0]][0]
    yield "used block in a bin", encode_dump(used_binned)
    empty_bin = variant()
    empty_bin["bins"].append([511, []])
    yield "empty bin", encode_dump(empty_bin)


def test_structural_corruptions_are_rejected():
    alloc = fragmented_allocator()
    dump = alloc.dump()
    f = parse_dump(dump)
    assert encode_dump({k: v for k, v in f.items() if k not in ("high", "chain_len", "bin_count")}) == dump
    names = []
    for name, corrupt in _corruptions(f):
        names.append(name)
        with pytest.raises(ValueError):
            OffsetAllocator.load(corrupt)
    assert len(names) == len(set(names)) >= 30


def test_random_corruption_with_valid_checksum_never_crashes():
    """A mutated body either fails to load or loads as a consistent allocator."""
    rng = random.Random(99)
    dump = fragmented_allocator().dump()
    body = dump[:-4]
    loaded = 0
    for _ in range(3000):
        corrupt = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            corrupt[rng.randrange(5, len(corrupt))] = rng.randrange(256)
        data = bytes(corrupt) + zlib.crc32(corrupt).to_bytes(4, "little")
        try:
            alloc = OffsetAllocator.load(data)
        except ValueError:
            continue
        loaded += 1
        extents = alloc.free_extents()
        assert sum(size for _, size in extents) == alloc.free_bytes
        assert alloc.free_bytes + alloc.used_bytes == alloc.capacity_bytes
        for (o1, s1), (o2, _) in zip(extents, extents[1:]):
            assert o1 + s1 < o2
        assert alloc.largest_free_bytes() == max((s for _, s in extents), default=0)
        handles = [r[1] for r in (alloc.allocate(64) for _ in range(5)) if r]
        for handle in handles:
            alloc.free(handle)
        assert OffsetAllocator.load(alloc.dump()).dump() == alloc.dump()
    assert loaded < 3000


# ---- state machine -------------------------------------------------------------------------------


def new_state(strategy="random", max_objects=10) -> StateMachine:
    return StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                        max_objects=max_objects, put_start_discard_timeout_ms=300,
                        put_start_release_timeout_ms=1000, allocation_strategy=strategy)


KEYS = [("ns", f"k{i}") for i in range(12)] + [("other", "k0")]
NODES = (1, 2, 3)


def next_command(rng: random.Random, state: StateMachine, now: int):
    """A random command, biased towards ones that succeed in `state`."""
    pending = [(k, e.pending.writer_id) for k, e in state.objects.items() if e.pending]
    existing = list(state.objects) or KEYS
    names = [s.name for s in state.segment_list] + ["nowhere"]
    roll = rng.random()
    if roll < 0.04 or len(state.segments) < 2:
        node = rng.choice(NODES)
        # Under the node's current generation, mostly (a stale one is refused).
        generation = state.generations.get(node, 0) if rng.random() < 0.9 else 0
        sid = c.segment_id_of(node, rng.randrange(2), generation)
        return c.MountSegment(sid, f"seg{sid}", f"node{node}", rng.choice([4096, 16384, 65536]),
                              rng.choice([64, 512]), rng.randint(2, 24))
    if roll < 0.055:
        node = rng.choice(NODES)
        return c.NodeUp(node, f"node{node}", f"h{node}:1", f"h{node}:2")
    if roll < 0.065:
        return c.NodeDown(rng.choice(NODES))
    if roll < 0.068:
        return c.SetStoreSettings(rng.choice([4, 10]), rng.choice([100, 300]),
                                  rng.choice([300, 1000]),
                                  rng.choice(["random", "free_ratio_first"]))
    if roll < 0.075:
        return c.UnmountSegment(rng.choice(list(state.segments) + [12345]))
    if roll < 0.45:
        preferred = tuple(rng.sample(names, rng.randint(0, min(2, len(names)))))
        return c.PutStart(rng.choice(KEYS), rng.randint(1, 9000), rng.randint(1, 3), preferred,
                          rng.choice([None, 0, 50, 5000]), rng.random() < 0.2,
                          rng.random() < 0.3, rng.randint(1, 3), now, rng.getrandbits(32))
    if roll < 0.70:
        preempted = [(k, w) for k, records in state.preempted.items() for w in records]
        if preempted and rng.random() < 0.3:
            key, writer = rng.choice(preempted)
        else:
            key, writer = rng.choice(pending) if pending and rng.random() < 0.9 else (
                rng.choice(KEYS), rng.randint(1, 3))
        return c.PutEnd(key, writer, now, now + rng.randint(0, 600))
    if roll < 0.75:
        key, writer = rng.choice(pending) if pending and rng.random() < 0.8 else (
            rng.choice(KEYS), rng.randint(1, 3))
        return c.PutRevoke(key, writer)
    if roll < 0.84:
        return c.Remove(rng.choice(existing), now + rng.randint(0, 600))
    if roll < 0.88:
        return c.Evict(tuple(rng.sample(existing, min(len(existing), rng.randint(0, 2)))))
    if roll < 0.90:  # a copy of a readable version, for a move
        sizes = [e.complete.size_bytes for k, e in state.objects.items()
                 if k[0] == "ns" and e.complete] or [rng.randint(1, 9000)]
        return c.PutStart((c.RESERVED_NAMESPACE, f"ns#move/{rng.randint(1, 3)}"),
                          rng.choice(sizes), 1, (), None, False, False, rng.randint(1, 3),
                          now, rng.getrandbits(32), "ns")
    if roll < 0.97:
        moves = [(k, e.pending) for k, e in state.objects.items()
                 if k[0] == c.RESERVED_NAMESPACE and e.pending]
        readable = [(k, e.complete) for k, e in state.objects.items()
                    if k[0] == "ns" and e.complete]
        if moves and readable:
            reserved, copy = rng.choice(moves)
            key, version = rng.choice([r for r in readable
                                       if r[1].size_bytes == copy.size_bytes] or readable)
            started = version.started_ms if rng.random() < 0.8 else version.started_ms + 1
            return c.MoveCommit(reserved, key, copy.writer_id, version.writer_id, started,
                                now, now + rng.randint(0, 600))
    if roll < 0.985:  # a disk copy of a readable version, or a record found on disk
        readable = [(k, e.complete) for k, e in state.objects.items() if e.complete]
        node = rng.choice((0,) + NODES)
        if readable and rng.random() < 0.8:
            key, version = rng.choice(readable)
            return c.AddDiskReplica(key, version.writer_id, version.started_ms, node,
                                    rng.randrange(4), rng.randrange(8) * 4096,
                                    version.size_bytes, rng.getrandbits(32))
        return c.AddDiskReplica(rng.choice(KEYS), 0, now, node, rng.randrange(4),
                                rng.randrange(8) * 4096, rng.randint(1, 9000),
                                rng.getrandbits(32), True)
    if roll < 0.995:
        copies = [(k, e.complete.disk) for k, e in state.objects.items()
                  if e.complete and e.complete.disk]
        if copies:
            key, disk = rng.choice(copies)
            return c.DropDiskReplica(key, disk.node_id, disk.region, disk.offset)
    return c.ReleaseExpired(now)


def normalise(value):
    if isinstance(value, Replica):
        return ("replica", value.segment_id, value.offset, value.handle)
    if isinstance(value, Version):
        disk = value.disk
        return ("version", value.size_bytes, value.writer_id, value.started_ms,
                normalise(value.replicas),
                disk and (disk.node_id, disk.region, disk.offset, disk.size_bytes,
                          disk.disk_version))
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def apply(state: StateMachine, command):
    try:
        return "ok", normalise(state.apply(command))
    except MooncakedError as exc:
        return "error", exc.code


# A seed of commands_for whose state has every table non-empty (preempted upserts, settings
# from the log, generations and disk copies included), for the garbage cases.
SEED_WITH_EVERY_TABLE = 1043


def commands_for(seed: int, count: int) -> list:
    """A command list generated against a reference run (commands depend on the state)."""
    rng = random.Random(seed)
    reference = new_state()
    commands, now = [], 0
    for _ in range(count):
        now += rng.choice([0, 1, 5, 20, 50, 300])
        command = next_command(rng, reference, now)
        apply(reference, command)
        commands.append(command)
    return commands


@pytest.mark.parametrize("strategy", ["random", "free_ratio_first"])
@pytest.mark.parametrize("seed", range(12))
def test_restored_state_machine_follows_the_log_identically(seed, strategy):
    rng = random.Random(seed * 7 + 1)
    commands = commands_for(seed, 220)
    split = rng.randrange(len(commands) + 1)
    leader = new_state(strategy)
    for command in commands[:split]:
        apply(leader, command)
    leader.check_invariants()
    # The follower already has other state: restore must replace all of it.
    follower = new_state(strategy)
    for command in commands_for(seed + 1000, rng.randrange(60)):
        apply(follower, command)
    snapshot = leader.snapshot()
    follower.restore(snapshot)
    follower.check_invariants()
    assert follower.snapshot() == snapshot
    assert follower.digest() == leader.digest()
    assert list(follower.objects) == list(leader.objects)
    assert list(follower.pending_order.items()) == list(leader.pending_order.items())
    assert [s.segment_id for s in follower.segment_list] == [s.segment_id for s in leader.segment_list]
    for command in commands[split:]:
        assert apply(follower, command) == apply(leader, command), command
        follower.check_invariants()
        assert follower.digest() == leader.digest(), command
    assert follower.snapshot() == leader.snapshot()


def test_repeated_snapshots_and_successes_are_exercised():
    """The generator really produces successes of every kind, and snapshots chain."""
    leader, follower = new_state(), new_state()
    kinds = set()
    most_objects = most_deferred = most_pending = most_preempted = 0
    for i, command in enumerate(commands_for(11, 400)):  # a seed where every kind succeeds
        result = apply(leader, command)
        if result[0] == "ok":
            kinds.add(type(command).__name__)
        if result == ("ok", True) and type(command) in (c.AddDiskReplica, c.DropDiskReplica):
            kinds.add(f"{type(command).__name__}{'+recovered' * getattr(command, 'recovered', 0)}")
        most_objects = max(most_objects, len(leader.objects))
        most_deferred = max(most_deferred, len(leader._deferred))
        most_pending = max(most_pending, len(leader.pending_order))
        if i % 50 == 0:
            follower.restore(leader.snapshot())
        else:
            assert apply(follower, command) == result
        assert follower.digest() == leader.digest()
        most_preempted = max(most_preempted, len(leader.preempted))
    assert kinds >= {"MountSegment", "NodeUp", "PutStart", "PutEnd", "PutRevoke", "Remove",
                     "Evict", "ReleaseExpired", "NodeDown", "UnmountSegment",
                     "MoveCommit", "SetStoreSettings", "AddDiskReplica",
                     "AddDiskReplica+recovered", "DropDiskReplica"}, kinds
    assert most_objects >= 6 and most_deferred >= 2 and most_pending >= 3  # not trivial states
    assert most_preempted >= 1


def test_restore_takes_the_snapshots_store_settings_and_generations():
    """What the state machine decides by comes from the log: a snapshot carries the settings
    (and the nodes' mount generations), whatever the restoring instance was built with."""
    leader = new_state("random", max_objects=10)
    for command in commands_for(3, 80):
        apply(leader, command)
    apply(leader, c.SetStoreSettings(7, 100, 900, "random"))
    assert leader.generations
    follower = new_state("free_ratio_first", max_objects=3)
    follower.restore(leader.snapshot())
    assert follower.store_settings() == c.SetStoreSettings(7, 100, 900, "random")
    assert follower.store_settings_from_log and follower.generations == leader.generations
    assert follower.digest() == leader.digest()


def test_a_snapshot_of_format_2_restores_with_the_built_settings():
    leader = new_state("random", max_objects=10)
    for command in commands_for(3, 80):
        apply(leader, command)
    top = msgpack.unpackb(leader.snapshot(), raw=False)
    top["format"] = 2
    del top["settings_from_log"], top["generations"], top["preempted"], top["down_nodes"]
    del top["arenas"], top["arena_seq"], top["arena_term"]  # format 4
    for row in top["objects"]:
        del row[8]  # pending_upsert: format 3
    top["config"] = [5, 1, 2, "random"]  # the config of the node that took it
    follower = new_state("free_ratio_first", max_objects=3)
    follower.restore(msgpack.packb(top, use_bin_type=True))
    assert follower.max_objects == 3 and follower.allocation_strategy == "free_ratio_first"
    assert not follower.store_settings_from_log and follower.generations == {}
    assert msgpack.unpackb(follower.snapshot())["objects"] == msgpack.unpackb(leader.snapshot())["objects"]


def test_digest_sees_allocator_internals():
    a, b = new_state(), new_state()
    for state in (a, b):
        state.apply(c.MountSegment(1, "s", "n", 4096, 64, 8))
    # Same objects and ranges in the end, but b's allocator went through an extra cycle.
    handle = b.segments[1].allocator.allocate(64)[1]
    b.segments[1].allocator.free(handle)
    assert a.digest() != b.digest()
    assert len(a.digest()) == 32


def _garbage_snapshots(good: bytes):
    rng = random.Random(4)
    yield b""
    yield b"\xc1"
    yield bytes(rng.randrange(256) for _ in range(200))
    yield msgpack.packb([1, 2, 3])
    yield msgpack.packb({"format": 1})
    yield good + b"\x00"
    for length in sorted(rng.sample(range(len(good)), min(60, len(good)))):
        yield good[:length]

    def mutated(change):
        top = msgpack.unpackb(good, use_list=True)
        change(top)
        return msgpack.packb(top, use_bin_type=True)

    def set_field(name, value):
        return mutated(lambda t: t.__setitem__(name, value))

    yield set_field("format", 6)
    yield set_field("config", [1, 2, 3, "nowhere_first"])
    yield set_field("config", [0, 2, 3, "random"])
    yield set_field("config", [1, 5, 3, "random"])  # discard after release
    yield set_field("settings_from_log", 1)
    yield set_field("generations", [[1, 0]])
    yield set_field("generations", [[1, 2], [1, 3]])
    yield set_field("generations", [[1, 1 << 32]])
    yield set_field("format", True)
    yield mutated(lambda t: t.pop("nodes"))
    yield mutated(lambda t: t.__setitem__("extra", 1))
    yield set_field("clock_ms", "now")
    yield set_field("config", [1, 2, 3])
    yield set_field("segments", {})
    yield set_field("segment_list", [])
    yield set_field("objects", [[1, 2, 3]])
    yield set_field("deferred", [[0, 0, []]])

    def corrupt_dump(t):
        dump = bytearray(t["segments"][0][5])
        dump[len(dump) // 2] ^= 0x10
        t["segments"][0][5] = bytes(dump)
    yield mutated(corrupt_dump)
    yield mutated(lambda t: t["segments"].append(t["segments"][0]))
    yield mutated(lambda t: t["segment_list"].append(t["segment_list"][0]))
    yield mutated(lambda t: t["nodes"].append(t["nodes"][0]))
    yield mutated(lambda t: t["objects"].append(t["objects"][0]))
    yield mutated(lambda t: t["objects"].pop(0))  # its ranges are then owned by nobody

    def first_version(t):
        return next(o[6] or o[7] for o in t["objects"])

    yield mutated(lambda t: first_version(t)[3][0].__setitem__(0, 999999))  # unknown segment
    yield mutated(lambda t: first_version(t)[3][0].__setitem__(1, 12345))  # wrong offset
    yield mutated(lambda t: first_version(t)[3][0].__setitem__(2, 1 << 40))  # not live
    yield mutated(lambda t: first_version(t).__setitem__(3, first_version(t)[3] * 2))
    yield mutated(lambda t: t["objects"][0].__setitem__(6, None) or t["objects"][0].__setitem__(7, None))
    yield mutated(lambda t: t["pending_order"].append(["ns", "nope", 0]))
    yield mutated(lambda t: t["pending_order"].clear())

    def break_heap(t):
        t["deferred"][0][0] = t["deferred"][-1][0] + 1
    yield mutated(break_heap)
    yield mutated(lambda t: t["deferred"][0].__setitem__(1, t["deferred_seq"] + 1))
    yield set_field("preempted", [[1, 2, 3]])
    yield mutated(lambda t: t["preempted"][0].__setitem__(7, t["deferred_seq"] + 1))
    yield mutated(lambda t: t["preempted"].append(t["preempted"][0]))
    yield mutated(lambda t: t["objects"][0].__setitem__(8, 1))
    yield mutated(lambda t: t.pop("preempted"))

    def disk_version_row(t):
        return next(o[6] for o in t["objects"] if o[6] and o[6][5])

    yield mutated(lambda t: disk_version_row(t)[5].__setitem__(3, 0))  # size differs
    yield mutated(lambda t: disk_version_row(t)[5].__setitem__(1, "r"))
    yield mutated(lambda t: disk_version_row(t)[5].pop())
    yield mutated(lambda t: disk_version_row(t).__setitem__(3, []) or disk_version_row(t)
                  .__setitem__(5, None))  # neither replicas nor a disk copy
    yield mutated(lambda t: next(o for o in t["objects"] if o[7])[7]
                  .__setitem__(5, [0, 0, 0, next(o for o in t["objects"] if o[7])[7][0], 1]))


def test_restore_rejects_garbage_and_changes_nothing():
    leader = new_state()
    commands = commands_for(SEED_WITH_EVERY_TABLE, 200)
    for command in commands:
        apply(leader, command)
    assert leader.objects and len(leader._deferred) >= 2 and leader.pending_order \
        and leader.nodes and leader.generations and leader.store_settings_from_log
    assert leader.preempted
    good = leader.snapshot()
    follower = new_state()
    for command in commands[:120]:
        apply(follower, command)
    before = follower.snapshot()
    count = 0
    for bad in _garbage_snapshots(good):
        count += 1
        with pytest.raises(ValueError):
            follower.restore(bad)
        assert follower.snapshot() == before
        follower.check_invariants()
    assert count > 80
    with pytest.raises(ValueError):
        follower.restore("not bytes")
    follower.restore(good)  # and a good one still goes in
    assert follower.digest() == leader.digest()
    for command in commands_for(12, 50):
        assert apply(follower, command) == apply(leader, command)
