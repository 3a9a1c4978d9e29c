"""Edge-case behaviour of the Mooncake API, as observed on the real wheel
(mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP, one client and a mooncake_master) with
tools/compat/mooncake_diff.py, checked here on a real mooncaked over the Unix socket and TCP
without the wheel. Each expectation is the value Mooncake returned for the same call; the
differences mooncaked keeps on purpose are in README.md, "Mooncake API differences"."""

from __future__ import annotations

import ctypes
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncaked.mooncake_store import MooncakeDistributedStore, ReplicateConfig

NOT_FOUND, HAS_LEASE, INVALID, TRANSFER_FAIL = -704, -706, -600, -800


@pytest.fixture(params=["unix", "tcp"])
def store(request, daemon):
    address = daemon.unix_address if request.param == "unix" else daemon.tcp_address
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", address) == 0
    yield store
    store.close()


@pytest.fixture
def k():
    prefix = f"b{uuid.uuid4().hex[:8]}-"
    return lambda name: prefix + name


class Memory:
    def __init__(self, store, size, register=True):
        self.buffer = ctypes.create_string_buffer(size)
        self.base = ctypes.addressof(self.buffer)
        self.size = size
        if register:
            assert store.register_buffer(self.base, size) == 0

    def write(self, offset, data):
        ctypes.memmove(self.base + offset, data, len(data))

    def read(self, offset, size):
        return ctypes.string_at(self.base + offset, size)


def test_basic_values_and_empty_keys(store, k):
    assert store.put(k("a"), b"hello") == 0
    assert store.put(k("a"), b"other") == 0  # an existing key: success, value kept
    assert store.get(k("a")) == b"hello"
    assert store.get(k("missing")) == b""
    assert store.put(k("empty"), b"") == INVALID
    assert (store.get(k("empty")), store.is_exist(k("empty")), store.get_size(k("empty"))) \
        == (b"", 0, NOT_FOUND)
    assert (store.is_exist(k("a")), store.get_size(k("a"))) == (1, 5)
    assert (store.remove(k("missing")), store.remove(k("missing"), True)) \
        == (NOT_FOUND, NOT_FOUND)
    assert store.put(k("ba"), bytearray(b"xyz")) == 0 and store.get(k("ba")) == b"xyz"
    assert store.put(k("mv"), memoryview(b"mview")) == 0 and store.get(k("mv")) == b"mview"
    # An empty key is refused by put and never found by the rest.
    assert store.put("", b"v") == INVALID
    assert (store.get(""), store.is_exist(""), store.get_size(""), store.remove("")) \
        == (b"", 0, NOT_FOUND, NOT_FOUND)
    assert store.batch_is_exist(["", k("nope")]) == [0, 0]
    assert store.batch_remove([""]) == [NOT_FOUND]
    assert store.get_batch([""]) == [b""]
    assert store.get_buffer("") is None
    assert store.health_check() == 0
    assert re.fullmatch(r"127\.0\.0\.1:\d+", store.get_hostname())
    assert store.get_offload_rpc_read_count() == 0


def test_leases_guard_remove(store, k):
    assert store.put(k("r"), b"v") == 0
    assert store.remove(k("r")) == 0 and store.remove(k("r")) == NOT_FOUND
    # A read (get, is_exist, get_size) grants a lease: remove waits for it, force does not.
    for read in (store.get, store.is_exist, store.get_size):
        assert store.put(k("r2"), b"v") == 0
        read(k("r2"))
        assert store.remove(k("r2")) == HAS_LEASE
        assert store.batch_remove([k("r2")]) == [HAS_LEASE]
        assert store.remove(k("r2"), True) == 0
        assert store.is_exist(k("r2")) == 0


