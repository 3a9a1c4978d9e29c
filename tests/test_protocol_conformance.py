"""The daemon does what wire/PROTOCOL.md says, and the page says everything the daemon does.

Goal: a client written in another language from PROTOCOL.md alone meets no surprise: every
rule the page states holds (refusals have no effect, bounds count what the page says they
count, errors have the codes and the connection outcomes it gives), and what the daemon sends
(hello and status keys, error codes) is written down there.

Method: a raw client written from the page (struct for the 8-byte prefix, a msgpack codec for
the header; nothing of mooncaked's own codec) against real daemons, over TCP and the Unix
socket. Effects are observed, not assumed: after a refused remove the object still exists;
after a refused read a non-forced remove succeeds (no lease was granted). The last part checks
that every client of mooncaked/client/ refuses a value over the announced `max_payload_bytes`
before sending it, with the connection kept.
"""

from __future__ import annotations

import asyncio
import os
import re
import struct
import tempfile
import time

import msgpack
import pytest

import wire_helpers
from cluster_harness import Cluster
from conftest import REPO, DaemonProcess
from mooncaked import BlockingClient, Client
from mooncaked.client.pool import ClientPool
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.mooncake_store import MooncakeDistributedStore

IO_TIMEOUT_S = 10.0  # a bound on waiting for the daemon, never an assertion
PROTOCOL_PATH = os.path.join(REPO, "wire", "PROTOCOL.md")
VECTORS_PATH = os.path.join(REPO, "wire", "vectors", "frames.json")

MAX_BATCH_KEYS = 4
MAX_PAYLOAD_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 10
MAX_KEY_BYTES = 4096

TRANSPORTS = ["tcp", "unix"]

PREFIX = struct.Struct(">II")  # header_length, payload_length: big-endian u32 (section 2)


# -- a client written from the page -------------------------------------------------------------

class Raw:
    """One connection; requests are `[0, msgid, method, params]` headers (section 3)."""

    def __init__(self, daemon, kind: str) -> None:
        self.sock = wire_helpers.connect(daemon, kind, IO_TIMEOUT_S)
        self.kind = kind
        self.msgid = 0

    def close(self) -> None:
        self.sock.close()

    def send_header(self, header_bytes: bytes, payload: bytes = b"") -> None:
        self.sock.sendall(PREFIX.pack(len(header_bytes), len(payload)) + header_bytes + payload)

    def send(self, method, params, payload: bytes = b"") -> int:
        self.msgid += 1
        self.send_header(msgpack.packb([0, self.msgid, method, params], use_bin_type=True),
                         payload)
        return self.msgid

    def frame(self):
        header_length, payload_length = PREFIX.unpack(self._exactly(PREFIX.size))
        header = msgpack.unpackb(self._exactly(header_length), raw=False)
        return header, self._exactly(payload_length)

    def call(self, method, params, payload: bytes = b""):
        """(error, result, payload) of one request."""
        msgid = self.send(method, params, payload)
        header, body = self.frame()
        assert type(header) is list and len(header) == 4 and header[:2] == [1, msgid], header
        return header[2], header[3], body

    def ok(self, method, params, payload: bytes = b""):
        error, result, _ = self.call(method, params, payload)
        assert error is None, (method, error)
        return result

    def refused(self, code: int, method, params, payload: bytes = b"") -> str:
        error, result, body = self.call(method, params, payload)
        assert type(error) is list and error[0] == code, (method, error)
        assert type(error[1]) is str and error[1], error
        assert result is None and body == b""
        return error[1]

    def hello(self, namespace: str = "default", **options) -> dict:
        return self.ok("hello", [{"protocol": 1, "namespace": namespace, **options}])

    def closed_after_notification(self, code: int) -> str:
        """The daemon sends `[2, "protocol_error", [code, message]]`, then closes."""
        header, body = self.frame()
        assert header[:2] == [2, "protocol_error"] and header[2][0] == code, header
        assert type(header[2][1]) is str and body == b""
        self.assert_closed()
        return header[2][1]

    def assert_closed(self) -> None:
        try:
            assert self.sock.recv(1) == b""
        except ConnectionResetError:
            pass

    def _exactly(self, size: int) -> bytes:
        return wire_helpers.receive_exactly(self.sock, size)


