"""Mooncake API calls beyond the basic ones, on a real daemon: the multi-buffer and range
calls vLLM and SGLang use, sessions, buffer handles, replica descriptors, the setup forms,
the calls mooncaked answers NOT_SUPPORTED, and the codes before setup and after close."""

from __future__ import annotations

import ctypes
import os

import pytest

from mooncaked.mooncake_store import (BufferHandle, BufferPool, MooncakeDistributedStore,
                                      MooncakeHostMemAllocator, ReplicaStatus, ReplicateConfig,
                                      SoftPinAction)

NOT_FOUND, EXISTS, INVALID, RPC_FAIL, NOT_SUPPORTED = -704, -705, -600, -900, -1012


@pytest.fixture(params=["unix", "tcp"])
def store(request, daemon):
    address = daemon.unix_address if request.param == "unix" else daemon.tcp_address
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", address) == 0
    yield store
    store.close()


class Memory:
    """A registered region: write / read bytes at offsets."""

    def __init__(self, store, size):
        self.buffer = ctypes.create_string_buffer(size)
        self.base = ctypes.addressof(self.buffer)
        assert store.register_buffer(self.base, size) == 0

    def write(self, offset, data):
        ctypes.memmove(self.base + offset, data, len(data))

    def read(self, offset, size):
        return ctypes.string_at(self.base + offset, size)


def test_multi_buffers_round_trip(store):
    memory = Memory(store, 1 << 20)
    layers = [os.urandom(4096), os.urandom(100), os.urandom(8192)]
    offsets = [0, 4096, 8192]
    for offset, data in zip(offsets, layers):
        memory.write(offset, data)
    ptrs = [memory.base + o for o in offsets]
    sizes = [len(d) for d in layers]
    config = ReplicateConfig()
    config.prefer_alloc_in_same_node = True
    assert store.batch_put_from_multi_buffers(["kv0", "kv1"], [ptrs, ptrs[:1]],
                                              [sizes, sizes[:1]], config) == [0, 0]
    # An existing key: success, value kept (Mooncake's write-once put).
    assert store.batch_put_from_multi_buffers(["kv1"], [ptrs[1:2]], [sizes[1:2]]) == [0]
    assert store.get("kv0") == b"".join(layers)
    assert store.get("kv1") == layers[0]
    # Scatter back over three different buffers.
    out = [512 * 1024, 600 * 1024, 700 * 1024]
    got = store.batch_get_into_multi_buffers(
        ["kv0", "kv1", "nope"], [[memory.base + o for o in out], [memory.base + 800 * 1024],
                                 [memory.base]], [sizes, [4096], [10]])
    assert got == [sum(sizes), 4096, NOT_FOUND]
    assert [memory.read(o, s) for o, s in zip(out, sizes)] == layers
    assert memory.read(800 * 1024, 4096) == layers[0]
    # Buffers smaller than the value: INVALID_PARAMS for that key only.
    assert store.batch_get_into_multi_buffers(
        ["kv0", "kv1"], [[memory.base], [memory.base + 4096]], [[100], [4096]],
        prefer_alloc_in_same_node=True) == [INVALID, 4096]
    # Unregistered memory is taken (as by Mooncake over TCP); mismatched lists are not.
    stray = ctypes.create_string_buffer(64)
    assert store.batch_put_from_multi_buffers(["x"], [[ctypes.addressof(stray)]], [[64]]) \
        == [0]
    assert store.batch_put_from_multi_buffers(["x", "y"], [[memory.base]], [[8]]) \
        == [INVALID, INVALID]
    assert store.batch_get_into_multi_buffers(["kv0"], [[memory.base, memory.base]], [[8]]) \
        == [INVALID]
    assert store.batch_put_from_multi_buffers([], [], []) == []


def test_batch_upsert_from_multi_buffers_replaces(store):
    memory = Memory(store, 8192)
    memory.write(0, b"a" * 10 + b"b" * 10)
    assert store.batch_put_from_multi_buffers(["u"], [[memory.base]], [[10]]) == [0]
    assert store.batch_upsert_from_multi_buffers(
        ["u"], [[memory.base + 10, memory.base]], [[10, 5]]) == [0]
    assert store.get("u") == b"b" * 10 + b"a" * 5


def test_get_into_ranges(store):
    memory = Memory(store, 64 * 1024)
    value = os.urandom(10000)
    assert store.put("r", value) == 0
    result = store.get_into_ranges(
        [memory.base, memory.base + 32 * 1024],
        [["r", "missing"], ["r"]],
        [[[0, 100], [0]], [[0, 5000]]],
        [[[10, 9990], [0]], [[20000, 0]]],
        [[[50, 500], [8]], [[16, 4000]]])
    # A range past the value's end is INVALID_PARAMS (Mooncake), not clipped.
    assert result == [[[50, INVALID], [NOT_FOUND]], [[INVALID, 4000]]]
    assert memory.read(0, 50) == value[10:60]
    assert memory.read(32 * 1024 + 5000, 4000) == value[:4000]
    # A range past the registered buffer's end: INVALID_PARAMS for that range.
    assert store.get_into_ranges([memory.base], [["r"]], [[[64 * 1024 - 4]]], [[[0]]],
                                 [[[8]]]) == [[[INVALID]]]