def test_batches(store, k):
    assert store.put_batch([k("b1"), k("b2")], [b"one", b"two"]) == 0
    assert store.put_batch([k("b1"), k("b3")], [b"ONE", b"three"]) == 0
    assert store.get(k("b1")) == b"one"
    assert store.put_batch([k("b4"), k("b5")], [b"x"]) == INVALID
    assert store.is_exist(k("b4")) == 0
    assert store.put_batch([], []) == 0
    assert store.put_batch([k("be")], [b""]) == INVALID
    assert store.put_batch([k("de"), k("de")], [b"x", b""]) == INVALID
    assert store.is_exist(k("de")) == 0
    # A repeated key: success, the first value is kept.
    assert store.put_batch([k("d"), k("d")], [b"1", b"2"]) == 0
    assert store.get(k("d")) == b"1"
    assert store.upsert_batch([k("ud"), k("ud")], [b"1", b"2"]) == 0
    assert store.get(k("ud")) == b"1"
    assert store.get_batch([k("b1"), k("missing"), k("b3")]) == [b"one", b"", b"three"]
    assert store.get_batch([k("d"), k("d")]) == [b"1", b"1"]
    assert store.get_batch([]) == [b""]  # Mooncake's answer for no keys
    assert store.get_batch([k("m1"), k("m2")]) == [b"", b""]
    assert store.batch_is_exist([]) == []
    assert store.batch_is_exist([k("b1"), k("missing"), k("be")]) == [1, 0, 0]
    assert store.batch_is_exist([k("d"), k("d")]) == [1, 1]
    assert store.batch_remove([]) == []
    assert store.batch_remove([k("b2"), k("missing")]) == [0, NOT_FOUND]
    assert store.batch_remove([k("b3"), k("missing")], True) == [0, NOT_FOUND]
    assert store.batch_remove([k("d"), k("d")], True) == [0, NOT_FOUND]


def test_remove_by_regex_and_remove_all(store, k):
    for i in range(3):
        assert store.put(k(f"rx{i}"), b"v") == 0
    pattern = re.escape(k("rx")) + ".*"
    assert store.remove_by_regex(pattern) == 3
    assert store.remove_by_regex(pattern) == 0
    assert store.remove_by_regex("(") == INVALID
    assert store.put(k("rg"), b"v") == 0 and store.get(k("rg")) == b"v"
    assert store.remove_by_regex(re.escape(k("rg"))) == 0  # leased: kept
    assert store.remove_by_regex(re.escape(k("rg")), True) == 1
    store.remove_all(True)
    assert store.remove_all() == 0
    for i in range(3):
        assert store.put(k(f"ra{i}"), b"v") == 0
    assert store.remove_all() == 3
    assert store.put(k("ra"), b"v") == 0 and store.get(k("ra")) == b"v"
    assert store.remove_all() == 0
    assert store.remove_all(True) == 1


def test_upserts_and_parts(store, k):
    assert store.upsert(k("u"), b"first") == 0
    assert store.upsert(k("u"), b"second!") == 0
    assert (store.get(k("u")), store.get_size(k("u"))) == (b"second!", 7)
    assert store.upsert(k("u"), b"") == INVALID and store.get(k("u")) == b"second!"
    assert store.upsert_batch([k("u"), k("u2")], [b"A", b"B"]) == 0
    assert store.get_batch([k("u"), k("u2")]) == [b"A", b"B"]
    assert store.upsert_batch([k("u"), k("u3")], [b"Z"]) == INVALID
    assert store.upsert_batch([], []) == 0
    assert store.get(k("u2")) == b"B"
    assert store.upsert(k("u2"), b"C") == 0 and store.get(k("u2")) == b"C"  # despite a lease
    assert store.put_parts(k("p"), b"ab", b"cd", bytearray(b"ef")) == 0
    assert store.get(k("p")) == b"abcdef"
    assert store.put_parts(k("p"), b"zz") == 0 and store.get(k("p")) == b"abcdef"
    assert store.upsert_parts(k("p"), b"x", b"y") == 0 and store.get(k("p")) == b"xy"
    # Nothing to store: success, nothing stored.
    assert store.put_parts(k("p0")) == 0 and store.is_exist(k("p0")) == 0
    assert store.put_parts(k("pe"), b"") == 0 and store.is_exist(k("pe")) == 0
    assert store.upsert_parts(k("up")) == 0 and store.is_exist(k("up")) == 0
    assert store.put_parts(k("pd"), b"", b"ab") == 0 and store.get(k("pd")) == b"ab"
    with pytest.raises(TypeError):
        store.put_parts(k("ps"), "str")


