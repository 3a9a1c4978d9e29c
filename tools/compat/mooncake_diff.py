#!/usr/bin/env python3
"""Differential check of the Mooncake Store Python API: run one fixed list of calls against
the real `mooncake.store` or against `mooncaked.mooncake_store`, print every call and its
result as a JSON line, and compare two such outputs.

    # the real wheel (a mooncake_master with its HTTP metadata server must be running)
    MC_TCP_BIND_ADDRESS=127.0.0.1 /tmp/mcvenv/bin/python tools/compat/mooncake_diff.py \\
        --impl mooncake --master 127.0.0.1:RPC_PORT \\
        --metadata http://127.0.0.1:META_PORT/metadata > mooncake.jsonl
    # mooncaked (a daemon must be running)
    .venv/bin/python tools/compat/mooncake_diff.py --impl mooncaked \\
        --address unix:/run/mooncaked/mooncaked.sock > mooncaked.jsonl
    python3 tools/compat/mooncake_diff.py --compare mooncake.jsonl mooncaked.jsonl

tools/compat/mooncake-0.3.13.post1.jsonl is the output of the real wheel (0.3.13.post1,
non-CUDA, TCP, one client on a loopback mooncake_master), so a run against mooncaked can be
compared without the wheel. The differences left are those README.md lists ("Mooncake API
differences"): crashes of the wheel before setup / after close, TypeErrors for wrong
argument types, address 0, the buffers of failed reads, and a zero-size segment.

Every scenario runs in a child process of its own (some calls crash the real wheel: the
crash is then recorded as the result), with keys under a random prefix that the output
does not show. `--list` prints the scenario names, `--only NAME[,NAME]` runs some.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# ---------------------------------------------------------------------------- recording

PREFIX = ""


def short(text: str) -> str:
    return text.replace(PREFIX, "") if PREFIX else text


def describe(value, depth: int = 0):
    """A JSON-able description of a result that is the same for equal behaviour."""
    if depth > 6:
        return "..."
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return short(value)
    if type(value).__name__ == "BufferHandle":
        return {"BufferHandle": value.size(),
                "data": describe(ctypes.string_at(value.ptr(), value.size()))}
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if len(data) <= 48:
            return {"bytes": data.decode("latin-1")}
        return {"bytes_len": len(data), "sha1": hashlib.sha1(data).hexdigest()[:12]}
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {short(str(k)): describe(v, depth + 1) for k, v in value.items()}
    name = type(value).__name__
    if name == "Tensor":
        flat = value.detach().reshape(-1)
        return {"tensor": str(value.dtype), "shape": list(value.shape),
                "values": [float(x) for x in flat[:16].tolist()]}
    if name == "BufferHandle":
        return {"BufferHandle": value.size(),
                "data": describe(ctypes.string_at(value.ptr(), value.size()))}
    if name == "ReplicaDescriptor":
        return {"ReplicaDescriptor": str(getattr(value, "status", "?")),
                "is_memory": value.is_memory_replica()}
    if name == "ReplicateConfig":
        return {"ReplicateConfig": str(value)}
    return {"object": name}


def emit(scenario: str, label: str, result) -> None:
    print(json.dumps({"s": scenario, "call": label, "result": result}), flush=True)


class Recorder:
    def __init__(self, scenario: str) -> None:
        self.scenario = scenario

    def __call__(self, label: str, fn):
        try:
            value = fn()
        except Exception as error:  # noqa: BLE001 - the exception is the result
            emit(self.scenario, label, {"raise": type(error).__name__,
                                        "msg": short(str(error))[:160]})
            return error
        emit(self.scenario, label, describe(value))
        return value


# ------------------------------------------------------------------------------ set-up

ARGS = None


def store_module():
    if ARGS.impl == "mooncake":
        import mooncake.store as module
    else:
        sys.path.insert(0, REPO)
        import mooncaked.mooncake_store as module
    return module


def setup_args():
    """Positional setup() arguments for this implementation."""
    if ARGS.impl == "mooncake":
        return ["127.0.0.1", ARGS.metadata, 64 << 20, 64 << 20, "tcp", "", ARGS.master]
    return ["127.0.0.1", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", ARGS.address]


def new_store(m, setup: bool = True):
    store = m.MooncakeDistributedStore()
    if setup:
        code = store.setup(*setup_args())
        if code != 0:
            raise SystemExit(f"setup failed: {code}")
    return store


class Memory:
    """A ctypes region, optionally registered with the store."""

    def __init__(self, store, size: int, register: bool = True) -> None:
        self.buffer = ctypes.create_string_buffer(size)
        self.base = ctypes.addressof(self.buffer)
        self.size = size
        if register:
            assert store.register_buffer(self.base, size) == 0

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.base + offset, data, len(data))

    def read(self, offset: int, size: int) -> bytes:
        return ctypes.string_at(self.base + offset, size)


def K(name: str) -> str:
    return PREFIX + name


# --------------------------------------------------------------------------- scenarios

SCENARIOS: dict[str, callable] = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def basic(m, r):
    s = new_store(m)
    r("put a", lambda: s.put(K("a"), b"hello"))
    r("put a again (exists)", lambda: s.put(K("a"), b"other"))
    r("get a", lambda: s.get(K("a")))
    r("get missing", lambda: s.get(K("missing")))
    r("put empty value", lambda: s.put(K("empty"), b""))
    r("get empty", lambda: s.get(K("empty")))
    r("is_exist a", lambda: s.is_exist(K("a")))
    r("is_exist missing", lambda: s.is_exist(K("missing")))
    r("is_exist empty", lambda: s.is_exist(K("empty")))
    r("get_size a", lambda: s.get_size(K("a")))
    r("get_size missing", lambda: s.get_size(K("missing")))
    r("get_size empty", lambda: s.get_size(K("empty")))
    r("remove missing", lambda: s.remove(K("missing")))
    r("remove missing force", lambda: s.remove(K("missing"), True))
    r("put bytearray", lambda: s.put(K("ba"), bytearray(b"xyz")))
    r("get bytearray", lambda: s.get(K("ba")))
    r("put memoryview", lambda: s.put(K("mv"), memoryview(b"mview")))
    r("get memoryview", lambda: s.get(K("mv")))
    r("put str value", lambda: s.put(K("str"), "text"))
    r("put int value", lambda: s.put(K("int"), 5))
    r("put empty key", lambda: s.put("", b"v"))
    r("get empty key", lambda: s.get(""))
    r("is_exist empty key", lambda: s.is_exist(""))
    r("put None config", lambda: s.put(K("nc"), b"v", None))
    r("health_check", lambda: s.health_check())
    r("get_hostname form", lambda: bool(re.fullmatch(r"127\.0\.0\.1:\d+", s.get_hostname())))
    r("get_offload_rpc_read_count", lambda: s.get_offload_rpc_read_count())
    r("close", lambda: s.close())


@scenario
def remove_lease(m, r):
    s = new_store(m)
    r("put", lambda: s.put(K("r"), b"v"))
    r("remove unread", lambda: s.remove(K("r")))
    r("remove again", lambda: s.remove(K("r")))
    r("put 2", lambda: s.put(K("r2"), b"v"))
    r("get 2", lambda: s.get(K("r2")))
    r("remove just read", lambda: s.remove(K("r2")))
    r("remove just read force", lambda: s.remove(K("r2"), True))
    r("is_exist after force", lambda: s.is_exist(K("r2")))
    r("put 3", lambda: s.put(K("r3"), b"v"))
    r("is_exist 3", lambda: s.is_exist(K("r3")))
    r("remove after is_exist", lambda: s.remove(K("r3")))
    r("put 4", lambda: s.put(K("r4"), b"v"))
    r("get_size 4", lambda: s.get_size(K("r4")))
    r("remove after get_size", lambda: s.remove(K("r4")))
    s.close()


@scenario
def batches(m, r):
    s = new_store(m)
    r("put_batch", lambda: s.put_batch([K("b1"), K("b2")], [b"one", b"two"]))
    r("put_batch existing+new", lambda: s.put_batch([K("b1"), K("b3")], [b"ONE", b"three"]))
    r("put_batch mismatched", lambda: s.put_batch([K("b4"), K("b5")], [b"x"]))
    r("is_exist b4 after mismatch", lambda: s.is_exist(K("b4")))
    r("put_batch empty", lambda: s.put_batch([], []))
    r("put_batch duplicate keys", lambda: s.put_batch([K("d"), K("d")], [b"1", b"2"]))
    r("get d", lambda: s.get(K("d")))
    r("put_batch empty value", lambda: s.put_batch([K("be")], [b""]))
    r("get_batch", lambda: s.get_batch([K("b1"), K("missing"), K("b3")]))
    r("get_batch empty", lambda: s.get_batch([]))
    r("get_batch all missing", lambda: s.get_batch([K("m1"), K("m2")]))
    r("batch_is_exist empty", lambda: s.batch_is_exist([]))
    r("batch_is_exist", lambda: s.batch_is_exist([K("b1"), K("missing"), K("be")]))
    r("batch_remove empty", lambda: s.batch_remove([]))
    r("batch_remove", lambda: s.batch_remove([K("b2"), K("missing")]))
    r("batch_remove force", lambda: s.batch_remove([K("b3"), K("missing")], True))
    r("batch_remove read key", lambda: s.batch_remove([K("b1")]))
    r("batch_remove dup", lambda: s.batch_remove([K("d"), K("d")], True))
    s.close()


@scenario
def regex_and_all(m, r):
    s = new_store(m)
    for i in range(3):
        s.put(K(f"rx{i}"), b"v")
    s.put(K("other"), b"v")
    r("remove_by_regex 3", lambda: s.remove_by_regex(re.escape(K("rx")) + ".*"))
    r("remove_by_regex none", lambda: s.remove_by_regex(re.escape(K("rx")) + ".*"))
    r("remove_by_regex bad", lambda: s.remove_by_regex("("))
    r("put rg", lambda: s.put(K("rg"), b"v"))
    r("get rg", lambda: s.get(K("rg")))
    r("remove_by_regex leased", lambda: s.remove_by_regex(re.escape(K("rg"))))
    r("remove_by_regex leased force", lambda: s.remove_by_regex(re.escape(K("rg")), True))
    r("remove_by_regex other force", lambda: s.remove_by_regex(re.escape(K("other")), True))
    s.close()


@scenario
def remove_all_counts(m, r):
    s = new_store(m)
    s.remove_all(True)
    r("remove_all empty", lambda: s.remove_all())
    for i in range(3):
        s.put(K(f"ra{i}"), b"v")
    r("remove_all 3", lambda: s.remove_all())
    s.put(K("ra_read"), b"v")
    s.get(K("ra_read"))
    r("remove_all leased", lambda: s.remove_all())
    r("remove_all force", lambda: s.remove_all(True))
    s.close()


@scenario
def upserts(m, r):
    s = new_store(m)
    r("upsert new", lambda: s.upsert(K("u"), b"first"))
    r("upsert existing", lambda: s.upsert(K("u"), b"second!"))
    r("get u", lambda: s.get(K("u")))
    r("get_size u", lambda: s.get_size(K("u")))
    r("upsert empty", lambda: s.upsert(K("u"), b""))
    r("get u after empty", lambda: s.get(K("u")))
    r("upsert_batch", lambda: s.upsert_batch([K("u"), K("u2")], [b"A", b"B"]))
    r("get_batch u u2", lambda: s.get_batch([K("u"), K("u2")]))
    r("upsert_batch mismatched", lambda: s.upsert_batch([K("u"), K("u3")], [b"Z"]))
    r("upsert_batch empty", lambda: s.upsert_batch([], []))
    r("put_parts", lambda: s.put_parts(K("p"), b"ab", b"cd", bytearray(b"ef")))
    r("get p", lambda: s.get(K("p")))
    r("put_parts none", lambda: s.put_parts(K("p0")))
    r("is_exist p0", lambda: s.is_exist(K("p0")))
    r("put_parts existing", lambda: s.put_parts(K("p"), b"zz"))
    r("upsert_parts", lambda: s.upsert_parts(K("p"), b"x", b"y"))
    r("get p after upsert_parts", lambda: s.get(K("p")))
    r("put_parts str", lambda: s.put_parts(K("p1"), "str"))
    r("get u2 (lease)", lambda: s.get(K("u2")))
    r("upsert just read", lambda: s.upsert(K("u2"), b"C"))
    r("get u2 after", lambda: s.get(K("u2")))
    s.close()


@scenario
def zero_copy(m, r):
    s = new_store(m)
    mem = Memory(s, 1 << 16)
    stray = Memory(s, 1 << 12, register=False)
    mem.write(0, b"0123456789")
    stray.write(0, b"abcdefghij")
    r("put_from", lambda: s.put_from(K("z"), mem.base, 10))
    r("put_from existing", lambda: s.put_from(K("z"), mem.base + 1, 5))
    r("put_from unregistered", lambda: s.put_from(K("zu"), stray.base, 10))
    r("is_exist zu", lambda: s.is_exist(K("zu")))
    r("put_from size 0", lambda: s.put_from(K("z0"), mem.base, 0))
    r("is_exist z0", lambda: s.is_exist(K("z0")))
    r("put_from past end of registered", lambda: s.put_from(K("zp"), mem.base + mem.size - 4, 8))
    r("is_exist zp", lambda: s.is_exist(K("zp")))
    r("get_into", lambda: s.get_into(K("z"), mem.base + 100, 64))
    r("read back", lambda: mem.read(100, 10))
    r("get_into exact", lambda: s.get_into(K("z"), mem.base + 200, 10))
    r("get_into too small", lambda: s.get_into(K("z"), mem.base + 300, 4))
    r("read too small", lambda: mem.read(300, 4))
    r("get_into size 0", lambda: s.get_into(K("z"), mem.base + 300, 0))
    r("get_into missing", lambda: s.get_into(K("missing"), mem.base, 64))
    r("get_into unregistered", lambda: s.get_into(K("z"), stray.base, 64))
    r("read unregistered", lambda: stray.read(0, 10))
    s.put(K("ze"), b"")
    r("get_into empty value", lambda: s.get_into(K("ze"), mem.base, 64))
    r("batch_put_from", lambda: s.batch_put_from([K("y1"), K("y2")], [mem.base, mem.base + 2],
                                                 [3, 4]))
    r("batch_put_from mismatched", lambda: s.batch_put_from([K("y3"), K("y4")], [mem.base],
                                                            [3, 4]))
    r("batch_put_from empty", lambda: s.batch_put_from([], [], []))
    r("batch_put_from unregistered+ok", lambda: s.batch_put_from(
        [K("y5"), K("y6")], [stray.base, mem.base], [3, 3]))
    r("batch_put_from existing", lambda: s.batch_put_from([K("y1")], [mem.base + 5], [3]))
    r("get y1", lambda: s.get(K("y1")))
    r("batch_put_from zero size", lambda: s.batch_put_from([K("y7")], [mem.base], [0]))
    r("batch_get_into", lambda: s.batch_get_into(
        [K("y1"), K("missing"), K("y2"), K("z")], [mem.base + 1000, mem.base + 1100,
                                                   mem.base + 1200, mem.base + 1300],
        [64, 64, 64, 4]))
    r("batch_get_into read", lambda: [mem.read(1000, 3), mem.read(1200, 4)])
    r("batch_get_into mismatched", lambda: s.batch_get_into([K("y1"), K("y2")], [mem.base],
                                                            [64, 64]))
    r("batch_get_into empty", lambda: s.batch_get_into([], [], []))
    r("batch_get_into unregistered", lambda: s.batch_get_into([K("y1")], [stray.base], [64]))
    r("batch_get_into zero size", lambda: s.batch_get_into([K("y1")], [mem.base], [0]))
    r("unregister_buffer unknown", lambda: s.unregister_buffer(stray.base))
    r("register_buffer again", lambda: s.register_buffer(mem.base, mem.size))
    r("unregister_buffer", lambda: s.unregister_buffer(mem.base))
    r("unregister_buffer twice", lambda: s.unregister_buffer(mem.base))
    r("put_from after unregister", lambda: s.put_from(K("zz"), mem.base, 4))
    s.close()


@scenario
def multi_buffers(m, r):
    s = new_store(m)
    mem = Memory(s, 1 << 16)
    stray = Memory(s, 1 << 12, register=False)
    for i in range(4):
        mem.write(i * 16, bytes([65 + i]) * 16)
    b = mem.base
    r("put multi", lambda: s.batch_put_from_multi_buffers(
        [K("m1"), K("m2")], [[b, b + 16], [b + 32]], [[16, 8], [16]]))
    r("get m1", lambda: s.get(K("m1")))
    r("put multi existing", lambda: s.batch_put_from_multi_buffers([K("m1")], [[b + 48]], [[4]]))
    r("get m1 after", lambda: s.get(K("m1")))
    r("put multi zero sizes", lambda: s.batch_put_from_multi_buffers([K("m0")], [[b, b]], [[0, 0]]))
    r("is_exist m0", lambda: s.is_exist(K("m0")))
    r("put multi one zero part", lambda: s.batch_put_from_multi_buffers(
        [K("m3")], [[b, b + 16]], [[0, 4]]))
    r("get m3", lambda: s.get(K("m3")))
    r("put multi no buffers", lambda: s.batch_put_from_multi_buffers([K("m4")], [[]], [[]]))
    r("put multi mismatched keys", lambda: s.batch_put_from_multi_buffers(
        [K("m5"), K("m6")], [[b]], [[4]]))
    r("put multi mismatched inner", lambda: s.batch_put_from_multi_buffers(
        [K("m7")], [[b, b + 4]], [[4]]))
    r("put multi unregistered", lambda: s.batch_put_from_multi_buffers(
        [K("m8"), K("m9")], [[stray.base], [b]], [[4], [4]]))
    r("put multi empty", lambda: s.batch_put_from_multi_buffers([], [], []))
    out = b + 4096
    r("get multi exact", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 100]], [[16, 8]]))
    r("get multi exact read", lambda: [mem.read(4096, 16), mem.read(4196, 8)])
    r("get multi larger buffers", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 100]], [[20, 20]]))
    r("get multi larger read", lambda: [mem.read(4096, 20), mem.read(4196, 20)])
    r("get multi one big buffer", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out + 512]], [[64]]))
    r("get multi one big read", lambda: mem.read(4608, 24))
    r("get multi smaller", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 100]], [[8, 8]]))
    r("get multi zero sizes", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out]], [[0, 0]]))
    r("get multi missing", lambda: s.batch_get_into_multi_buffers(
        [K("missing"), K("m2")], [[out], [out + 200]], [[64], [64]]))
    r("get multi mismatched keys", lambda: s.batch_get_into_multi_buffers(
        [K("m1"), K("m2")], [[out]], [[64]]))
    r("get multi mismatched inner", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 64]], [[64]]))
    r("get multi unregistered", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[stray.base]], [[64]]))
    r("get multi empty", lambda: s.batch_get_into_multi_buffers([], [], []))
    r("get multi no buffers", lambda: s.batch_get_into_multi_buffers([K("m1")], [[]], [[]]))
    s.put(K("mz"), b"")
    r("get multi empty value", lambda: s.batch_get_into_multi_buffers([K("mz")], [[out]], [[8]]))
    r("get multi inner mismatch small", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 64]], [[8]]))
    r("get multi more sizes than ptrs", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out]], [[16, 8]]))
    r("get multi two parts exact split 12/12", lambda: s.batch_get_into_multi_buffers(
        [K("m1")], [[out, out + 100]], [[12, 12]]))
    r("get multi 12/12 read", lambda: [mem.read(4096, 12), mem.read(4196, 12)])
    r("get multi unregistered exact", lambda: s.batch_get_into_multi_buffers(
        [K("m2")], [[stray.base]], [[16]]))
    r("put multi more sizes than ptrs", lambda: s.batch_put_from_multi_buffers(
        [K("m10")], [[b]], [[4, 4]]))
    r("put multi duplicate keys", lambda: s.batch_put_from_multi_buffers(
        [K("md"), K("md")], [[b], [b + 16]], [[4], [4]]))
    r("get md", lambda: s.get(K("md")))
    s.close()


@scenario
def ranges(m, r):
    s = new_store(m)
    mem = Memory(s, 1 << 14)
    stray = Memory(s, 1 << 12, register=False)
    s.put(K("g1"), b"0123456789")
    s.put(K("g2"), b"abcdefghijklmnop")
    b = mem.base
    r("ranges basic", lambda: s.get_into_ranges(
        [b], [[K("g1"), K("g2")]], [[[0, 4], [8]]], [[[0, 6], [2]]], [[[4, 4], [5]]]))
    r("ranges read", lambda: mem.read(0, 13))
    r("ranges past end", lambda: s.get_into_ranges([b + 100], [[K("g1")]], [[[0]]], [[[8]]],
                                                   [[[10]]]))
    r("ranges past end read", lambda: mem.read(100, 10))
    r("ranges src beyond", lambda: s.get_into_ranges([b], [[K("g1")]], [[[0]]], [[[20]]],
                                                     [[[4]]]))
    r("ranges missing", lambda: s.get_into_ranges([b], [[K("missing")]], [[[0]]], [[[0]]],
                                                  [[[4]]]))
    r("ranges zero size", lambda: s.get_into_ranges([b], [[K("g1")]], [[[0]]], [[[0]]], [[[0]]]))
    r("ranges unregistered", lambda: s.get_into_ranges([stray.base], [[K("g1")]], [[[0]]],
                                                       [[[0]]], [[[4]]]))
    r("ranges mismatched outer", lambda: s.get_into_ranges([b, b], [[K("g1")]], [[[0]]],
                                                           [[[0]]], [[[4]]]))
    r("ranges mismatched inner", lambda: s.get_into_ranges([b], [[K("g1")]], [[[0, 1]]],
                                                           [[[0]]], [[[4]]]))
    r("ranges empty", lambda: s.get_into_ranges([], [], [], [], []))
    r("ranges beyond buffer", lambda: s.get_into_ranges([b], [[K("g1")]], [[[mem.size - 2]]],
                                                        [[[0]]], [[[4]]]))
    s.close()


@scenario
def buffers_and_replicas(m, r):
    s = new_store(m)
    s.put(K("h"), b"handle")
    r("get_buffer miss", lambda: s.get_buffer(K("missing")))
    r("get_buffer hit", lambda: s.get_buffer(K("h")))
    r("batch_get_buffer", lambda: s.batch_get_buffer([K("h"), K("missing")]))
    r("batch_get_buffer empty", lambda: s.batch_get_buffer([]))
    s.put(K("he"), b"")
    r("get_buffer empty value", lambda: s.get_buffer(K("he")))
    r("get_replica_desc miss", lambda: s.get_replica_desc(K("missing")))
    r("get_replica_desc hit", lambda: s.get_replica_desc(K("h")))
    r("batch_get_replica_desc miss", lambda: s.batch_get_replica_desc([K("missing")]))
    r("batch_get_replica_desc mixed", lambda: s.batch_get_replica_desc([K("h"), K("missing")]))
    r("batch_get_replica_desc empty", lambda: s.batch_get_replica_desc([]))
    r("batch_replica_clear miss", lambda: s.batch_replica_clear([K("missing")], ""))
    s.close()


@scenario
def replicate_config(m, r):
    c = m.ReplicateConfig()
    r("str default", lambda: str(c))
    r("replica_num default", lambda: c.replica_num)
    r("with_soft_pin default", lambda: c.with_soft_pin)
    r("preferred_segment default", lambda: c.preferred_segment)
    r("preferred_segments default", lambda: list(c.preferred_segments))
    r("prefer_alloc_in_same_node default", lambda: c.prefer_alloc_in_same_node)

    def set_attr(name, value):
        setattr(c, name, value)
        return getattr(c, name)
    r("replica_num = 2", lambda: set_attr("replica_num", 2))
    r("replica_num = 'x'", lambda: set_attr("replica_num", "x"))
    r("replica_num = -1", lambda: set_attr("replica_num", -1))
    r("replica_num = 1.5", lambda: set_attr("replica_num", 1.5))
    r("replica_num = True", lambda: set_attr("replica_num", True))
    r("with_soft_pin = 1", lambda: set_attr("with_soft_pin", 1))
    r("with_soft_pin = True", lambda: set_attr("with_soft_pin", True))
    r("preferred_segment = 5", lambda: set_attr("preferred_segment", 5))
    r("preferred_segment = 'seg'", lambda: set_attr("preferred_segment", "seg"))
    r("preferred_segments = ['a']", lambda: set_attr("preferred_segments", ["a", "b"]))
    r("preferred_segments = 'ab'", lambda: set_attr("preferred_segments", "ab"))
    r("unknown attr", lambda: set_attr("no_such_field", 1))
    r("str set", lambda: str(c))
    r("repr type", lambda: type(repr(c)).__name__)
    r("ctor arg", lambda: m.ReplicateConfig(2))
    s = new_store(m)
    c2 = m.ReplicateConfig()
    c2.replica_num = 0
    r("put replica_num 0", lambda: s.put(K("rc0"), b"v", c2))
    c3 = m.ReplicateConfig()
    c3.replica_num = 5
    r("put replica_num 5", lambda: s.put(K("rc5"), b"v", c3))
    c4 = m.ReplicateConfig()
    c4.preferred_segment = "nosuchsegment:1"
    r("put preferred missing segment", lambda: s.put(K("rcp"), b"v", c4))
    r("put config not a config", lambda: s.put(K("rcx"), b"v", 3))
    s.close()


@scenario
def setup_errors(m, r):
    args = setup_args()

    def attempt(**over):
        store = m.MooncakeDistributedStore()
        config = {"local_hostname": args[0], "metadata_server": args[1],
                  "global_segment_size": str(args[2]), "local_buffer_size": str(args[3]),
                  "protocol": "tcp", "master_server_addr": args[6]}
        config.update(over)
        for k in [k for k, v in config.items() if v is None]:
            del config[k]
        code = store.setup(config)
        if code == 0:
            store.close()
        return code
    r("dict ok", lambda: attempt())
    r("dict global 50%", lambda: attempt(global_segment_size="50%"))
    r("dict local 50%", lambda: attempt(local_buffer_size="50%"))
    r("dict global garbage", lambda: attempt(global_segment_size="lots"))
    r("dict global 16MB", lambda: attempt(global_segment_size="16MB"))
    r("dict global '16 mb'", lambda: attempt(global_segment_size="16 mb"))
    r("dict global 0", lambda: attempt(global_segment_size="0"))
    r("dict global 100", lambda: attempt(global_segment_size="100"))
    r("dict global -1", lambda: attempt(global_segment_size="-1"))
    r("dict local 0", lambda: attempt(local_buffer_size="0"))
    r("dict local 100", lambda: attempt(local_buffer_size="100"))
    r("dict no hostname", lambda: attempt(local_hostname=None))
    r("dict no metadata", lambda: attempt(metadata_server=None))
    r("dict bad bool", lambda: attempt(enable_ssd_offload="maybe"))
    r("positional negative size", lambda: m.MooncakeDistributedStore().setup(
        args[0], args[1], -1, args[3], "tcp", "", args[6]))
    r("positional str size", lambda: m.MooncakeDistributedStore().setup(
        args[0], args[1], "16MB", args[3], "tcp", "", args[6]))
    r("positional too few", lambda: m.MooncakeDistributedStore().setup(args[0], args[1]))

    def small():
        store = m.MooncakeDistributedStore()
        code = store.setup(args[0], args[1], 100, args[3], "tcp", "", args[6])
        if code == 0:
            store.close()
        return code
    r("positional global 100", small)

    def zero_global():
        store = m.MooncakeDistributedStore()
        code = store.setup(args[0], args[1], 0, args[3], "tcp", "", args[6])
        if code == 0:
            code = [code, store.put(K("zg"), b"v"), store.get(K("zg"))]
            store.close()
        return code
    r("positional global 0 then put", zero_global)

    def twice():
        store = m.MooncakeDistributedStore()
        first = store.setup(*args)
        second = store.setup(*args)
        store.close()
        return [first, second]
    r("setup twice", twice)

    def close_twice():
        store = m.MooncakeDistributedStore()
        store.setup(*args)
        return [store.close(), store.close()]
    r("close twice", close_twice)


@scenario
def tensors(m, r):
    try:
        import torch
    except ImportError:
        r("torch", lambda: "missing")
        return
    s = new_store(m)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    r("put_tensor", lambda: s.put_tensor(K("t"), t))
    r("put_tensor existing", lambda: s.put_tensor(K("t"), t + 1))
    r("get_tensor", lambda: s.get_tensor(K("t")))
    r("get_tensor missing", lambda: s.get_tensor(K("missing")))
    r("get_size tensor", lambda: s.get_size(K("t")))
    r("put_tensor not tensor", lambda: s.put_tensor(K("tn"), b"abc"))
    r("put_tensor non-contiguous", lambda: s.put_tensor(K("tnc"), t.t()))
    r("get_tensor non-contiguous", lambda: s.get_tensor(K("tnc")))
    r("put_tensor bf16", lambda: s.put_tensor(K("tb"), t.to(torch.bfloat16)))
    r("get_tensor bf16", lambda: s.get_tensor(K("tb")))
    r("put_tensor empty", lambda: s.put_tensor(K("te"), torch.empty(0)))
    r("get_tensor empty", lambda: s.get_tensor(K("te")))
    r("put_tensor scalar", lambda: s.put_tensor(K("ts"), torch.tensor(3.0)))
    r("get_tensor scalar", lambda: s.get_tensor(K("ts")))
    s.put(K("raw"), b"not a tensor")
    r("get_tensor raw bytes", lambda: s.get_tensor(K("raw")))
    r("batch_put_tensor", lambda: s.batch_put_tensor([K("t1"), K("t2")], [t, t * 2]))
    r("batch_put_tensor mismatched", lambda: s.batch_put_tensor([K("t3"), K("t4")], [t]))
    r("batch_put_tensor empty", lambda: s.batch_put_tensor([], []))
    r("batch_get_tensor", lambda: s.batch_get_tensor([K("t1"), K("missing"), K("t2")]))
    r("batch_get_tensor empty", lambda: s.batch_get_tensor([]))
    r("upsert_tensor", lambda: s.upsert_tensor(K("t1"), t * 3))
    r("get_tensor t1", lambda: s.get_tensor(K("t1")))
    mem = Memory(s, 1 << 14)
    r("get_tensor_into", lambda: s.get_tensor_into(K("t"), mem.base, 1 << 14))
    r("get_tensor_into too small", lambda: s.get_tensor_into(K("t"), mem.base, 16))
    r("get_tensor_into missing", lambda: s.get_tensor_into(K("missing"), mem.base, 1 << 14))
    stray = Memory(s, 1 << 12, register=False)
    r("get_tensor_into unregistered", lambda: s.get_tensor_into(K("t"), stray.base, 1 << 12))
    r("batch_get_tensor_into", lambda: s.batch_get_tensor_into(
        [K("t"), K("missing"), K("t2")], [mem.base, mem.base + 4096, mem.base + 8192],
        [4096, 4096, 16]))
    r("batch_get_tensor_into mismatched", lambda: s.batch_get_tensor_into(
        [K("t"), K("t2")], [mem.base], [4096]))
    r("put_tensor_with_tp", lambda: s.put_tensor_with_tp(K("tp"), t, tp_rank=0, tp_size=2,
                                                          split_dim=1))
    r("put_tensor_with_tp uneven", lambda: s.put_tensor_with_tp(K("tpu"), t, tp_rank=0,
                                                                 tp_size=2, split_dim=0))
    r("get_tensor_with_tp", lambda: s.get_tensor_with_tp(K("tp"), tp_rank=1, tp_size=2,
                                                          split_dim=1))
    r("get tp shard key", lambda: s.get_tensor(K("tp") + "_tp_1"))
    r("get_tensor_with_tp missing", lambda: s.get_tensor_with_tp(K("missing"), tp_rank=0,
                                                                  tp_size=2, split_dim=0))
    s.close()


@scenario
def probes(m, r):
    s = new_store(m)
    mem = Memory(s, 1 << 16)
    stray = Memory(s, 1 << 12, register=False)
    mem.write(0, b"0123456789abcdef")
    b = mem.base
    r("get_size empty key", lambda: s.get_size(""))
    r("remove empty key", lambda: s.remove(""))
    r("batch_is_exist empty key", lambda: s.batch_is_exist(["", K("nope")]))
    r("get_buffer empty key", lambda: s.get_buffer(""))
    r("batch_remove empty key", lambda: s.batch_remove([""]))
    r("get_batch empty key", lambda: s.get_batch([""]))
    r("register inside registered", lambda: s.register_buffer(b + 64, 128))
    r("register overlapping end", lambda: s.register_buffer(b + mem.size - 8, 64))
    r("register stray", lambda: s.register_buffer(stray.base, 64))
    r("register stray again bigger", lambda: s.register_buffer(stray.base, 128))
    r("unregister stray", lambda: s.unregister_buffer(stray.base))
    r("register stray after unregister", lambda: s.register_buffer(stray.base, 64))
    r("unregister stray 2", lambda: s.unregister_buffer(stray.base))
    r("unregister inside", lambda: s.unregister_buffer(b + 64))
    r("register size 0", lambda: s.register_buffer(stray.base, 0))
    r("register ptr 0", lambda: s.register_buffer(0, 64))
    r("put_from ptr 0", lambda: s.put_from(K("p0"), 0, 4))
    r("get_into ptr 0", lambda: s.get_into(K("p0"), 0, 4))
    r("upsert_from size 0", lambda: s.upsert_from(K("uz"), b, 0))
    r("is_exist uz", lambda: s.is_exist(K("uz")))
    r("upsert_from unregistered", lambda: s.upsert_from(K("uu"), stray.base, 4))
    r("get uu", lambda: s.get(K("uu")))
    r("upsert_parts none", lambda: s.upsert_parts(K("upn")))
    r("is_exist upn", lambda: s.is_exist(K("upn")))
    r("put_parts empty part", lambda: s.put_parts(K("ppe"), b""))
    r("put_parts empty+data", lambda: s.put_parts(K("ppd"), b"", b"ab"))
    r("get ppd", lambda: s.get(K("ppd")))
    r("upsert_batch dup", lambda: s.upsert_batch([K("ud"), K("ud")], [b"1", b"2"]))
    r("get ud", lambda: s.get(K("ud")))
    r("put_batch dup existing", lambda: s.put_batch([K("ud"), K("ud")], [b"3", b"4"]))
    r("get ud 2", lambda: s.get(K("ud")))
    r("put_batch dup with empty", lambda: s.put_batch([K("de"), K("de")], [b"x", b""]))
    r("get de", lambda: s.get(K("de")))
    r("batch_put_from dup", lambda: s.batch_put_from([K("bd"), K("bd")], [b, b + 4], [4, 4]))
    r("get bd", lambda: s.get(K("bd")))
    r("batch_put_from zero and ok", lambda: s.batch_put_from([K("bz"), K("bo")], [b, b],
                                                             [0, 4]))
    r("batch_get dup", lambda: s.get_batch([K("bd"), K("bd")]))
    r("batch_is_exist dup", lambda: s.batch_is_exist([K("bd"), K("bd")]))
    r("batch_get_into dup", lambda: s.batch_get_into([K("bd"), K("bd")], [b + 100, b + 200],
                                                     [4, 4]))
    r("batch_remove dup", lambda: s.batch_remove([K("bo"), K("bo")], True))
    r("put_from unregistered then get", lambda: [s.put_from(K("un"), stray.base, 4),
                                                 s.get(K("un"))])
    r("get_into unregistered small", lambda: s.get_into(K("un"), stray.base, 2))
    r("get_into negative size", lambda: s.get_into(K("un"), b, -1))
    r("put_from negative size", lambda: s.put_from(K("neg"), b, -1))
    r("put_batch with None value", lambda: s.put_batch([K("nv")], [None]))
    r("get_batch with None key", lambda: s.get_batch([None]))
    r("put key not str", lambda: s.put(5, b"v"))
    r("get key bytes", lambda: s.get(b"k"))
    r("remove_all not bool", lambda: s.remove_all("yes"))
    r("get_hostname twice same", lambda: s.get_hostname() == s.get_hostname())
    s.close()


@scenario
def threads(m, r):
    from concurrent.futures import ThreadPoolExecutor
    s = new_store(m)
    values = [bytes([65 + i]) * 8 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        r("8 threads put one key", lambda: sorted(pool.map(lambda v: s.put(K("t"), v), values)))
        r("value is one of them", lambda: s.get(K("t")) in values)
        r("8 threads put own keys", lambda: sorted(pool.map(
            lambda i: s.put(K(f"t{i}"), values[i]), range(8))))
        r("8 threads get own keys", lambda: list(pool.map(lambda i: s.get(K(f"t{i}")),
                                                          range(8))))
        r("8 threads remove one key (force)", lambda: sorted(pool.map(
            lambda _: s.remove(K("t"), True), range(8))))
        r("8 threads upsert one key", lambda: sorted(pool.map(
            lambda v: s.upsert(K("u"), v), values)))
        r("upserted value is one of them", lambda: s.get(K("u")) in values)
        r("8 threads batch_is_exist", lambda: list(pool.map(
            lambda i: s.batch_is_exist([K(f"t{i}"), K("t")]), range(8))))
        r("8 threads remove_by_regex", lambda: sorted(pool.map(
            lambda i: s.remove_by_regex(re.escape(K(f"t{i}")) + "$", True), range(8))))
    s.close()


# Calls made on a store that was never set up, or one that was closed: one child each.
EDGE_CALLS = {
    "put": lambda s, m: s.put(K("x"), b"v"),
    "get": lambda s, m: s.get(K("x")),
    "put_batch": lambda s, m: s.put_batch([K("x")], [b"v"]),
    "get_batch": lambda s, m: s.get_batch([K("x")]),
    "is_exist": lambda s, m: s.is_exist(K("x")),
    "batch_is_exist": lambda s, m: s.batch_is_exist([K("x")]),
    "get_size": lambda s, m: s.get_size(K("x")),
    "remove": lambda s, m: s.remove(K("x")),
    "batch_remove": lambda s, m: s.batch_remove([K("x")]),
    "remove_by_regex": lambda s, m: s.remove_by_regex(K("x")),
    "remove_all": lambda s, m: s.remove_all(),
    "upsert": lambda s, m: s.upsert(K("x"), b"v"),
    "put_parts": lambda s, m: s.put_parts(K("x"), b"v"),
    "register_buffer": lambda s, m: s.register_buffer(_edge_buffer(), 64),
    "unregister_buffer": lambda s, m: s.unregister_buffer(_edge_buffer()),
    "put_from": lambda s, m: s.put_from(K("x"), _edge_buffer(), 4),
    "get_into": lambda s, m: s.get_into(K("x"), _edge_buffer(), 4),
    "batch_put_from": lambda s, m: s.batch_put_from([K("x")], [_edge_buffer()], [4]),
    "batch_get_into": lambda s, m: s.batch_get_into([K("x")], [_edge_buffer()], [4]),
    "batch_put_from_multi_buffers": lambda s, m: s.batch_put_from_multi_buffers(
        [K("x")], [[_edge_buffer()]], [[4]]),
    "batch_get_into_multi_buffers": lambda s, m: s.batch_get_into_multi_buffers(
        [K("x")], [[_edge_buffer()]], [[4]]),
    "get_into_ranges": lambda s, m: s.get_into_ranges([_edge_buffer()], [[K("x")]], [[[0]]],
                                                      [[[0]]], [[[4]]]),
    "get_buffer": lambda s, m: s.get_buffer(K("x")),
    "batch_get_buffer": lambda s, m: s.batch_get_buffer([K("x")]),
    "get_replica_desc": lambda s, m: s.get_replica_desc(K("x")),
    "batch_get_replica_desc": lambda s, m: s.batch_get_replica_desc([K("x")]),
    "health_check": lambda s, m: s.health_check(),
    "get_hostname": lambda s, m: s.get_hostname(),
    "close": lambda s, m: s.close(),
    "alloc_from_mem_pool": lambda s, m: s.alloc_from_mem_pool(64),
    "get_offload_rpc_read_count": lambda s, m: s.get_offload_rpc_read_count(),
    "put_tensor": lambda s, m: s.put_tensor(K("x"), __import__("torch").zeros(2)),
    "get_tensor": lambda s, m: s.get_tensor(K("x")),
}
_EDGE_MEMORY = []


def _edge_buffer() -> int:
    if not _EDGE_MEMORY:
        _EDGE_MEMORY.append(ctypes.create_string_buffer(64))
    return ctypes.addressof(_EDGE_MEMORY[0])


def _edge(kind: str, call: str):
    def run(m, r):
        if kind == "closed":
            s = new_store(m)
            s.close()
        else:
            s = new_store(m, setup=False)
        r(call, lambda: EDGE_CALLS[call](s, m))
    run.__name__ = f"{kind}:{call}"
    return run


for _kind in ("unset", "closed"):
    for _call in EDGE_CALLS:
        SCENARIOS[f"{_kind}:{_call}"] = _edge(_kind, _call)


# ------------------------------------------------------------------------------ driver

def run_child(name: str) -> None:
    global PREFIX
    PREFIX = f"mcdiff-{uuid.uuid4().hex[:8]}-"
    m = store_module()
    SCENARIOS[name](m, Recorder(name))
    sys.stdout.flush()
    os._exit(0)  # skip the wheel's teardown: a crash there is not the scenario's result


def run_all(names: list[str]) -> int:
    failed = 0
    for name in names:
        argv = [sys.executable, os.path.abspath(__file__), "--child", name, "--impl", ARGS.impl,
                "--master", ARGS.master, "--metadata", ARGS.metadata, "--address", ARGS.address]
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, timeout=ARGS.timeout)
            out, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as timeout:
            out = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else \
                (timeout.stdout or "")
            code = "timeout"
        sys.stdout.write(out)
        if code != 0:
            failed += 1
            emit(name, "<process>", {"crash": code})
        sys.stdout.flush()
    return failed


def load(path: str) -> dict:
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
                rows[(row["s"], row["call"])] = row["result"]
    return rows


def strip_messages(value):
    if isinstance(value, dict):
        return {k: strip_messages(v) for k, v in value.items() if k != "msg"}
    if isinstance(value, list):
        return [strip_messages(v) for v in value]
    return value


def compare(a_path: str, b_path: str) -> int:
    a, b = load(a_path), load(b_path)
    differences = 0
    for key in list(a) + [k for k in b if k not in a]:
        left, right = a.get(key, "<absent>"), b.get(key, "<absent>")
        if strip_messages(left) != strip_messages(right):
            differences += 1
            print(f"{key[0]} | {key[1]}\n    {a_path}: {json.dumps(left)}\n"
                  f"    {b_path}: {json.dumps(right)}")
    print(f"{differences} difference(s) in {len(set(a) | set(b))} calls")
    return 1 if differences else 0


def main() -> int:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("mooncake", "mooncaked"), default="mooncaked")
    parser.add_argument("--master", default="127.0.0.1:50051",
                        help="mooncake_master RPC address (--impl mooncake)")
    parser.add_argument("--metadata", default="http://127.0.0.1:8080/metadata",
                        help="metadata server URL (--impl mooncake)")
    parser.add_argument("--address", default=os.environ.get("MOONCAKED_ADDRESS", ""),
                        help="mooncaked address, unix:PATH or HOST:PORT (--impl mooncaked)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ARGS = parser.parse_args()
    if ARGS.compare:
        return compare(*ARGS.compare)
    if ARGS.list:
        print("\n".join(SCENARIOS))
        return 0
    if ARGS.child:
        run_child(ARGS.child)
        return 0
    names = [n for n in ARGS.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    run_all(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