def test_put_and_get_sessions(store):
    memory = Memory(store, 8192)
    memory.write(0, b"x" * 100 + b"y" * 100)
    assert store.put("taken", b"t") == 0
    assert store.batch_put_session_start(["s1", "s2", "taken"], [150, 10]) == [INVALID] * 3
    assert store.batch_put_session_start(["s1", "s2", "taken"], [150, 10, 1]) == [0, 0, EXISTS]
    assert store.batch_put_from_multi_buffer_ranges(
        ["s1", "s2", "nosession"], [[memory.base, memory.base + 100], [memory.base], [memory.base]],
        [[100, 50], [10], [1]], [[0, 100], [5], [0]]) == [0, INVALID, INVALID]
    assert store.is_exist("s1") == 0  # not readable before the end
    assert store.batch_put_session_end(["s1", "nosession"]) == [0, INVALID]
    assert store.batch_put_session_revoke(["s2", "s2"]) == [0, INVALID]
    assert store.get("s1") == b"x" * 100 + b"y" * 50
    assert store.is_exist("s2") == 0
    assert store.batch_get_session_start(["s1", "nope"]) == [0, NOT_FOUND]
    assert store.batch_get_into_multi_buffer_ranges(
        ["s1"], [[memory.base + 4096, memory.base + 5000]], [[20, 100]], [[95, 140]]) == [30]
    assert memory.read(4096, 20) == b"x" * 5 + b"y" * 15
    assert memory.read(5000, 10) == b"y" * 10
    assert store.batch_get_session_end(["s1"]) == 0


def test_put_parts_metadata_and_buffers(store):
    assert store.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.upsert_parts("parts", b"12", b"3") == 0
    assert store.get("parts") == b"123"
    memory = Memory(store, 4096)
    memory.write(0, b"META")
    memory.write(100, b"data" * 10)
    assert store.put_from_with_metadata("m", memory.base + 100, memory.base, 40, 4) == 0
    assert store.get("m") == b"META" + b"data" * 10
    handle = store.get_buffer("m")
    assert isinstance(handle, BufferHandle)
    assert handle.size() == len(handle) == 44 and bytes(memoryview(handle)) == store.get("m")
    assert ctypes.string_at(handle.ptr(), 4) == b"META"
    assert store.get_buffer("missing") is None
    handles = store.batch_get_buffer(["m", "missing"])
    assert bytes(handles[0]) == b"META" + b"data" * 10 and handles[1] is None
    assert store.get_batch(["m", "missing"]) == [b"META" + b"data" * 10, b""]


def test_upsert_forms(store):
    memory = Memory(store, 4096)
    memory.write(0, b"first!" + b"second")
    assert store.upsert_from("u", memory.base, 6) == 0
    assert store.upsert_from("u", memory.base + 6, 6) == 0
    assert store.get("u") == b"second"
    assert store.batch_upsert_from(["u", "v"], [memory.base, memory.base], [6, 3]) == [0, 0]
    assert store.get_batch(["u", "v"]) == [b"first!", b"fir"]
    assert store.upsert_batch(["u", "v"], [b"1", b"2"]) == 0
    assert store.put_batch(["u", "w"], [b"x", b"y"]) == 0
    assert store.get_batch(["u", "w"]) == [b"1", b"y"]
    assert store.put_batch(["a"], [b"1", b"2"]) == INVALID


def test_replica_descriptors_and_clear(store):
    assert store.put("d", b"12345") == 0
    descriptors = store.batch_get_replica_desc(["d", "missing"])
    assert list(descriptors) == ["d"]
    (replica,) = descriptors["d"]
    assert replica.status == ReplicaStatus.COMPLETE and replica.is_memory_replica()
    assert not replica.is_disk_replica() and not replica.is_local_disk_replica()
    assert replica.get_memory_descriptor().buffer_descriptor.size == 5
    assert len(store.get_replica_desc("d")) == 1 and store.get_replica_desc("missing") == []
    assert store.put("c", b"x") == 0
    assert store.batch_replica_clear(["c", "missing"]) == ["c"]  # never read: no lease
    assert store.is_exist("c") == 0
    assert store.get("d") == b"12345"
    assert store.batch_replica_clear(["d"], "segment") == []  # leased by the read


def test_not_supported_calls(store):
    assert store.mount_segment("/dev/shm/x", 1 << 20) == {"ret": NOT_SUPPORTED,
                                                         "segment_ids": []}
    assert store.allocate_and_mount_segment(1 << 20)["ret"] == NOT_SUPPORTED
    assert store.unmount_segment(["s"]) == NOT_SUPPORTED
    assert store.unmount_and_free_segment(["s"], 1) == NOT_SUPPORTED
    assert store.unmount_local_disk_segment() == NOT_SUPPORTED
    assert store.create_copy_task("k", ["seg"]) == ((0, 0), NOT_SUPPORTED)
    assert store.create_move_task("k", "a", "b") == ((0, 0), NOT_SUPPORTED)
    assert store.query_task((1, 2)) == (None, NOT_SUPPORTED)
    assert store.get_offload_rpc_read_count() == 0