def test_zero_copy_edges(store, k):
    mem = Memory(store, 1 << 16)
    stray = Memory(store, 1 << 12, register=False)
    mem.write(0, b"0123456789")
    stray.write(0, b"abcdefghij")
    assert store.put_from(k("z"), mem.base, 10) == 0
    assert store.put_from(k("z"), mem.base + 1, 5) == 0 and store.get(k("z")) == b"0123456789"
    # Unregistered memory works, as with Mooncake over TCP.
    assert store.put_from(k("zu"), stray.base, 10) == 0 and store.get(k("zu")) == b"abcdefghij"
    assert store.get_into(k("z"), stray.base, 64) == 10 and stray.read(0, 10) == b"0123456789"
    assert store.upsert_from(k("uu"), stray.base + 2, 4) == 0 and store.get(k("uu")) == b"2345"
    # Zero bytes: success, nothing stored.
    assert store.put_from(k("z0"), mem.base, 0) == 0 and store.is_exist(k("z0")) == 0
    assert store.upsert_from(k("uz"), mem.base, 0) == 0 and store.is_exist(k("uz")) == 0
    assert store.get_into(k("z"), mem.base + 100, 64) == 10
    assert mem.read(100, 10) == b"0123456789"
    assert store.get_into(k("z"), mem.base + 200, 10) == 10
    assert store.get_into(k("z"), mem.base + 300, 4) == INVALID
    assert mem.read(300, 4) == b"\0" * 4
    assert store.get_into(k("z"), mem.base + 300, 0) == INVALID
    assert store.get_into(k("missing"), mem.base, 64) == NOT_FOUND
    assert store.batch_put_from([k("y1"), k("y2")], [mem.base, mem.base + 2], [3, 4]) == [0, 0]
    assert store.batch_put_from([k("y3"), k("y4")], [mem.base], [3, 4]) == [INVALID, INVALID]
    assert store.batch_put_from([], [], []) == []
    assert store.batch_put_from([k("y5"), k("y6")], [stray.base, mem.base], [3, 3]) == [0, 0]
    assert store.batch_put_from([k("y1")], [mem.base + 5], [3]) == [0]
    assert store.get(k("y1")) == b"012"
    assert store.batch_put_from([k("y7")], [mem.base], [0]) == [INVALID]
    assert store.batch_put_from([k("bz"), k("bo")], [mem.base, mem.base], [0, 4]) == [INVALID, 0]
    # A repeated key: both succeed, the last buffer's bytes are the value.
    assert store.batch_put_from([k("bd"), k("bd")], [mem.base, mem.base + 4], [4, 4]) == [0, 0]
    assert store.get(k("bd")) == b"4567"
    assert store.batch_get_into([k("bd"), k("bd")], [mem.base + 900, mem.base + 950],
                                [4, 4]) == [4, 4]
    assert store.batch_get_into(
        [k("y1"), k("missing"), k("y2"), k("z")],
        [mem.base + 1000, mem.base + 1100, mem.base + 1200, mem.base + 1300],
        [64, 64, 64, 4]) == [3, NOT_FOUND, 4, INVALID]
    assert (mem.read(1000, 3), mem.read(1200, 4)) == (b"012", b"2345")
    assert store.batch_get_into([k("y1"), k("y2")], [mem.base], [64, 64]) == [INVALID, INVALID]
    assert store.batch_get_into([], [], []) == []
    assert store.batch_get_into([k("y1")], [stray.base + 100], [64]) == [3]
    assert store.batch_get_into([k("y1")], [mem.base], [0]) == [INVALID]