def unique(request) -> str:
    """A namespace of this test's own (the shared daemon serves every test)."""
    return "t-" + re.sub(r"[^A-Za-z0-9]", "-", request.node.name)[-200:]


@pytest.fixture(scope="module")
def shared():
    """One daemon for the tests that need no configuration of their own."""
    directory = tempfile.TemporaryDirectory(prefix="mooncaked-conformance-")
    daemon = DaemonProcess(directory.name,
                           server={"max_batch_keys": MAX_BATCH_KEYS,
                                   "max_payload_bytes": MAX_PAYLOAD_BYTES,
                                   "max_header_bytes": MAX_HEADER_BYTES})
    try:
        yield daemon.start()
    finally:
        daemon.close()
        directory.cleanup()


@pytest.fixture(params=TRANSPORTS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def raw(shared, kind, request):
    """A connection to the shared daemon, after hello in this test's namespace."""
    connection = Raw(shared, kind)
    connection.hello(unique(request))
    yield connection
    connection.close()


def stored(raw: Raw, key: str) -> bool:
    """Is `key` stored? object_stat grants no lease, so it changes nothing."""
    error, result, _ = raw.call("object_stat", [key])
    if error is not None:
        assert error[0] == ErrorCode.OBJECT_NOT_FOUND, error
        return False
    return result["state"] == "complete"


def assert_in_sync(raw: Raw) -> None:
    assert raw.ok("ping", []) == "pong"


# -- 1. a payload for a method that takes none: refused before any effect ----------------------

REMOVALS = [
    ("remove", lambda key: [key]),
    ("remove", lambda key: [key, True]),
    ("batch_remove", lambda key: [[key], True]),
    ("remove_by_regex", lambda key: [f"^{key}$", True]),
    ("remove_all", lambda key: [True]),
]


@pytest.mark.parametrize("method,params", REMOVALS,
                         ids=["remove", "remove-forced", "batch_remove", "remove_by_regex",
                              "remove_all"])
def test_a_removal_with_a_payload_removes_nothing(raw, method, params):
    assert raw.ok("put", ["victim", None], b"value") is True
    message = raw.refused(ErrorCode.INVALID_PARAMS, method, params("victim"), b"payload")
    assert "payload" in message
    assert_in_sync(raw)  # the payload was read and dropped: the next frame is understood
    assert stored(raw, "victim")
    assert raw.ok("get", ["victim"]) == 5


READS = [
    ("get", lambda key: [key]),
    ("get_size", lambda key: [key]),
    ("exists", lambda key: [key]),
    ("batch_get", lambda key: [[key]]),
    ("batch_exists", lambda key: [[key]]),
]


@pytest.mark.parametrize("method,params", READS, ids=[m for m, _ in READS])
def test_a_read_with_a_payload_grants_no_lease(raw, method, params):
    assert raw.ok("put", ["leased?", None], b"value") is True
    raw.refused(ErrorCode.INVALID_PARAMS, method, params("leased?"), b"p" * 70_000)
    assert_in_sync(raw)
    assert raw.ok("remove", ["leased?"]) == 0  # not forced: no lease was granted
    assert not stored(raw, "leased?")


def test_get_replica_with_a_payload_grants_no_lease(shared, request):
    raw = Raw(shared, "unix")
    raw.hello(unique(request))
    assert raw.ok("put", ["leased?", None], b"value") is True
    raw.refused(ErrorCode.INVALID_PARAMS, "get_replica", ["leased?"], b"payload")
    raw.refused(ErrorCode.INVALID_PARAMS, "batch_get_replica", [["leased?"]], b"payload")
    assert raw.ok("remove", ["leased?"]) == 0
    raw.close()


def test_hello_with_a_payload_binds_nothing(shared, kind):
    raw = Raw(shared, kind)
    raw.refused(ErrorCode.INVALID_PARAMS, "hello", [{"protocol": 1}], b"payload")
    raw.refused(ErrorCode.HANDSHAKE_REQUIRED, "ping", [])
    raw.hello("after-refused-hello")
    assert_in_sync(raw)
    raw.close()


def test_a_cluster_node_refuses_a_payload_before_any_effect():
    cluster = Cluster(size=1)
    try:
        cluster.start()
        node = cluster.nodes[1]
        raw = Raw(node, "tcp")
        raw.hello("cluster-payload")
        assert raw.ok("put", ["victim", None], b"value") is True
        raw.refused(ErrorCode.INVALID_PARAMS, "remove", ["victim", True], b"payload")
        raw.refused(ErrorCode.INVALID_PARAMS, "remove_all", [True], b"payload")
        raw.refused(ErrorCode.INVALID_PARAMS, "get", ["victim"], b"payload")
        raw.refused(ErrorCode.INVALID_PARAMS, "cluster_status", [], b"payload")
        assert raw.ok("exists", ["victim"]) is True
        raw.close()
    finally:
        cluster.close()


# -- 2. max_key_bytes counts UTF-8 bytes ---------------------------------------------------------

def test_max_key_bytes_counts_utf8_bytes(raw):
    at_limit = "日" * (MAX_KEY_BYTES // 3) + "k" * (MAX_KEY_BYTES % 3)  # 4096 bytes
    over = "日" * (MAX_KEY_BYTES // 3 + 1)  # 1366 characters, 4098 bytes
    assert len(at_limit.encode()) == MAX_KEY_BYTES and len(over) < MAX_KEY_BYTES
    assert raw.ok("put", [at_limit, None], b"v") is True
    assert raw.ok("exists", [at_limit]) is True
    for method, params, payload in [("put", [over, None], b"v"), ("upsert", [over, None], b"v"),
                                    ("exists", [over], b""), ("get", [over], b""),
                                    ("remove", [over], b""), ("batch_exists", [[over]], b""),
                                    ("batch_put", [[over], [1], None], b"v")]:
        message = raw.refused(ErrorCode.INVALID_PARAMS, method, params, payload)
        assert "bytes" in message
    assert [o["key"] for o in raw.ok("objects_list", [""])] == [at_limit]


# -- 3. ping checks its arity --------------------------------------------------------------------

def test_ping_checks_its_arity(raw):
    raw.refused(ErrorCode.INVALID_PARAMS, "ping", ["extra"])
    raw.refused(ErrorCode.INVALID_PARAMS, "ping", [None])
    assert raw.ok("ping", []) == "pong"


# -- 4. the namespace pattern is matched in full -------------------------------------------------

@pytest.mark.parametrize("namespace", ["ns\n", "ns\r", "\nns", "", "n" * 256, "ns space",
                                       "имя"], ids=["newline", "cr", "leading-newline", "empty",
                                                    "256-bytes", "space", "cyrillic"])
def test_a_namespace_outside_the_pattern_is_refused(shared, kind, namespace):
    raw = Raw(shared, kind)
    raw.refused(ErrorCode.INVALID_PARAMS, "hello", [{"protocol": 1, "namespace": namespace}])
    # A refused hello binds nothing and keeps the connection: hello may follow.
    raw.refused(ErrorCode.HANDSHAKE_REQUIRED, "exists", ["k"])
    assert raw.hello("n" * 255)["namespace"] == "n" * 255
    raw.close()


# -- 5. before hello, every method but hello answers HANDSHAKE_REQUIRED -------------------------

def test_an_unknown_method_before_hello_answers_handshake_required(shared, kind):
    raw = Raw(shared, kind)
    raw.refused(ErrorCode.HANDSHAKE_REQUIRED, "no_such_method", [])
    raw.refused(ErrorCode.HANDSHAKE_REQUIRED, "no_such_method", ["k"], b"payload")
    raw.refused(ErrorCode.HANDSHAKE_REQUIRED, "ping", [])
    raw.hello()
    raw.refused(ErrorCode.UNKNOWN_METHOD, "no_such_method", ["k"], b"payload")
    assert_in_sync(raw)
    raw.close()


# -- 6. what the page was silent or wrong about --------------------------------------------------

def test_a_second_hello_is_refused_and_the_first_binding_kept(shared, kind, request):
    namespace = unique(request)
    raw = Raw(shared, kind)
    raw.hello(namespace)
    assert raw.ok("put", ["mine", None], b"first") is True
    message = raw.refused(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "hello",
                          [{"protocol": 1, "namespace": namespace + "-other"}])
    assert "hello" in message
    # Even a malformed or identical second hello gets the same answer.
    raw.refused(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "hello", [{"protocol": 1,
                                                                     "namespace": namespace}])
    raw.refused(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "hello", [])
    assert raw.ok("get", ["mine"]) == 5  # still bound to the first namespace
    assert raw.ok("object_stat", ["mine"])["namespace"] == namespace
    raw.close()
    other = Raw(shared, kind)
    other.hello(namespace + "-other")
    assert other.ok("exists", ["mine"]) is False
    other.close()


def test_a_connection_over_max_connections_gets_busy_then_is_closed(make_daemon, kind):
    # With its administrative slots taken too (tests/test_overload.py tests those), the Unix
    # socket answers like TCP.
    daemon = make_daemon(server={"max_connections": 2, "admin_connections": 1})
    first, second = Raw(daemon, "tcp"), Raw(daemon, "unix")
    first.hello()
    second.hello()
    admin = Raw(daemon, "unix")
    admin.hello()
    third = Raw(daemon, kind)
    message = third.closed_after_notification(ErrorCode.BUSY)  # unprompted: nothing was sent
    assert "2" in message
    third.close()
    second.close()
    # Closing one makes room (the daemon notices the close soon after).
    for _ in range(200):  # polled: the daemon notices the close soon after
        time.sleep(0.02)
        fourth = Raw(daemon, kind)
        fourth.send("hello", [{"protocol": 1}])
        header, _ = fourth.frame()
        if header[0] == 1:
            break
        fourth.close()
    assert header[:3] == [1, 1, None], header
    assert_in_sync(fourth)
    fourth.close()
    admin.close()
    first.close()


def test_put_end_and_put_revoke_codes(shared, request):
    namespace = unique(request)
    raw, other = Raw(shared, "unix"), Raw(shared, "unix")
    raw.hello(namespace)
    other.hello(namespace)
    for method in ("put_end", "put_revoke"):
        raw.refused(ErrorCode.OBJECT_NOT_FOUND, method, ["never-started"])
    assert raw.ok("put", ["readable", None], b"v") is True
    for method in ("put_end", "put_revoke"):
        raw.refused(ErrorCode.INVALID_WRITE, method, ["readable"])
    raw.ok("put_start", ["theirs", 10, None])
    for method in ("put_end", "put_revoke"):
        other.refused(ErrorCode.ILLEGAL_CLIENT, method, ["theirs"])
    assert other.ok("batch_put_end", [["never-started", "readable", "theirs"]]) == [
        ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_WRITE, ErrorCode.ILLEGAL_CLIENT]
    assert raw.ok("put_revoke", ["theirs"]) == 0
    raw.refused(ErrorCode.OBJECT_NOT_FOUND, "put_end", ["theirs"])  # revoked: gone
    raw.close()
    other.close()


def test_shared_memory_calls_over_tcp_are_not_supported(shared, request):
    raw = Raw(shared, "tcp")
    raw.hello(unique(request))
    assert raw.ok("put", ["k", None], b"v") is True
    for method, params in [("put_start", ["k2", 1, None]), ("put_end", ["k"]),
                           ("put_revoke", ["k"]), ("batch_put_start", [["k2"], [1], None]),
                           ("batch_put_end", [["k"]]), ("batch_put_revoke", [["k"]]),
                           ("get_replica", ["k"]), ("batch_get_replica", [["k"]]),
                           ("reserve", [[[1, 1]]]), ("put_commit", ["k2", 0, 0, 1]),
                           ("batch_put_commit", [["k2"], [[0, 0, 1]]])]:
        raw.refused(ErrorCode.NOT_SUPPORTED, method, params)
    raw.close()


def test_max_batch_keys_is_announced_and_enforced(shared, kind, request):
    raw = Raw(shared, kind)
    result = raw.hello(unique(request))
    assert result["max_batch_keys"] == MAX_BATCH_KEYS
    keys = [f"k{i}" for i in range(MAX_BATCH_KEYS)]
    assert raw.ok("batch_put", [keys, [1] * len(keys), None], b"v" * len(keys)) == [0] * 4
    over = keys + ["one-more"]
    for method, params, payload in [
            ("batch_put", [over, [1] * len(over), None], b"v" * len(over)),
            ("batch_get", [over], b""), ("batch_exists", [over], b""),
            ("batch_remove", [over], b"")]:
        assert str(MAX_BATCH_KEYS) in raw.refused(ErrorCode.INVALID_PARAMS, method, params,
                                                  payload)
    assert not stored(raw, "one-more")
    assert raw.ok("batch_exists", [keys]) == [1] * 4
    raw.close()


def test_batch_put_with_a_repeated_key_or_an_empty_item_stores_nothing(raw):
    raw.refused(ErrorCode.INVALID_PARAMS, "batch_put", [["a", "b", "a"], [1, 1, 1], None],
                b"xyz")
    raw.refused(ErrorCode.INVALID_PARAMS, "batch_put", [["a", "b"], [2, 0], None], b"xy")
    assert_in_sync(raw)
    assert not stored(raw, "a") and not stored(raw, "b")
    assert raw.ok("batch_put", [["a", "b"], [1, 2], None], b"xyz") == [0, 0]


def test_batch_put_start_with_a_repeated_key_or_an_empty_item_starts_nothing(shared, request):
    raw = Raw(shared, "unix")
    raw.hello(unique(request))
    raw.refused(ErrorCode.INVALID_PARAMS, "batch_put_start", [["a", "a"], [1, 1], None])
    raw.refused(ErrorCode.INVALID_PARAMS, "batch_put_start", [["a", "b"], [1, 0], None])
    assert raw.ok("objects_list", [""]) == []  # nothing is being written either
    raw.close()


def test_read_and_remove_batches_answer_a_repeated_key_in_turn(raw):
    assert raw.ok("put", ["a", None], b"xyz") is True
    error, result, payload = raw.call("batch_get", [["a", "a", "missing"]])
    assert error is None and result == [3, 3, ErrorCode.OBJECT_NOT_FOUND]
    assert payload == b"xyzxyz"
    assert raw.ok("batch_exists", [["a", "a"]]) == [1, 1]
    assert raw.ok("batch_remove", [["a", "a"], True]) == [0, ErrorCode.OBJECT_NOT_FOUND]


def test_an_envelope_error_closes_and_a_params_error_does_not(shared, kind):
    # The params hold a key as bin, a bin map key, an ext value: answered, connection open.
    raw = Raw(shared, kind)
    raw.hello()
    raw.refused(ErrorCode.INVALID_PARAMS, "exists", [b"key-as-bin"])
    raw.refused(ErrorCode.INVALID_PARAMS, "get", [msgpack.ExtType(5, b"x")])
    raw.refused(ErrorCode.INVALID_PARAMS, "put", ["k", {b"replica_num": 1}], b"v")
    assert_in_sync(raw)
    raw.close()
    # The envelope: a method as bin, params as a map, a msgid of the wrong type: closed.
    for header in ([0, 1, b"ping", []], [0, 1, "ping", {}], [0, "1", "ping", []],
                   [0, 1, "ping", [], None]):
        raw = Raw(shared, kind)
        raw.hello()
        raw.send_header(msgpack.packb(header, use_bin_type=True))
        raw.closed_after_notification(ErrorCode.PROTOCOL_ERROR)
        raw.close()
    # A str that is not UTF-8 cannot be decoded, wherever it is: closed.
    raw = Raw(shared, kind)
    raw.hello()
    raw.send_header(b"\x94\x00\x01\xa6exists\x91\xa2\xff\xfe")
    raw.closed_after_notification(ErrorCode.PROTOCOL_ERROR)
    raw.close()


def test_encodings_need_not_be_minimal(raw):
    # [0, 7, "put", ["wide", nil]] with the msgid as uint32, the method as str8, the params
    # as array16 and the key as str16; the daemon answers in the shortest form.
    header = (b"\x94\x00\xce\x00\x00\x00\x07\xd9\x03put\xdc\x00\x02\xda\x00\x04wide\xc0")
    assert msgpack.unpackb(header) == [0, 7, "put", ["wide", None]]
    raw.send_header(header, b"value")
    assert raw.frame() == ([1, 7, None, True], b"")
    raw.sock.sendall(PREFIX.pack(len(header), 5) + header + b"value")
    header_bytes = raw._exactly(PREFIX.size)
    assert PREFIX.unpack(header_bytes) == (5, 0)
    assert raw._exactly(5) == b"\x94\x01\x07\xc0\xc2"  # [1, 7, nil, false]: existed


def test_status_has_the_cluster_key_and_the_page_lists_every_status_key(raw):
    status = raw.ok("status", [])
    assert status["cluster"] is None  # a single node
    row = _table_row("status")
    for key in status:
        assert f"`{key}`" in row, f"status key {key!r} is not in PROTOCOL.md"


def test_the_page_lists_every_hello_key_and_the_vectors_match_the_daemon(shared, kind):
    import json
    raw = Raw(shared, kind)
    result = raw.hello()
    raw.close()
    section = _section("## 4. Handshake", "## 5. Methods")
    for key in result:
        assert f"`{key}`" in section, f"hello key {key!r} is not in PROTOCOL.md"
    with open(VECTORS_PATH, encoding="utf-8") as f:
        vectors = {v["name"]: v for v in json.load(f)}
    vector = vectors[f"hello_response_{kind}"]["header"][3]
    assert list(vector) == list(result), "the hello vector's keys, in the daemon's order"
    if kind == "unix":
        assert result["segments"] and vector["segments"]
        assert list(vector["segments"][0]) == list(result["segments"][0])
    section_segments = _section("## 4. Handshake", "## 5. Methods")
    for key in result["segments"][0] if result["segments"] else ():
        assert key in section_segments


def test_every_error_code_the_daemon_uses_is_in_the_table():
    table = {}
    for line in _section("## 6. Error codes", "## 7. Example").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"-\d+( / -\d+)?", cells[0]):
            codes = [int(c) for c in cells[0].split(" / ")]
            names = cells[1].split(" / ")
            for code, name in zip(codes, names):
                table[name] = code
    for name, code in table.items():
        assert ErrorCode[name] == code, f"{name} is {int(ErrorCode[name])}, the table {code}"
    used = set()
    for directory in ("daemon", "meta", "cluster", "proto", "raft", "io"):
        root = os.path.join(REPO, "mooncaked", directory)
        for folder, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        used.update(re.findall(r"ErrorCode\.([A-Z_]+)", f.read()))
    missing = sorted(used - set(table))
    assert not missing, f"codes the daemon uses but PROTOCOL.md section 6 omits: {missing}"


def _protocol_text() -> str:
    with open(PROTOCOL_PATH, encoding="utf-8") as f:
        return f.read()


def _section(start: str, end: str) -> str:
    text = _protocol_text()
    return text[text.index(start):text.index(end)]


def _table_row(method: str) -> str:
    for line in _protocol_text().splitlines():
        if line.startswith(f"| `{method}` |"):
            return line
    raise AssertionError(f"no table row for {method}")


# -- a value over max_payload_bytes: every client refuses it before sending ---------------------

def _too_big() -> bytes:
    return b"x" * (MAX_PAYLOAD_BYTES + 1)


def _assert_refused_for_size(exc: MooncakedError) -> None:
    assert exc.code == ErrorCode.INVALID_PARAMS, exc
    assert "max_payload_bytes" in exc.message and str(MAX_PAYLOAD_BYTES) in exc.message


@pytest.mark.parametrize("address_kind", ["tcp", "unix-socket-only"])
def test_blocking_client_refuses_a_value_over_max_payload_bytes(shared, address_kind):
    address = shared.tcp_address if address_kind == "tcp" else shared.unix_address
    with BlockingClient.connect(address, namespace=f"too-big-{address_kind}",
                                map_segments=False) as client:
        assert client.server["max_payload_bytes"] == MAX_PAYLOAD_BYTES
        for attempt in (lambda: client.put("big", _too_big()),
                        lambda: client.upsert("big", _too_big()),
                        lambda: client.batch_put(["a", "b"], [_too_big()[:MAX_PAYLOAD_BYTES],
                                                              b"y"])):
            with pytest.raises(MooncakedError) as info:
                attempt()
            _assert_refused_for_size(info.value)
            assert not client.closed
            assert client.ping() == "pong"
        assert client.exists("big") is False and client.batch_exists(["a", "b"]) == [False] * 2
        at_limit = os.urandom(MAX_PAYLOAD_BYTES)
        assert client.put("big", at_limit) is True
        assert client.get("big") == at_limit


def test_blocking_client_refuses_a_header_over_max_header_bytes(shared):
    keys = [f"{i}" + "k" * (MAX_KEY_BYTES - 1) for i in range(MAX_BATCH_KEYS)]
    with BlockingClient.connect(shared.tcp_address, namespace="too-big-header") as client:
        assert client.server["max_header_bytes"] == MAX_HEADER_BYTES
        with pytest.raises(MooncakedError) as info:
            client.batch_exists(keys)
        assert info.value.code == ErrorCode.INVALID_PARAMS
        assert "max_header_bytes" in info.value.message
        assert not client.closed and client.ping() == "pong"
        assert client.batch_exists(keys[:2]) == [False, False]


def test_client_pool_refuses_a_value_over_max_payload_bytes(shared):
    with ClientPool.connect(shared.tcp_address, namespace="too-big-pool") as pool:
        with pytest.raises(MooncakedError) as info:
            pool.put("big", _too_big())
        _assert_refused_for_size(info.value)
        assert pool.reconnects == 0  # the connection was kept
        assert pool.ping() == "pong" and pool.exists("big") is False


def test_asyncio_client_refuses_a_value_over_max_payload_bytes(shared):
    async def scenario():
        async with await Client.connect(shared.tcp_address, namespace="too-big-aio") as client:
            for attempt in (lambda: client.put("big", _too_big()),
                            lambda: client.batch_put(["a"], [_too_big()])):
                with pytest.raises(MooncakedError) as info:
                    await attempt()
                _assert_refused_for_size(info.value)
            assert await client.ping() == "pong"
            assert await client.exists("big") is False
    asyncio.run(scenario())


def test_mooncake_facade_refuses_a_value_over_max_payload_bytes(shared):
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 4 * MAX_PAYLOAD_BYTES, "tcp", "",
                       shared.tcp_address) == 0
    try:
        assert store.put("big", _too_big()) == ErrorCode.INVALID_PARAMS
        assert store.put_batch(["a", "b"], [_too_big(), b"y"]) == ErrorCode.INVALID_PARAMS
        assert store.is_exist("big") == 0
        assert store.put("small", b"value") == 0 and store.get("small") == b"value"
    finally:
        store.close()
