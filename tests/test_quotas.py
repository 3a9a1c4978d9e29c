"""Namespace quotas: accounting on every path, refusal, eviction order, config, ctl, metrics.

A namespace's usage is the value bytes x replicas of its objects' complete and pending versions
(reservations count against the namespace of the connection holding them) and its number of
objects. The state machine keeps it incrementally; `check_invariants` recounts it from the
objects, so every test that calls it checks usage == the sum over the live objects.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
import time

import msgpack
import pytest

from mooncaked import config as config_module
from mooncaked._native import OffsetAllocator
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import ReplicateConfig as WireReplicateConfig
from mooncaked.config import StoreConfig
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec, commands as c
from mooncaked.meta.master import Master, ReplicateConfig
from mooncaked.meta.state_machine import StateMachine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB = 1024


def new_state(segments=2, capacity=256 * KIB, max_objects=10_000) -> StateMachine:
    state = StateMachine(lambda size, align, count: OffsetAllocator(size, align, count),
                         max_objects=max_objects, put_start_discard_timeout_ms=300,
                         put_start_release_timeout_ms=1000)
    for i in range(segments):
        state.apply(c.MountSegment(i, f"seg{i}", "node", capacity, 64, 1024))
    return state


def new_master(**store) -> Master:
    return Master(new_state(), StoreConfig(lease_ttl_ms=100, **store), seed=3)


def put_start(state, key, size, writer=1, now=0, replicas=1, upsert=False):
    return state.apply(c.PutStart(key, size, replicas, (), None, False, upsert, writer, now, 5))


def put_end(state, key, writer=1, now=0):
    return state.apply(c.PutEnd(key, writer, now, now))


def usage(state, namespace):
    entry = state.usage.get(namespace)
    return (entry.bytes, entry.objects) if entry else (0, 0)


def refused(function, *args, **kwargs) -> MooncakedError:
    with pytest.raises(MooncakedError) as info:
        function(*args, **kwargs)
    assert info.value.code == ErrorCode.QUOTA_EXCEEDED, info.value
    return info.value


# -- accounting, path by path ---------------------------------------------------------------------

def test_a_put_counts_from_its_start_and_replicas_count_each():
    state = new_state()
    put_start(state, ("a", "k"), 1000, replicas=2)
    assert usage(state, "a") == (2000, 1)  # being written: counts already
    put_end(state, ("a", "k"))
    assert usage(state, "a") == (2000, 1)
    assert usage(state, "b") == (0, 0)
    state.check_invariants()


def test_revoke_remove_and_evict_give_back_what_was_counted():
    state = new_state()
    for name in ("r", "m", "e", "d"):
        put_start(state, ("a", name), 100)
    put_end(state, ("a", "m"))
    put_end(state, ("a", "e"))
    assert usage(state, "a") == (400, 4)
    state.apply(c.PutRevoke(("a", "r"), 1))
    assert usage(state, "a") == (300, 3)
    state.apply(c.PutRevoke(("a", "d"), 1, release_at_ms=50))  # held ranges do not count
    assert usage(state, "a") == (200, 2)
    state.apply(c.Remove(("a", "m"), 10))
    assert usage(state, "a") == (100, 1)
    state.apply(c.Evict((("a", "e"),)))
    assert usage(state, "a") == (0, 0) and "a" not in state.usage
    state.check_invariants()


def test_an_upsert_counts_both_versions_until_its_end():
    state = new_state()
    put_start(state, ("a", "k"), 100)
    put_end(state, ("a", "k"))
    put_start(state, ("a", "k"), 300, writer=2, upsert=True)
    assert usage(state, "a") == (400, 1)
    put_end(state, ("a", "k"), writer=2)
    assert usage(state, "a") == (300, 1)
    # A remove during an upsert drops both.
    put_start(state, ("a", "k"), 50, writer=3, upsert=True)
    state.apply(c.Remove(("a", "k"), 0))
    assert usage(state, "a") == (0, 0)
    state.check_invariants()


def test_the_expiry_sweep_and_a_preempting_put_give_back_the_unfinished_put():
    state = new_state()
    put_start(state, ("a", "stale"), 100, now=0)
    put_start(state, ("a", "old"), 70, now=0)
    assert usage(state, "a") == (170, 2)
    put_start(state, ("a", "old"), 40, writer=2, now=400)  # past the discard timeout
    assert usage(state, "a") == (140, 2)
    state.apply(c.ReleaseExpired(1000))  # "stale" is past the release timeout
    assert usage(state, "a") == (40, 1)
    state.check_invariants()


def test_unmount_and_node_down_drop_the_lost_replicas():
    state = new_state(segments=2)
    put_start(state, ("a", "two"), 100, replicas=2)
    put_end(state, ("a", "two"))
    state.apply(c.UnmountSegment(0))
    assert usage(state, "a") == (100, 1)
    state.apply(c.UnmountSegment(1))
    assert usage(state, "a") == (0, 0)
    state.check_invariants()


def reservation(namespace: str, number: int) -> c.ObjectKey:
    return (c.RESERVED_NAMESPACE, c.reservation_name(namespace, 9, number))


def test_reservations_count_bytes_against_the_reserving_namespace_and_no_object():
    state = new_state()
    put_start(state, reservation("a", 1), 500, writer=9)
    assert usage(state, "a") == (500, 0)
    state.apply(c.PutCommit(reservation("a", 1), ("a", "k"), 500, None, False, 9, 1))
    assert usage(state, "a") == (500, 1)
    # Committed under another namespace (the connection said hello again): the bytes move.
    put_start(state, reservation("a", 2), 200, writer=9)
    state.apply(c.PutCommit(reservation("a", 2), ("b", "k"), 200, None, False, 9, 1))
    assert usage(state, "a") == (500, 1) and usage(state, "b") == (200, 1)
    # Given back (revoked) or expired: no longer counted.
    put_start(state, reservation("a", 3), 300, writer=9)
    state.apply(c.PutRevoke(reservation("a", 3), 9))
    put_start(state, reservation("a", 4), 300, writer=9, now=1)
    state.apply(c.ReleaseExpired(5000))
    assert usage(state, "a") == (500, 1)
    state.check_invariants()


# -- refusal --------------------------------------------------------------------------------------

def test_a_put_over_the_byte_quota_is_refused_and_stores_nothing():
    state = new_state()
    state.apply(c.SetQuota("a", 1000, 0))
    put_start(state, ("a", "k1"), 600)
    used_before = state.used_bytes()
    error = refused(put_start, state, ("a", "k2"), 401)
    assert "1000" in error.message and "'a'" in error.message
    assert ("a", "k2") not in state.objects and state.used_bytes() == used_before
    assert usage(state, "a") == (600, 1)
    put_start(state, ("a", "k2"), 400)  # exactly the quota
    refused(put_start, state, ("a", "k3"), 1)
    put_start(state, ("b", "k"), 5000)  # another namespace is not limited
    state.check_invariants()


def test_replicas_count_against_the_quota():
    state = new_state(segments=2)
    state.apply(c.SetQuota("a", 1000, 0))
    refused(put_start, state, ("a", "k"), 600, replicas=2)
    put_start(state, ("a", "k"), 500, replicas=2)
    assert usage(state, "a") == (1000, 1)


def test_an_object_quota_refuses_new_keys_but_not_an_upsert():
    state = new_state()
    state.apply(c.SetQuota("a", 0, 2))
    put_start(state, ("a", "k1"), 10)
    put_start(state, ("a", "k2"), 10)
    put_end(state, ("a", "k1"))
    refused(put_start, state, ("a", "k3"), 10)
    put_start(state, ("a", "k1"), 20, writer=2, upsert=True)  # the key exists: no new object
    assert usage(state, "a") == (40, 2)
    # A reservation is no object; committing it under a new key is refused.
    put_start(state, reservation("a", 1), 10, writer=9)
    refused(state.apply, c.PutCommit(reservation("a", 1), ("a", "k4"), 10, None, False, 9, 1))
    assert reservation("a", 1) in state.objects  # the reservation stays the writer's
    state.check_invariants()


def test_reservations_cannot_get_around_the_byte_quota():
    state = new_state()
    state.apply(c.SetQuota("a", 1000, 0))
    put_start(state, reservation("a", 1), 800, writer=9)
    refused(put_start, state, ("a", "k"), 300)
    refused(put_start, state, reservation("a", 2), 300, writer=9)


def test_the_default_quota_applies_to_namespaces_without_their_own():
    state = new_state()
    state.apply(c.SetQuota(c.QUOTA_DEFAULT, 100, 0))
    state.apply(c.SetQuota("big", 10_000, 0))
    refused(put_start, state, ("any", "k"), 101)
    put_start(state, ("big", "k"), 5000)
    state.apply(c.SetQuota("big", 0, 0))  # its own, unlimited: the default does not apply
    put_start(state, ("big", "k2"), 20_000)
    assert state.quota_of("other") == (100, 0) and state.quota_of("big") == (0, 0)


def test_a_lowered_quota_keeps_what_is_stored_and_refuses_more():
    state = new_state()
    put_start(state, ("a", "k"), 1000)
    state.apply(c.SetQuota("a", 500, 0))
    assert ("a", "k") in state.objects
    assert state.namespaces_over_quota() == {"a": (500, 0)}
    refused(put_start, state, ("a", "k2"), 1)


def test_set_quota_is_checked_in_the_state_machine_and_the_codec():
    state = new_state()
    for bad in (c.SetQuota("bad ns", 1, 1), c.SetQuota("a", -1, 0), c.SetQuota("", 0, 0),
                c.SetQuota("a\n", 0, 0)):
        with pytest.raises(MooncakedError) as info:
            state.apply(bad)
        assert info.value.code == ErrorCode.INVALID_PARAMS
        with pytest.raises(ValueError):
            codec.encode(bad)
    assert state.quotas == {}
    good = c.SetQuota("a/b", 1 << 40, 7)
    assert codec.decode(codec.encode(good)) == good
    assert codec.decode(codec.encode(c.SetQuota("*", 0, 0))) == c.SetQuota("*", 0, 0)
    tag = codec.TAGS[c.SetQuota]
    for fields in (["a", -1, 0], ["a", 1, "x"], ["#reserved", 0, 0], [1, 0, 0], ["a", 1]):
        with pytest.raises(ValueError):
            codec.decode(msgpack.packb([tag, *fields]))


def test_snapshot_and_restore_carry_the_quotas_and_recount_usage():
    state = new_state()
    state.apply(c.SetQuota("a", 1000, 5))
    state.apply(c.SetQuota("*", 10, 0))
    put_start(state, ("a", "k"), 300)
    put_start(state, reservation("b", 1), 7, writer=9)
    data = state.snapshot()
    copy = new_state(segments=0)
    copy.restore(data)
    assert copy.quotas == state.quotas
    assert usage(copy, "a") == (300, 1) and usage(copy, "b") == (7, 0)
    assert copy.digest() == state.digest()
    copy.check_invariants()
    refused(put_start, copy, ("a", "k2"), 701)
    # A snapshot of before quotas (format 1) restores with none.
    top = msgpack.unpackb(data, use_list=True)
    top["format"] = 1
    del top["quotas"], top["preempted"]  # nor preempted upserts (format 3)
    del top["settings_from_log"], top["generations"]  # nor replicated settings (format 3)
    del top["down_nodes"]  # nor nodes kept for their return (format 4)
    del top["arenas"], top["arena_seq"], top["arena_term"]  # nor arenas (format 4)
    for row in top["objects"]:
        del row[8]
    copy.restore(msgpack.packb(top, use_bin_type=True))
    assert copy.quotas == {} and usage(copy, "a") == (300, 1)
    for quotas in ([["a", -1, 0]], [["bad ns", 1, 1]], [["a", 1, 1], ["a", 2, 2]], [["a", 1]]):
        top = msgpack.unpackb(data, use_list=True)
        top["quotas"] = quotas
        with pytest.raises(ValueError):
            copy.restore(msgpack.packb(top, use_bin_type=True))


NAMESPACES = ["a", "b", "c"]
LIMITS = {"a": (6000, 4), "b": (3000, 0), "*": (0, 6)}


def random_command(rng: random.Random, state: StateMachine, now: int, step: int,
                   writers: dict, set_quotas: bool = False):
    """A random command of any kind that changes usage (None: nothing to do this step)."""
    key = (rng.choice(NAMESPACES), f"k{rng.randint(0, 6)}")
    choice = rng.random()
    if choice < 0.3:
        writer = rng.randint(1, 1000)
        writers[key] = writer
        return c.PutStart(key, rng.randint(1, 2500), rng.randint(1, 3), (), None, False,
                          rng.random() < 0.3, writer, now, rng.getrandbits(32))
    if choice < 0.45:
        return c.PutEnd(key, writers.get(key, 0), now, now + 20)
    if choice < 0.5:
        return c.PutRevoke(key, writers.get(key, 0), rng.choice([0, now + 50]))
    if choice < 0.6:
        return c.Remove(key, now + rng.randint(0, 50))
    if choice < 0.65:
        return c.Evict(tuple(rng.sample(sorted(state.objects), min(2, len(state.objects)))))
    if choice < 0.75:
        return c.PutStart(reservation(key[0], step), rng.randint(1, 2000), 1, (), None, False,
                          False, 9, now, rng.getrandbits(32))
    if choice < 0.85:
        held = [k for k in state.objects if k[0] == c.RESERVED_NAMESPACE]
        if not held:
            return None
        reserved = rng.choice(held)
        return c.PutCommit(reserved, key, state.objects[reserved].pending.size_bytes, None,
                           False, 9, now)
    if set_quotas and choice < 0.9:
        return c.SetQuota(rng.choice(NAMESPACES + ["*"]), rng.choice([0, 2000, 8000]),
                          rng.choice([0, 2, 5]))
    if choice < 0.97:
        return c.ReleaseExpired(now)
    return c.UnmountSegment(rng.choice(sorted(state.segments) or [0]))


def usage_table(state) -> dict:
    return {n: (u.bytes, u.objects) for n, u in state.usage.items()}


def test_random_sequences_keep_usage_equal_to_the_live_objects_and_within_quota():
    """Property: through random puts, ends, upserts, revokes, removes, reservations, commits,
    evictions, sweeps and unmounts, usage equals the recount from the objects after every
    command, no namespace passes its quota, and a refused command changes no table."""
    for seed in range(30):
        rng = random.Random(seed)
        state = new_state(segments=3, capacity=16 * KIB)
        for namespace, (max_bytes, max_objects) in LIMITS.items():
            state.apply(c.SetQuota(namespace, max_bytes, max_objects))
        now, writers, refusals = 0, {}, 0
        for step in range(300):
            now += rng.randint(0, 60)
            command = random_command(rng, state, now, step, writers)
            if command is None:
                continue
            before = (usage_table(state), set(state.objects), state.used_bytes())
            try:
                state.apply(command)
            except MooncakedError as exc:
                refusals += exc.code == ErrorCode.QUOTA_EXCEEDED
                after = (usage_table(state), set(state.objects), state.used_bytes())
                assert after == before, (seed, step, command, exc)
            state.check_invariants()
            for namespace, used in state.usage.items():
                max_bytes, max_objects = state.quota_of(namespace)
                assert not max_bytes or used.bytes <= max_bytes, (seed, step, namespace)
                assert not max_objects or used.objects <= max_objects, (seed, step)
        assert refusals > 0, seed  # the quotas were reached, not just never approached


def test_random_sequences_with_quota_changes_restore_and_follow_identically():
    """A snapshot taken anywhere in a run that also changes quotas, restored into another
    state machine, follows the rest of the run to the same digest at every step."""
    for seed in range(10):
        rng = random.Random(1000 + seed)
        leader = new_state(segments=3, capacity=16 * KIB)
        follower = None
        split = rng.randrange(200)
        now, writers = 0, {}
        for step in range(200):
            if step == split:
                follower = new_state(segments=0)
                follower.restore(leader.snapshot())
                assert usage_table(follower) == usage_table(leader)
            now += rng.randint(0, 60)
            command = random_command(rng, leader, now, step, writers, set_quotas=True)
            if command is None:
                continue
            results = []
            for state in (leader, follower) if follower else (leader,):
                try:
                    state.apply(command)
                    results.append(None)
                except MooncakedError as exc:
                    results.append(exc.code)
                state.check_invariants()
            if follower:
                assert results[0] == results[1], (seed, step, command)
                assert follower.digest() == leader.digest(), (seed, step, command)
                assert usage_table(follower) == usage_table(leader)


# -- eviction -------------------------------------------------------------------------------------

def test_eviction_takes_from_a_namespace_over_its_quota_first():
    master = new_master(eviction_ratio=0.01)
    state = master.state
    # Oldest first: b's objects, then a's.
    for i in range(4):
        master.put_start(("b", f"k{i}"), 10 * KIB, ReplicateConfig(), False, 1, i)
        master.put_end(("b", f"k{i}"), 1, i)
    for i in range(4):
        master.put_start(("a", f"k{i}"), 10 * KIB, ReplicateConfig(), False, 1, 10 + i)
        master.put_end(("a", f"k{i}"), 1, 10 + i)
    master.set_quota("a", 25 * KIB, 0)  # a is 15 KiB over: two of its objects
    now = 1000  # every lease is over
    chosen = master.choose_evictions(now, need_bytes=50 * KIB)
    assert chosen[:2] == [("a", "k0"), ("a", "k1")]  # a first, until back within its quota
    assert chosen[2:4] == [("b", "k0"), ("b", "k1")]  # then the oldest
    # Without an over-quota namespace, the oldest go first.
    master.set_quota("a", 0, 0)
    assert master.choose_evictions(now, need_bytes=10 * KIB) == [("b", "k0")]
    # An object quota counts too.
    master.set_quota("a", 0, 3)
    assert master.choose_evictions(now, need_bytes=10 * KIB) == [("a", "k0")]
    master.evict(now, need_bytes=10 * KIB)
    assert usage(state, "a") == (30 * KIB, 3) and state.namespaces_over_quota() == {}
    state.check_invariants()


def test_master_quota_report_lists_default_own_quotas_and_users():
    master = new_master()
    master.set_quota("a", 100, 0)
    master.set_quota("a", None, 5)  # None keeps the other limit
    master.put_start(("b", "k"), 10, ReplicateConfig(), False, 1, 0)
    report = {row["namespace"]: row for row in master.quota_report()}
    assert report["*"] == {"namespace": "*", "bytes": 0, "objects": 0, "max_bytes": 0,
                           "max_objects": 0, "own_quota": True}
    assert report["a"] == {"namespace": "a", "bytes": 0, "objects": 0, "max_bytes": 100,
                           "max_objects": 5, "own_quota": True}
    assert report["b"]["bytes"] == 10 and report["b"]["own_quota"] is False


# -- config ---------------------------------------------------------------------------------------

def test_config_reads_namespace_tables_and_checks_them():
    loaded = config_module.from_dict({"namespaces": {
        "*": {"max_bytes": 1 << 30}, "tenant-a": {"max_bytes": 1 << 20, "max_objects": 10}}})
    assert loaded.namespaces["*"].max_bytes == 1 << 30
    assert loaded.namespaces["*"].max_objects == 0
    assert loaded.namespaces["tenant-a"].max_objects == 10
    assert loaded.as_dict()["namespaces"]["tenant-a"] == {"max_bytes": 1 << 20,
                                                         "max_objects": 10}
    bad = [
        ({"bad name": {"max_bytes": 1}}, "is not a namespace"),
        ({"a": {"max_bytes": -1}}, "below the minimum 0"),
        ({"a": {"max_byte": 1}}, "unknown key [namespaces.\"a\"] max_byte"),
        ({"a": {"max_objects": "many"}}, "must be int"),
        ({"a": 5}, "must be a table"),
    ]
    for tables, message in bad:
        with pytest.raises(config_module.ConfigError) as info:
            config_module.from_dict({"namespaces": tables}, "f.toml")
        assert message in str(info.value) and str(info.value).startswith("f.toml"), info.value
    with pytest.raises(config_module.ConfigError):
        config_module.from_dict({"namespaces": 1})


# -- a real daemon --------------------------------------------------------------------------------

QUOTA_CONFIG = {'namespaces."*"': {"max_bytes": 64 * KIB},
                "namespaces.small": {"max_bytes": 10 * KIB, "max_objects": 3}}


def ctl(address: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKED_ADDRESS"}
    env["PYTHONPATH"] = REPO
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", address, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def quota_rows(client) -> dict:
    return {row["namespace"]: row for row in client.call("quota_list")}


def test_daemon_refuses_puts_over_the_quota_with_the_code(make_daemon):
    daemon = make_daemon(**QUOTA_CONFIG)
    with BlockingClient.connect(daemon.tcp_address, namespace="small") as client:
        assert client.put("k1", b"x" * (6 * KIB)) is True
        with pytest.raises(MooncakedError) as info:
            client.put("k2", b"y" * (5 * KIB))
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED == -3009
        assert "small" in info.value.message
        assert client.exists("k2") is False
        # The connection stays usable; what fits is stored.
        assert client.put("k2", b"y" * (4 * KIB - 1)) is True
        assert client.put("k3", b"z") is True
        with pytest.raises(MooncakedError) as info:
            client.put("k4", b"z")  # a fourth object, and a byte over
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        row = quota_rows(client)["small"]
        assert (row["bytes"], row["objects"]) == (10 * KIB, 3)
        assert (row["max_bytes"], row["max_objects"]) == (10 * KIB, 3)
        status = client.status()
    assert {r["namespace"]: r for r in status["namespaces"]}["small"]["objects"] == 3
    with BlockingClient.connect(daemon.tcp_address, namespace="other") as client:
        with pytest.raises(MooncakedError) as info:
            client.put("big", b"x" * (64 * KIB + 1))  # the default quota
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED


def test_daemon_batch_put_answers_per_key(make_daemon):
    daemon = make_daemon(**QUOTA_CONFIG)
    with BlockingClient.connect(daemon.tcp_address, namespace="small") as client:
        codes = client.batch_put(["a", "b", "c", "d"],
                                 [b"1" * (4 * KIB), b"2" * (4 * KIB), b"3" * (4 * KIB), b"4"])
        assert codes == [0, 0, ErrorCode.QUOTA_EXCEEDED, 0]
        assert client.batch_exists(["a", "b", "c", "d"]) == [True, True, False, True]
        assert client.get("d") == b"4"


def test_daemon_counts_shared_memory_puts_and_reservations(make_daemon):
    daemon = make_daemon(**QUOTA_CONFIG)
    size = 4 * KIB
    block = ctypes.create_string_buffer(b"s" * size, size)
    with BlockingClient.connect(daemon.unix_address, namespace="small") as client:
        assert client.put_from("m1", ctypes.addressof(block), size) is True
        assert client.put_from("m2", ctypes.addressof(block), size) is True
        # Two stored, and whatever the connection holds reserved: all within 10 KiB.
        row = quota_rows(client)["small"]
        assert row["objects"] == 2 and 2 * size <= row["bytes"] <= 10 * KIB
        with pytest.raises(MooncakedError) as info:
            client.put_from("m3", ctypes.addressof(block), size)
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        assert client.exists("m3") is False


def test_daemon_evicts_the_namespace_over_its_quota_first(make_daemon):
    value_bytes = 64 * KIB
    daemon = make_daemon(segments={"size_bytes": 1 << 20},
                         store={"lease_ttl_ms": 1, "eviction_high_watermark_ratio": 0.9})
    with BlockingClient.connect(daemon.tcp_address, namespace="keep") as keep, \
            BlockingClient.connect(daemon.tcp_address, namespace="greedy") as greedy:
        for i in range(6):  # the oldest objects
            assert keep.put(f"k{i}", bytes([i]) * value_bytes) is True
        for i in range(6):
            assert greedy.put(f"g{i}", bytes([i]) * value_bytes) is True
        keep.call("quota_set", "greedy", value_bytes, 0)  # greedy: 5 objects over
        for i in range(6, 9):  # past the watermark: something must go
            assert keep.put(f"k{i}", bytes([i]) * value_bytes) is True
        deadline = time.monotonic() + 10
        while keep.status()["evictions"]["objects"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert keep.batch_exists([f"k{i}" for i in range(9)]) == [True] * 9
        left = greedy.batch_exists([f"g{i}" for i in range(6)])
        assert left.count(False) >= 1
        rows = quota_rows(keep)
        assert rows["keep"]["objects"] == 9 and rows["greedy"]["objects"] == left.count(True)


def test_ctl_quota_set_and_ls_and_metrics(make_daemon):
    daemon = make_daemon()
    done = ctl(daemon.tcp_address, "-o", "json", "quota", "set", "team", "--max-bytes",
               "2048", "--max-objects", "2")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"namespace": "team", "max_bytes": 2048,
                                       "max_objects": 2}
    done = ctl(daemon.tcp_address, "quota", "set", "team", "--max-objects", "5")
    assert done.returncode == 0, done.stderr
    with BlockingClient.connect(daemon.tcp_address, namespace="team") as client:
        assert client.put("k", b"v" * 1000) is True
        with pytest.raises(MooncakedError) as info:
            client.put("k2", b"v" * 1049)
        assert info.value.code == ErrorCode.QUOTA_EXCEEDED
    done = ctl(daemon.tcp_address, "-o", "json", "quota", "ls")
    assert done.returncode == 0, done.stderr
    rows = {row["namespace"]: row for row in json.loads(done.stdout)}
    assert rows["team"] == {"namespace": "team", "bytes": 1000, "objects": 1,
                            "max_bytes": 2048, "max_objects": 5, "own_quota": True}
    done = ctl(daemon.tcp_address, "quota", "ls")
    lines = [line.split() for line in done.stdout.splitlines()]
    assert lines[0] == ["NAMESPACE", "BYTES", "OBJECTS", "MAX_BYTES", "MAX_OBJECTS", "QUOTA"]
    assert ["*", "0", "B", "0", "unlimited", "unlimited", "own"] in lines
    bad = ctl(daemon.tcp_address, "quota", "set", "bad name", "--max-bytes", "1")
    assert bad.returncode == 1 and "INVALID_PARAMS" in bad.stderr
    bad = ctl(daemon.tcp_address, "quota", "set", "team")
    assert bad.returncode == 2 and "--max-bytes" in bad.stderr
    bad = ctl(daemon.tcp_address, "quota", "set", "team", "--max-bytes", "-1")
    assert bad.returncode == 2

    from test_metrics import scrape, value
    _, families = scrape(daemon)
    assert value(families, "mooncaked_namespace_bytes", namespace="team") == 1000
    assert value(families, "mooncaked_namespace_objects", namespace="team") == 1
    assert value(families, "mooncaked_namespace_max_bytes", namespace="team") == 2048
    assert value(families, "mooncaked_namespace_max_objects", namespace="team") == 5
    assert value(families, "mooncaked_namespace_max_bytes", namespace="*") == 0


# -- a cluster ------------------------------------------------------------------------------------

def wait_until(check, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def cluster_quota(cluster, node_id: int, namespace: str):
    with cluster.client(node_id) as client:
        row = quota_rows(client).get(namespace)
    return row and (row["max_bytes"], row["max_objects"])


THREE = WireReplicateConfig(replica_num=3)


def team(cluster, node_id: int) -> BlockingClient:
    return BlockingClient.connect(cluster.nodes[node_id].tcp_address, namespace="team",
                                  timeout_s=10.0)


def test_cluster_quotas_go_through_the_log_and_survive_leader_change_and_restart():
    from cluster_harness import Cluster
    cluster = Cluster(3, cluster={"snapshot_entries": 20},
                      **{"namespaces.seeded": {"max_objects": 1}})
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        follower = next(i for i in (1, 2, 3) if i != leader)
        # The leader proposed its configured quota; every node applies it.
        for node_id in (1, 2, 3):
            wait_until(lambda: cluster_quota(cluster, node_id, "seeded") == (0, 1))
        # Set through a follower: the leader puts it in the log. Three replicas each, so that
        # the objects outlive the restart of one node below.
        with cluster.client(follower) as client:
            client.call("quota_set", "team", 100_000, 2)
        with team(cluster, 1) as client:
            assert client.put("a", b"1" * 1000, THREE) is True
            with pytest.raises(MooncakedError) as info:
                client.put("big", b"b" * 40_000, THREE)  # 120,000 bytes with its replicas
            assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        with team(cluster, 2) as client:
            assert client.put("b", b"2" * 1000, THREE) is True
        for node_id in (1, 2, 3):
            with team(cluster, node_id) as client:
                with pytest.raises(MooncakedError) as info:
                    client.put(f"c{node_id}", b"3")  # a third object
                assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        # Per key in a batch, through a follower.
        with team(cluster, follower) as client:
            client.remove("b", force=True)  # a new leader counts every object leased
            assert client.batch_put(["x", "y"], [b"4" * 500, b"5" * 500], THREE) == [
                0, ErrorCode.QUOTA_EXCEEDED]
        # A runtime change of a configured namespace stays: a new leader does not put its
        # config back.
        with cluster.client(leader) as client:
            client.call("quota_set", "seeded", None, 5)
            for i in range(25):  # past snapshot_entries: the state is compacted
                client.put(f"fill{i}", b"f" * 64, WireReplicateConfig(replica_num=2))
        with cluster.client(leader) as client:
            client.call("cluster_transfer_leader", follower)
        wait_until(lambda: cluster.wait_for_leader() == follower)
        with cluster.client(follower) as client:  # the new leader has applied its term start
            client.call("cluster_status")
        for node_id in (1, 2, 3):
            wait_until(lambda: cluster_quota(cluster, node_id, "team") == (100_000, 2))
            assert wait_until(lambda: cluster_quota(cluster, node_id, "seeded")) == (0, 5)
            with team(cluster, node_id) as client:
                with pytest.raises(MooncakedError) as info:
                    client.put(f"z{node_id}", b"z")
                assert info.value.code == ErrorCode.QUOTA_EXCEEDED
        assert "this node's config says" in cluster.nodes[follower].log()
        # A restarted node rebuilds the quotas and usage from its snapshot and the log.
        restarted = next(i for i in (1, 2, 3) if i != follower)
        cluster.nodes[restarted].terminate()
        cluster.nodes[restarted].start()
        cluster.wait_for_leader()
        assert cluster.status(restarted)["raft"]["snapshot_index"] > 0
        wait_until(lambda: cluster_quota(cluster, restarted, "team") == (100_000, 2))

        def usage_at(node_id):
            with cluster.client(node_id) as client:
                row = quota_rows(client)["team"]
            return row["bytes"], row["objects"]
        # Its replicas were dropped when it registered again: 2 of 3 left of each object.
        wait_until(lambda: usage_at(restarted) == usage_at(follower) == (2 * 1500, 2))
        with team(cluster, restarted) as client:
            with pytest.raises(MooncakedError) as info:
                client.put("again", b"z")
            assert info.value.code == ErrorCode.QUOTA_EXCEEDED
    finally:
        cluster.close()