def test_register_buffer_rules(store):
    mem = Memory(store, 1 << 16)
    other = Memory(store, 1 << 12, register=False)
    assert store.register_buffer(mem.base, mem.size) == INVALID  # again
    assert store.register_buffer(mem.base + 64, 128) == INVALID  # inside
    assert store.register_buffer(mem.base + mem.size - 8, 64) == INVALID  # overlapping
    assert store.register_buffer(other.base, 0) == INVALID
    assert store.register_buffer(0, 64) == INVALID
    assert store.register_buffer(other.base, 64) == 0
    assert store.register_buffer(other.base, 128) == INVALID
    assert store.unregister_buffer(other.base) == 0
    assert store.register_buffer(other.base, 64) == 0
    assert store.unregister_buffer(other.base) == 0
    assert store.unregister_buffer(other.base) == INVALID
    assert store.unregister_buffer(mem.base + 64) == INVALID
    assert store.unregister_buffer(mem.base) == 0


def test_multi_buffer_edges(store, k):
    mem = Memory(store, 1 << 16)
    stray = Memory(store, 1 << 12, register=False)
    for i in range(4):
        mem.write(i * 16, bytes([65 + i]) * 16)
    b, out = mem.base, mem.base + 4096
    put = store.batch_put_from_multi_buffers
    get = store.batch_get_into_multi_buffers
    assert put([k("m1"), k("m2")], [[b, b + 16], [b + 32]], [[16, 8], [16]]) == [0, 0]
    whole = b"A" * 16 + b"B" * 8
    assert store.get(k("m1")) == whole
    assert put([k("m1")], [[b + 48]], [[4]]) == [0] and store.get(k("m1")) == whole
    assert put([k("m0")], [[b, b]], [[0, 0]]) == [INVALID] and store.is_exist(k("m0")) == 0
    assert put([k("m3")], [[b, b + 16]], [[0, 4]]) == [0] and store.get(k("m3")) == b"BBBB"
    assert put([k("m4")], [[]], [[]]) == [INVALID]
    assert put([k("m5"), k("m6")], [[b]], [[4]]) == [INVALID, INVALID]
    assert put([k("m7")], [[b, b + 4]], [[4]]) == [INVALID]
    assert put([k("m10")], [[b]], [[4, 4]]) == [INVALID]
    assert put([k("m8"), k("m9")], [[stray.base], [b]], [[4], [4]]) == [0, 0]
    assert put([], [], []) == []
    assert put([k("md"), k("md")], [[b], [b + 16]], [[4], [4]]) == [0, 0]
    assert store.get(k("md")) == b"AAAA"  # a repeated key keeps the first
    # Reads: buffers exactly the value's size, split anywhere.
    assert get([k("m1")], [[out, out + 100]], [[16, 8]]) == [24]
    assert (mem.read(4096, 16), mem.read(4196, 8)) == (b"A" * 16, b"B" * 8)
    assert get([k("m1")], [[out, out + 100]], [[12, 12]]) == [24]
    assert mem.read(4096, 12) + mem.read(4196, 12) == whole
    assert get([k("m2")], [[stray.base]], [[16]]) == [16]
    # Smaller than the value: INVALID_PARAMS; larger, or not one size per buffer:
    # TRANSFER_FAIL (the contents of a failed read's buffers are not to be used).
    assert get([k("m1")], [[out, out + 100]], [[8, 8]]) == [INVALID]
    assert get([k("m1")], [[out, out]], [[0, 0]]) == [INVALID]
    assert get([k("m1")], [[]], [[]]) == [INVALID]
    assert get([k("m1")], [[out, out + 64]], [[8]]) == [INVALID]
    assert get([k("m1")], [[out, out + 100]], [[20, 20]]) == [TRANSFER_FAIL]
    assert get([k("m1")], [[out + 512]], [[64]]) == [TRANSFER_FAIL]
    assert get([k("m1")], [[out, out + 64]], [[64]]) == [TRANSFER_FAIL]
    assert get([k("m1")], [[out]], [[16, 8]]) == [TRANSFER_FAIL]
    assert get([k("missing"), k("m2")], [[out], [out + 200]], [[64], [64]]) \
        == [NOT_FOUND, TRANSFER_FAIL]
    assert get([k("m1"), k("m2")], [[out]], [[64]]) == [INVALID, INVALID]
    assert get([], [], []) == []


