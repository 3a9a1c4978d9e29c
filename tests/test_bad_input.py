"""Hostile and broken clients against a real daemon, over raw TCP and Unix sockets.

Goal: no input a client sends can wedge the daemon, leak segment memory or leave a partly
written object readable. Frame-level errors get a `protocol_error` notification and a closed
connection; request-level errors get an error response and the connection stays usable.

Method: each test starts a real `mooncaked` (conftest's `daemon` fixture), records the
segments' `used_bytes`, then misbehaves over a raw socket (TCP and Unix, by parametrization):
truncated frames, oversized lengths, non-msgpack and wrongly shaped headers, bad params,
unknown methods, requests before hello, a wrong protocol version, random bytes, puts abandoned
half-way (socket payload and shared memory). Afterwards it checks the exact answer frames, that
the connection is closed or still usable as PROTOCOL.md says, that used_bytes returns to the
baseline (polled: the daemon revokes on connection loss), that abandoned keys are invisible,
and that another client can still put and get.
"""

from __future__ import annotations

import os
import random
import socket
import time
import uuid

import pytest

import mooncaked
import wire_helpers
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import framing
from wire_helpers import (MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, read_frame, request_frame,
                          split_frames)

IO_TIMEOUT_S = 10.0  # a bound on waiting for the daemon, never an assertion
SETTLE_TIMEOUT_S = 5.0  # how long used_bytes may take to return to the baseline

TRANSPORTS = ["tcp", "unix"]


# -- raw socket helpers -------------------------------------------------------------------------

def connect(daemon, kind: str) -> socket.socket:
    return wire_helpers.connect(daemon, kind, IO_TIMEOUT_S, nodelay=True)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection (EOF or reset)."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


def send(sock: socket.socket, msgid: int, method: str, params: list, payload: bytes = b"") -> None:
    sock.sendall(request_frame(msgid, method, params, payload))


def call(sock: socket.socket, msgid: int, method: str, params: list, payload: bytes = b""):
    """Send one request and read its response: (error, result, payload)."""
    send(sock, msgid, method, params, payload)
    header, response_payload = read_frame(sock)
    assert type(header) is list and len(header) == 4 and header[0] == framing.RESPONSE, header
    assert header[1] == msgid
    return header[2], header[3], response_payload


def hello(sock: socket.socket) -> dict:
    error, result, _ = call(sock, 0, "hello", [{"protocol": 1, "client_name": "bad-input"}])
    assert error is None, error
    assert result["protocol"] == 1
    return result


def assert_error(reply, code: int) -> None:
    error, result, payload = reply
    assert type(error) is list and len(error) == 2, reply
    assert error[0] == code, error
    assert type(error[1]) is str
    assert result is None and payload == b""


def assert_usable(sock: socket.socket, msgid: int = 900) -> None:
    assert call(sock, msgid, "ping", []) == (None, "pong", b"")


def expect_protocol_error_then_close(sock: socket.socket, code: int) -> None:
    frames = split_frames(read_until_closed(sock))
    assert len(frames) == 1, frames
    header, payload = frames[0]
    assert header[:2] == [framing.NOTIFICATION, "protocol_error"], header
    assert type(header[2]) is list and header[2][0] == code and type(header[2][1]) is str
    assert payload == b""


# -- daemon-side checks -------------------------------------------------------------------------

def used_bytes(daemon) -> int:
    with mooncaked.BlockingClient.connect(daemon.unix_address, map_segments=False) as admin:
        return sum(s["used_bytes"] for s in admin.segment_report())


