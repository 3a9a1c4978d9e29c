"""The Mooncake-compatible facade against the semantics table of Mooncake Store's Python API.

Each case is a row of `MooncakeDistributedStore`'s behaviour (return values and error codes
as Mooncake returns them), run against a real mooncaked over the Unix socket (shared memory)
and, for the zero-copy calls, over TCP too.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from mooncaked.mooncake_store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

NOT_FOUND, HAS_LEASE, INVALID = -704, -706, -600


@pytest.fixture
def store(daemon):
    store = MooncakeDistributedStore()
    assert store.setup("localhost:12345", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       daemon.unix_address) == 0
    yield store
    store.close()


def test_put_get_and_write_once(store):
    assert store.put("k1", b"hello") == 0
    assert store.put("k1", b"HELLOX") == 0  # an existing key: success, value unchanged
    assert store.get("k1") == b"hello"
    assert store.get("missing") == b""
    assert store.put("empty", b"") == INVALID
    assert store.get_size("k1") == 5
    assert store.get_size("missing") == NOT_FOUND
    assert store.upsert("k1", b"replaced") == 0
    assert store.get("k1") == b"replaced"


def test_exists_and_batch_exists(store):
    store.put("a", b"1")
    assert store.is_exist("a") == 1
    assert store.is_exist("b") == 0
    assert store.batch_is_exist(["a", "b"]) == [1, 0]
    assert store.batch_is_exist([]) == []


def test_remove_respects_leases(store):
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert store.remove("k") == HAS_LEASE
    assert store.remove("k", force=True) == 0
    assert store.remove("k") == NOT_FOUND
    store.put("x1", b"1")
    store.put("x2", b"2")
    store.put("y", b"3")
    assert store.remove_by_regex("^x") == 2
    assert store.remove_all() == 1
    assert store.batch_remove(["gone"]) == [NOT_FOUND]


def test_local_buffer_bounds_put(daemon):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", daemon.unix_address) == 0
    assert store.put("k", b"value") == INVALID  # no local buffer: the put fails
    assert store.is_exist("k") == 0
    store.close()


def test_setup_from_dict_and_health(daemon):
    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": "16MB", "local_buffer_size": "16 MB",
                        "master_server_address": daemon.tcp_address}) == 0
    assert store.health_check() == 0
    assert store.put("k", b"v" * 100) == 0
    assert store.get_hostname().startswith("localhost:")  # Mooncake's host:port name
    assert store.close() == 0
    assert store.close() == 0
    assert store.health_check() == 1
    dead = MooncakeDistributedStore()
    assert dead.setup("localhost", "", 0, 1 << 20, "tcp", "", "unix:/nonexistent/sock") < 0


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_zero_copy_calls(daemon, transport):
    store = MooncakeDistributedStore()
    address = daemon.unix_address if transport == "unix" else daemon.tcp_address
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    size = 1 << 20
    buffer = ctypes.create_string_buffer(4 * size)
    base = ctypes.addressof(buffer)
    # Mooncake over TCP copies from memory it was not given: so does mooncaked.
    assert store.put_from("unregistered", base, size) == 0
    assert store.register_buffer(base, 4 * size) == 0
    payload = os.urandom(size)
    ctypes.memmove(base, payload, size)
    assert store.put_from("zc", base, size) == 0
    assert store.put_from("zc", base, size) == 0  # existing key
    assert store.get_into("zc", base + size, size) == size
    assert ctypes.string_at(base + size, size) == payload
    assert store.get_into("zc", base + size, 100) == INVALID  # buffer too small
    assert store.get_into("missing", base, size) == NOT_FOUND
    keys = ["b0", "b1"]
    ctypes.memmove(base + 2 * size, os.urandom(2 * 4096), 2 * 4096)
    assert store.batch_put_from(keys, [base + 2 * size, base + 2 * size + 4096],
                                [4096, 4096]) == [0, 0]
    assert store.batch_get_into(keys + ["nope"], [base, base + 4096, base + 8192],
                                [4096, 4096, 4096]) == [4096, 4096, NOT_FOUND]
    assert ctypes.string_at(base, 8192) == ctypes.string_at(base + 2 * size, 8192)
    assert store.unregister_buffer(base) == 0
    assert store.unregister_buffer(base) == INVALID
    store.close()


def test_replicate_config(store):
    config = ReplicateConfig()
    assert config.replica_num == 1 and config.soft_pin_action == SoftPinAction.PRESERVE
    config.soft_pin_ttl_ms = 1000
    assert store.put("soft", b"x", config) == INVALID  # a TTL needs ENABLE
    config.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("soft", b"x", config) == 0
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    hard.replica_num = 2
    assert store.put("hard", b"y", hard) == 0  # best effort: one segment, one replica
    assert store.get("hard") == b"y"


def test_batch_put_and_get(store):
    assert store.put_batch(["p", "q"], [b"1", b"22"]) == 0
    assert store.get_batch(["p", "zz", "q"]) == [b"1", b"", b"22"]
    assert store.put_parts("parts", b"ab", b"cd") == 0
    assert store.get("parts") == b"abcd"