def test_get_into_ranges_edges(store, k):
    mem = Memory(store, 1 << 14)
    stray = Memory(store, 1 << 12, register=False)
    assert store.put(k("g1"), b"0123456789") == 0
    assert store.put(k("g2"), b"abcdefghijklmnop") == 0
    b = mem.base
    ranges = store.get_into_ranges
    assert ranges([b], [[k("g1"), k("g2")]], [[[0, 4], [8]]], [[[0, 6], [2]]],
                  [[[4, 4], [5]]]) == [[[4, 4], [5]]]
    assert mem.read(0, 13) == b"01236789cdefg"
    assert ranges([b + 100], [[k("g1")]], [[[0]]], [[[8]]], [[[10]]]) == [[[INVALID]]]
    assert ranges([b], [[k("g1")]], [[[0]]], [[[20]]], [[[4]]]) == [[[INVALID]]]
    assert ranges([b], [[k("missing")]], [[[0]]], [[[0]]], [[[4]]]) == [[[NOT_FOUND]]]
    assert ranges([b], [[k("g1")]], [[[0]]], [[[0]]], [[[0]]]) == [[[0]]]
    assert ranges([stray.base], [[k("g1")]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
    assert ranges([b, b], [[k("g1")]], [[[0]]], [[[0]]], [[[4]]]) \
        == [[[INVALID]], [[INVALID]]]
    assert ranges([b], [[k("g1")]], [[[0, 1]]], [[[0]]], [[[4]]]) == [[[INVALID, INVALID]]]
    assert ranges([], [], [], [], []) == []
    assert ranges([b], [[k("g1")]], [[[mem.size - 2]]], [[[0]]], [[[4]]]) == [[[INVALID]]]


def test_buffers_and_replica_descriptors(store, k):
    assert store.put(k("h"), b"handle") == 0
    assert store.get_buffer(k("missing")) is None
    handle = store.get_buffer(k("h"))
    assert handle.size() == 6 and ctypes.string_at(handle.ptr(), 6) == b"handle"
    handles = store.batch_get_buffer([k("h"), k("missing")])
    assert handles[0].size() == 6 and handles[1] is None
    assert store.batch_get_buffer([]) == []
    assert store.get_replica_desc(k("missing")) == []
    replicas = store.get_replica_desc(k("h"))
    assert len(replicas) == 1 and replicas[0].is_memory_replica()
    assert str(replicas[0].status) == "ReplicaStatus.COMPLETE"
    assert store.batch_get_replica_desc([k("missing")]) == {}
    assert list(store.batch_get_replica_desc([k("h"), k("missing")])) == [k("h")]
    assert store.batch_get_replica_desc([]) == {}
    assert store.batch_replica_clear([k("missing")], "") == []


def test_replicate_config_behaviour(store, k):
    config = ReplicateConfig()
    assert (config.replica_num, config.preferred_segment, list(config.preferred_segments),
            config.prefer_alloc_in_same_node) == (1, "", [], False)
    for name, value in (("replica_num", "x"), ("replica_num", -1), ("replica_num", 1.5),
                        ("preferred_segment", 5), ("preferred_segments", "ab")):
        with pytest.raises(TypeError):
            setattr(config, name, value)
    for name in ("with_soft_pin", "no_such_field"):
        with pytest.raises(AttributeError):
            setattr(config, name, True)
    config.replica_num = True
    assert config.replica_num == 1
    config.preferred_segment = "seg"
    config.preferred_segments = ["a", "b"]
    assert str(config) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
        "preferred_segments: [a, b], preferred_segment (deprecated): seg, "
        "preferred_nof_segments: [], prefer_alloc_in_same_node: 0, data_type: UNKNOWN }")
    with pytest.raises(TypeError):
        ReplicateConfig(2)
    zero, five, missing = ReplicateConfig(), ReplicateConfig(), ReplicateConfig()
    zero.replica_num, five.replica_num = 0, 5
    missing.preferred_segment = "nosuchsegment:1"
    assert store.put(k("rc0"), b"v", zero) == INVALID
    assert store.put(k("rc5"), b"v", five) == 0  # as many replicas as there is room for
    assert store.put(k("rcp"), b"v", missing) == 0  # a preference, not a requirement
    with pytest.raises(TypeError):
        store.put(k("rcx"), b"v", 3)


def test_setup_forms(daemon, k):
    address = daemon.unix_address

    def dict_setup(**over):
        store = MooncakeDistributedStore()
        config = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                  "global_segment_size": str(64 << 20), "local_buffer_size": str(64 << 20),
                  "protocol": "tcp", "master_server_addr": address}
        config.update(over)
        code = store.setup({n: v for n, v in config.items() if v is not None})
        store.close()
        return code
    assert dict_setup() == 0
    for bad in ({"global_segment_size": "50%"}, {"local_buffer_size": "50%"},
                {"global_segment_size": "lots"}, {"global_segment_size": "100"},
                {"global_segment_size": "-1"}, {"local_buffer_size": "100"},
                {"local_hostname": None}, {"metadata_server": None}):
        assert dict_setup(**bad) == INVALID, bad
    for good in ({"global_segment_size": "16MB"}, {"global_segment_size": "16 mb"},
                 {"global_segment_size": "0"}, {"local_buffer_size": "0"},
                 {"enable_ssd_offload": "maybe"}):
        assert dict_setup(**good) == 0, good
    fresh = MooncakeDistributedStore()
    for args in (("127.0.0.1", "P2PHANDSHAKE", -1, 64 << 20, "tcp", "", address),
                 ("127.0.0.1", "P2PHANDSHAKE", "16MB", 64 << 20, "tcp", "", address),
                 ("127.0.0.1", "P2PHANDSHAKE")):
        with pytest.raises(TypeError):
            fresh.setup(*args)
    assert fresh.setup("127.0.0.1", "P2PHANDSHAKE", 100, 64 << 20, "tcp", "", address) \
        == INVALID
    args = ("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 64 << 20, "tcp", "", address)
    store = MooncakeDistributedStore()
    assert (store.setup(*args), store.setup(*args)) == (0, 0)
    assert (store.close(), store.close()) == (0, 0)


@pytest.mark.parametrize("state", ["unset", "closed"])
def test_calls_without_a_client(daemon, state):
    """The calls the real wheel answers (instead of crashing) before setup / after close."""
    store = MooncakeDistributedStore()
    if state == "closed":
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                           daemon.unix_address) == 0
        assert store.close() == 0
    memory = ctypes.create_string_buffer(64)
    assert store.get("k") == b""
    assert store.get_batch(["k"]) == [b""]
    assert store.upsert("k", b"v") == INVALID
    assert store.put_from("k", ctypes.addressof(memory), 4) == INVALID
    assert store.batch_put_from_multi_buffers(["k"], [[ctypes.addressof(memory)]], [[4]]) == []
    assert store.health_check() == 1
    assert store.close() == 0
    assert store.get_offload_rpc_read_count() == 0