def wait_used_bytes(daemon, expected: int) -> None:
    """Poll until used_bytes == expected (the revoke lands when the daemon sees the close)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    current = used_bytes(daemon)
    while current != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        current = used_bytes(daemon)
    assert current == expected, f"used_bytes is {current}, the baseline {expected}"


def wait_used_bytes_above(daemon, baseline: int) -> int:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    current = used_bytes(daemon)
    while current <= baseline and time.monotonic() < deadline:
        time.sleep(0.02)
        current = used_bytes(daemon)
    assert current > baseline, "the daemon never allocated space for the put"
    return current


def client_address(daemon, kind: str) -> str:
    return daemon.tcp_address if kind == "tcp" else daemon.unix_address


def assert_invisible(client, key: str) -> None:
    assert client.exists(key) is False
    with pytest.raises(MooncakedError) as info:
        client.get(key)
    assert info.value.code == ErrorCode.OBJECT_NOT_FOUND


def assert_daemon_healthy(daemon, kind: str, baseline: int, invisible=()) -> None:
    """used_bytes back at the baseline, abandoned keys invisible, and a fresh put/get works."""
    assert daemon.process.poll() is None, "the daemon exited:\n" + daemon.log()
    wait_used_bytes(daemon, baseline)
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as client:
        for key in invisible:
            assert_invisible(client, key)
        key = f"alive-{uuid.uuid4().hex}"
        value = os.urandom(4096)
        assert client.put(key, value) is True
        assert client.get(key) == value


@pytest.fixture(params=TRANSPORTS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def baseline(daemon) -> int:
    return used_bytes(daemon)


# -- frame-level errors: notification, then the connection closes -------------------------------

def assert_bad_frame_closes(daemon, kind: str, baseline: int, data: bytes, code: int,
                            invisible=()) -> None:
    """After hello, send `data`: one protocol_error `code` notification, the close, and the
    daemon healthy afterwards (used_bytes at the baseline, `invisible` keys not readable)."""
    sock = connect(daemon, kind)
    hello(sock)
    sock.sendall(data)
    expect_protocol_error_then_close(sock, code)
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline, invisible=invisible)


@pytest.mark.parametrize("cut", ["prefix", "header"])
def test_truncated_frame_then_disconnect(daemon, kind, baseline, cut):
    sock = connect(daemon, kind)
    hello(sock)
    frame = framing.request_head(1, "put", ["truncated", None], 100) + b"v" * 100
    sent = 5 if cut == "prefix" else framing.PREFIX_BYTES + 6
    sock.sendall(frame[:sent])
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline, invisible=["truncated"])


def test_oversized_header_length(daemon, kind, baseline):
    assert_bad_frame_closes(daemon, kind, baseline, framing.PREFIX.pack(MAX_HEADER_BYTES + 1, 0),
                            ErrorCode.FRAME_TOO_LARGE)


def test_oversized_payload_length(daemon, kind, baseline):
    header = framing.pack_header([0, 1, "put", ["too-big", None]])
    assert_bad_frame_closes(daemon, kind, baseline,
                            framing.PREFIX.pack(len(header), MAX_PAYLOAD_BYTES + 1) + header,
                            ErrorCode.FRAME_TOO_LARGE, invisible=["too-big"])


def test_empty_header(daemon, kind, baseline):
    assert_bad_frame_closes(daemon, kind, baseline, framing.PREFIX.pack(0, 0),
                            ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize("header", [
    b"\xc1",  # the byte msgpack never uses
    b"\x94\x00\x01\xa3pu",  # a request cut short inside the header
    b"\x94\x00\x01\xa4ping\x90\xc0",  # one object and a trailing byte
    b"\xdb\xff\xff\xff\xff",  # a str32 announcing 4 GiB
    b"\x81\x01\x02",  # a map with an int key
], ids=["reserved-byte", "cut-short", "trailing-byte", "huge-str", "int-map-key"])
def test_header_not_msgpack(daemon, kind, baseline, header):
    assert_bad_frame_closes(daemon, kind, baseline, framing.PREFIX.pack(len(header), 0) + header,
                            ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize("header", [
    [1, 2, 3],
    {"method": "ping"},
    "ping",
    [1, 7, None, True],  # a response, not a request
    [0, -1, "ping", []],  # msgid below u32
    [0, 1 << 32, "ping", []],  # msgid above u32
    [0, 1, b"ping", []],  # method as bin
    [0, 1, "ping", {}],  # params as a map
    [0, 1, "ping"],
], ids=["ints", "map", "str", "response", "msgid-negative", "msgid-too-big", "bin-method",
        "map-params", "three-elements"])
def test_header_not_a_request(daemon, kind, baseline, header):
    packed = framing.pack_header(header)
    assert_bad_frame_closes(daemon, kind, baseline, framing.PREFIX.pack(len(packed), 0) + packed,
                            ErrorCode.PROTOCOL_ERROR)


def test_bad_frame_with_payload_stores_nothing(daemon, kind, baseline):
    """A put whose header is malformed: the payload it announced is never stored."""
    packed = framing.pack_header([0, 1, "put", ["bad-shape", None], "extra"])
    assert_bad_frame_closes(daemon, kind, baseline,
                            framing.PREFIX.pack(len(packed), 5) + packed + b"hello",
                            ErrorCode.PROTOCOL_ERROR, invisible=["bad-shape"])


def test_random_bytes(daemon, kind, baseline):
    """64 KiB of (seeded) random bytes: whatever comes back is well framed, then the close."""
    garbage = random.Random(20240601).randbytes(64 * 1024)
    sock = connect(daemon, kind)
    hello(sock)
    try:
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the daemon already gave up on us
        pass
    frames = split_frames(read_until_closed(sock))
    sock.close()
    for header, _ in frames:
        assert header[:2] == [framing.NOTIFICATION, "protocol_error"], header
        assert header[2][0] in (ErrorCode.PROTOCOL_ERROR, ErrorCode.FRAME_TOO_LARGE)
    assert len(frames) <= 1
    assert_daemon_healthy(daemon, kind, baseline)


def test_random_bytes_before_hello(daemon, kind, baseline):
    garbage = random.Random(7).randbytes(64 * 1024)
    sock = connect(daemon, kind)
    try:
        sock.sendall(garbage)
    except (BrokenPipeError, ConnectionResetError):
        pass
    read_until_closed(sock)
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline)


# -- request-level errors: an error response, and the connection stays usable -------------------

def test_wrong_param_types(daemon, kind, baseline):
    sock = connect(daemon, kind)
    hello(sock)
    assert_error(call(sock, 1, "get", [123]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 2, "get", [""]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 3, "exists", []), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 4, "exists", ["a", "b"]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 5, "put", [42], b"hello"), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 6, "put", ["typed", "not-a-map"], b"hello"),
                 ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 7, "put", ["typed", {"replica_num": "two"}], b"hello"),
                 ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 8, "put", ["typed", {"no_such_option": 1}], b"hello"),
                 ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 9, "remove", ["typed", "yes"]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 10, "batch_get", ["not-a-list"]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 11, "ping", [], b"xyz"), ErrorCode.INVALID_PARAMS)  # no payload
    assert_usable(sock)
    wait_used_bytes(daemon, baseline)  # the refused puts' payloads were dropped, not stored
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as other:
        assert_invisible(other, "typed")
    # The same connection still stores and reads values.
    assert call(sock, 12, "put", ["typed", None], b"hello") == (None, True, b"")
    assert call(sock, 13, "get", ["typed"]) == (None, 5, b"hello")
    sock.close()
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as client:
        assert client.get("typed") == b"hello"


def test_unknown_method(daemon, kind, baseline):
    sock = connect(daemon, kind)
    hello(sock)
    assert_error(call(sock, 1, "no_such_method", []), ErrorCode.UNKNOWN_METHOD)
    assert_error(call(sock, 2, "no_such_method", ["k"], b"payload"), ErrorCode.UNKNOWN_METHOD)
    assert_usable(sock)
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline)


def test_request_before_hello(daemon, kind, baseline):
    sock = connect(daemon, kind)
    assert_error(call(sock, 1, "get", ["k"]), ErrorCode.HANDSHAKE_REQUIRED)
    assert_error(call(sock, 2, "put", ["before-hello", None], b"hello"),
                 ErrorCode.HANDSHAKE_REQUIRED)
    hello(sock)  # the connection is still open: the handshake can follow
    assert_usable(sock)
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline, invisible=["before-hello"])


def test_hello_with_protocol_2(daemon, kind, baseline):
    sock = connect(daemon, kind)
    send(sock, 5, "hello", [{"protocol": 2}])
    frames = split_frames(read_until_closed(sock))
    sock.close()
    assert len(frames) == 1, frames
    header, payload = frames[0]
    assert header[:2] == [framing.RESPONSE, 5] and header[3] is None and payload == b""
    assert header[2][0] == ErrorCode.VERSION_MISMATCH and type(header[2][1]) is str
    assert_daemon_healthy(daemon, kind, baseline)


def test_put_of_empty_value(daemon, kind, baseline):
    sock = connect(daemon, kind)
    hello(sock)
    assert_error(call(sock, 1, "put", ["empty", None]), ErrorCode.INVALID_PARAMS)
    assert_error(call(sock, 2, "upsert", ["empty", None]), ErrorCode.INVALID_PARAMS)
    assert_usable(sock)
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline, invisible=["empty"])


@pytest.mark.parametrize("payload", [b"", b"AAABB", b"AAABBBBX", b"AAABBBB" * 100],
                         ids=["none", "short", "one-over", "long"])
def test_batch_put_sizes_do_not_add_up(daemon, kind, baseline, payload):
    sock = connect(daemon, kind)
    hello(sock)
    assert_error(call(sock, 1, "batch_put", [["bp-a", "bp-b"], [3, 4], None], payload),
                 ErrorCode.INVALID_PARAMS)
    assert_usable(sock)
    wait_used_bytes(daemon, baseline)
    # The connection is still in frame sync: a correct batch_put goes through.
    assert call(sock, 2, "batch_put", [["bp-c", "bp-d"], [3, 4], None], b"CCCDDDD") \
        == (None, [0, 0], b"")
    sock.close()
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as client:
        assert client.batch_get(["bp-c", "bp-d"]) == [b"CCC", b"DDDD"]
        for key in ("bp-a", "bp-b"):
            assert_invisible(client, key)


# -- abandoned puts: revoked when the connection is lost ----------------------------------------

def test_half_written_put_then_disconnect(daemon, kind, baseline):
    size = 1 << 20
    key = "half-written"
    sock = connect(daemon, kind)
    hello(sock)
    sock.sendall(framing.request_head(1, "put", [key, None], size))
    sock.sendall(os.urandom(size // 2))
    wait_used_bytes_above(daemon, baseline)  # the put really started
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as other:
        assert_invisible(other, key)  # being written: invisible
    sock.close()
    assert_daemon_healthy(daemon, kind, baseline, invisible=[key])
    with mooncaked.BlockingClient.connect(client_address(daemon, kind)) as client:
        value = os.urandom(size)
        assert client.put(key, value) is True  # nothing of the abandoned put is left
        assert client.get(key) == value


def test_shared_memory_put_then_disconnect(daemon, baseline):
    """put_start over the Unix socket and no put_end: the daemon revokes it on close."""
    size = 1 << 20
    key = "shm-abandoned"
    sock = connect(daemon, "unix")
    server = hello(sock)
    assert server["segments"], "the Unix socket hello lists the segments"
    error, placement, _ = call(sock, 1, "put_start", [key, size, None])
    assert error is None
    segment_id, offset = placement
    segment = next(s for s in server["segments"] if s["id"] == segment_id)
    assert 0 <= offset and offset + size <= segment["size_bytes"]
    assert used_bytes(daemon) >= baseline + size
    with mooncaked.BlockingClient.connect(daemon.unix_address) as other:
        assert_invisible(other, key)
    sock.close()
    assert_daemon_healthy(daemon, "unix", baseline, invisible=[key])
    with mooncaked.BlockingClient.connect(daemon.unix_address) as client:
        assert client.put(key, b"fresh") is True
        assert client.get(key) == b"fresh"


def test_batch_shared_memory_put_then_disconnect(daemon, baseline):
    keys = ["shm-b0", "shm-b1", "shm-b2"]
    sock = connect(daemon, "unix")
    hello(sock)
    error, placements, _ = call(sock, 1, "batch_put_start", [keys, [4096, 8192, 100], None])
    assert error is None and all(type(p) is list for p in placements), placements
    assert call(sock, 2, "put_end", ["shm-b1"]) == (None, 0, b"")  # one of them finished
    sock.close()
    with mooncaked.BlockingClient.connect(daemon.unix_address, map_segments=False) as client:
        # The finished one is kept. object_stat grants no lease, so a plain remove frees it.
        stat = client.object_stat("shm-b1")
        assert stat["state"] == "complete" and stat["size_bytes"] == 8192
        assert client.remove("shm-b1") is None
    assert_daemon_healthy(daemon, "unix", baseline, invisible=["shm-b0", "shm-b2"])


def test_put_start_over_tcp_is_refused(daemon, baseline):
    sock = connect(daemon, "tcp")
    hello(sock)
    assert_error(call(sock, 1, "put_start", ["tcp-shm", 4096, None]), ErrorCode.NOT_SUPPORTED)
    assert_usable(sock)
    sock.close()
    assert_daemon_healthy(daemon, "tcp", baseline, invisible=["tcp-shm"])


# -- the largest headers -------------------------------------------------------------------------

def test_header_larger_than_scratch_buffer(daemon, kind, baseline):
    """A legal header over the reader's 256 KiB scratch buffer is read whole and answered."""
    sock = connect(daemon, kind)
    hello(sock)
    key = "k" * 4000
    keys = [f"{i:05d}" + key[5:] for i in range(80)]  # 80 keys of 4000 bytes: ~320 KiB header
    assert len(framing.pack_header([0, 1, "batch_exists", [keys]])) > 256 * 1024
    try:
        assert call(sock, 1, "batch_exists", [keys]) == (None, [0] * 80, b"")
        assert_usable(sock)
    finally:
        sock.close()
    assert_daemon_healthy(daemon, kind, baseline)