def test_setup_forms_and_hostname(daemon):
    store = MooncakeDistributedStore()
    # Mooncake's dict form rejects a size it cannot parse with a code, not an exception.
    assert store.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": "50%"}) == INVALID
    assert store.setup({"local_hostname": "localhost"}) == INVALID  # metadata_server missing
    assert store.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "client_http_port": "port"}) == INVALID
    assert store.setup("", "P2PHANDSHAKE", 0, 0, "tcp", "", daemon.unix_address) == INVALID
    assert store.setup("localhost", "P2PHANDSHAKE", 100, 0, "tcp", "",
                       daemon.unix_address) == INVALID  # under Mooncake's 1 KiB minimum
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       daemon.unix_address, None, False, "", "tenant-a", False, 9300) == 0
    host, _, port = store.get_hostname().rpartition(":")
    assert host == "127.0.0.1" and 12300 <= int(port) < 14300
    assert store.put("k", b"in tenant-a") == 0
    other = MooncakeDistributedStore()
    assert other.setup({"local_hostname": "localhost:4242", "metadata_server": "x",
                        "master_server_addr": daemon.tcp_address, "tenant_id": "tenant-b",
                        "global_segment_size": "16 MB", "local_buffer_size": 1 << 20,
                        "enable_ssd_offload": "true"}) == 0
    assert other.get_hostname() == "localhost:4242"
    assert other.is_exist("k") == 0  # another namespace
    assert other.close() == 0
    dummy = MooncakeDistributedStore()
    assert dummy.setup_dummy(1 << 30, 16 << 20, daemon.unix_address) == 0
    assert dummy.put("d", b"v") == 0 and dummy.get("d") == b"v"
    address = dummy.alloc_from_mem_pool(4096)
    assert address != 0
    ctypes.memmove(address, b"pool", 4)
    assert dummy.put_from("pool", address, 4) == 0  # pool memory is registered
    assert dummy.get("pool") == b"pool"
    dummy.close()
    store.close()


def test_codes_before_setup_and_after_close(daemon):
    store = MooncakeDistributedStore()
    assert store.get_hostname() == ""
    assert store.health_check() == 1
    assert store.put("k", b"v") == INVALID and store.get("k") == b""
    assert store.is_exist("k") == INVALID and store.batch_is_exist(["k"]) == [INVALID]
    assert store.batch_get_into_multi_buffers(["k"], [[1]], [[1]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["k"], [[1]], [[1]]) == []  # Mooncake's answer
    assert store.register_buffer(1, 1) == INVALID
    assert store.get_tensor("k") is None
    assert store.get_buffer("k") is None
    assert store.alloc_from_mem_pool(10) == 0
    assert store.close() == 0
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                       daemon.unix_address) == 0
    assert store.close() == 0 and store.close() == 0
    assert store.remove_all() == INVALID and store.get_size("k") == INVALID
    assert store.get_batch(["a", "b"]) == [b"", b""]
    assert store.batch_remove(["a"]) == [INVALID]
    dead = MooncakeDistributedStore()
    assert dead.setup("localhost", "", 0, 1 << 20, "tcp", "", "unix:/nonexistent/sock") \
        == RPC_FAIL
    assert dead.setup("localhost", "", 0, 1 << 20, "tcp", "", "no-port-here") == INVALID


def test_soft_pin_config_checked(store):
    config = ReplicateConfig()
    config.soft_pin_ttl_ms = 1000
    assert store.put("soft", b"x", config) == INVALID
    assert store.batch_put_from_multi_buffers(["soft"], [[1]], [[1]], config) == [INVALID]
    config.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("soft", b"x", config) == 0
    grouped = ReplicateConfig()
    grouped.group_ids = ["g1"]
    assert store.put_batch(["a", "b"], [b"1", b"2"], grouped) == INVALID  # one id per key
    grouped.group_ids = ["g1", "g2"]
    assert store.put_batch(["a", "b"], [b"1", b"2"], grouped) == 0


def test_buffer_pool_and_host_allocator(store):
    pool = BufferPool(store, max_bytes=320 * 1024, min_size_class=64 * 1024)
    with pool.acquire(1000) as lease:
        assert lease.size == 1000 and lease.ptr != 0
        lease.buffer[:5] = b"hello"
        assert store.put_from("leased", lease.ptr, 5) == 0
    assert store.get("leased") == b"hello"
    leases = [pool.acquire(100 * 1024) for _ in range(2)]  # 64 + 2 x 128 KiB: the limit
    with pytest.raises(RuntimeError):
        pool.acquire(100 * 1024, block=False)
    leases[0].release()
    again = pool.acquire(100 * 1024, block=False)
    assert again.ptr == leases[0].ptr
    pool.close()
    allocator = MooncakeHostMemAllocator()
    address = allocator.alloc(4096)
    assert address != 0 and allocator.free(address) == 0 and allocator.free(address) == -1