def test_threads_on_one_store(store, k):
    values = [bytes([65 + i]) * 8 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda v: store.put(k("t"), v), values)) == [0] * 8
        assert store.get(k("t")) in values
        assert list(pool.map(lambda i: store.put(k(f"t{i}"), values[i]), range(8))) == [0] * 8
        assert list(pool.map(lambda i: store.get(k(f"t{i}")), range(8))) == values
        assert sorted(pool.map(lambda _: store.remove(k("t"), True), range(8))) \
            == [NOT_FOUND] * 7 + [0]
        assert list(pool.map(lambda v: store.upsert(k("u"), v), values)) == [0] * 8
        assert store.get(k("u")) in values
        assert list(pool.map(lambda i: store.batch_is_exist([k(f"t{i}"), k("t")]), range(8))) \
            == [[1, 0]] * 8
        assert list(pool.map(lambda i: store.remove_by_regex(re.escape(k(f"t{i}")) + "$", True),
                             range(8))) == [1] * 8


def test_tensor_edges(store, k):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert store.put_tensor(k("t"), t) == 0
    assert store.put_tensor(k("t"), t + 1) == 0
    assert torch.equal(store.get_tensor(k("t")), t)
    assert store.get_tensor(k("missing")) is None
    assert store.get_size(k("t")) == 352  # Mooncake's 304-byte metadata + 48 bytes
    assert store.put_tensor(k("tn"), b"abc") == INVALID
    assert store.put_tensor(k("tnc"), t.t()) == 0
    assert torch.equal(store.get_tensor(k("tnc")), t.t())
    assert store.put_tensor(k("te"), torch.empty(0)) == 0
    assert tuple(store.get_tensor(k("te")).shape) == (0,)
    assert store.put_tensor(k("ts"), torch.tensor(3.0)) == 0
    assert store.get_tensor(k("ts")).tolist() == [3.0]  # a scalar comes back with shape [1]
    assert store.put(k("raw"), b"not a tensor") == 0
    assert store.get_tensor(k("raw")) is None
    assert store.batch_put_tensor([k("t1"), k("t2")], [t, t * 2]) == [0, 0]
    assert store.batch_put_tensor([k("t3"), k("t4")], [t]) == [INVALID, INVALID]
    assert store.batch_put_tensor([], []) == []
    got = store.batch_get_tensor([k("t1"), k("missing"), k("t2")])
    assert torch.equal(got[0], t) and got[1] is None and torch.equal(got[2], t * 2)
    assert store.batch_get_tensor([]) == []
    mem = Memory(store, 1 << 14)
    stray = Memory(store, 1 << 12, register=False)
    assert torch.equal(store.get_tensor_into(k("t"), mem.base, 1 << 14), t)
    assert store.get_tensor_into(k("t"), mem.base, 16) is None
    assert store.get_tensor_into(k("missing"), mem.base, 1 << 14) is None
    assert torch.equal(store.get_tensor_into(k("t"), stray.base, 1 << 12), t)
    got = store.batch_get_tensor_into([k("t"), k("missing"), k("t2")],
                                      [mem.base, mem.base + 4096, mem.base + 8192],
                                      [4096, 4096, 16])
    assert torch.equal(got[0], t) and got[1:] == [None, None]
    assert store.batch_get_tensor_into([k("t"), k("t2")], [mem.base], [4096]) \
        == [INVALID, INVALID]
    assert store.put_tensor_with_tp(k("tp"), t, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert store.put_tensor_with_tp(k("tpu"), t, tp_rank=0, tp_size=2, split_dim=0) == INVALID
    shard = store.get_tensor_with_tp(k("tp"), tp_rank=1, tp_size=2, split_dim=1)
    assert torch.equal(shard, t[:, 2:]) and torch.equal(store.get_tensor(k("tp") + "_tp_1"),
                                                         t[:, 2:])
    assert store.get_tensor_with_tp(k("missing"), tp_rank=0, tp_size=2, split_dim=0) is None
