"""Property tests of the frame codec and of the daemon's frame reader on hostile input.

Goal: untrusted bytes can only ever be decoded into a well-shaped request or rejected with
PROTOCOL_ERROR (or FRAME_TOO_LARGE for a prefix over its bounds); no other exception escapes,
whatever the bytes, and valid requests survive an encode/decode round trip unchanged.

Method: hypothesis generates random bytes, truncated and padded headers, random msgpack objects,
random prefixes and random valid requests, and feeds them to `mooncaked.proto.framing`
(`check_prefix`, `unpack_header`, `parse_request`). The daemon's `Connection` (an asyncio
BufferedProtocol) is also driven directly, with a stand-in daemon and transport, by pushing byte
streams in random chunk sizes through `get_buffer` / `buffer_updated`, as the event loop does.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mooncaked.daemon.connection import Connection, Incoming, Reply
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import framing
from wire_helpers import MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, request_frame, same, split_frames

U32_MAX = framing.U32_MAX

fuzz = settings(deadline=None, database=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
           | st.text(max_size=40) | st.binary(max_size=40))
params_values = st.recursive(
    scalars,
    lambda children: (st.lists(children, max_size=5)
                      | st.dictionaries(st.text(max_size=10), children, max_size=5)),
    max_leaves=25)
params_lists = st.lists(params_values, max_size=6)

# Any msgpack object, including what strict_map_key rejects and floats.
any_values = st.recursive(
    scalars | st.floats(allow_nan=False),
    lambda children: (st.lists(children, max_size=5)
                      | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children,
                                        max_size=4)),
    max_leaves=25)
# Headers that look like requests, with each part sometimes of the wrong type.
near_requests = st.lists(
    st.integers(-2, 3) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.none() | st.integers(0, U32_MAX + 2) | st.lists(scalars, max_size=3),
    min_size=0, max_size=6)


# -- helpers ------------------------------------------------------------------------------------

def decode_request(data: bytes, max_header_bytes: int = MAX_HEADER_BYTES):
    """unpack_header + parse_request: the parts, or None after a PROTOCOL_ERROR.

    Any other exception, or another error code, propagates and fails the test.
    """
    try:
        header = framing.unpack_header(data, max_header_bytes)
        msgid, method, params = framing.parse_request(header)
    except MooncakedError as exc:
        assert exc.code == ErrorCode.PROTOCOL_ERROR, exc
        return None
    assert type(msgid) is int and 0 <= msgid <= U32_MAX
    assert type(method) is str
    assert type(params) is list
    assert type(header) is list and len(header) == 4
    return msgid, method, params


# -- unpack_header + parse_request --------------------------------------------------------------

@fuzz
@given(st.binary(max_size=300))
@example(b"")
@example(b"\xc1")  # the one byte msgpack never uses
@example(b"\x94\x00\x01\xa3put")  # truncated request
@example(b"\x94\x00\x01\xa3put\x90\xc0")  # trailing byte
@example(b"\x91" * 5000 + b"\xc0")  # deep nesting
@example(b"\xdd\xff\xff\xff\xff")  # array32 announcing 4 G elements
@example(b"\xdb\xff\xff\xff\xff")  # str32 announcing 4 GiB
@example(b"\x81\x01\x02")  # a map with an int key
def test_random_bytes_decode_or_protocol_error(data):
    decode_request(data)
    decode_request(data, max_header_bytes=max(1, len(data)))


@fuzz
@given(any_values)
def test_random_msgpack_objects_decode_or_protocol_error(value):
    decode_request(msgpack.packb(value, use_bin_type=True))


@fuzz
@given(near_requests)
@example([0, 1, "ping", []])
@example([0, U32_MAX, "ping", []])
@example([0, U32_MAX + 1, "ping", []])
@example([0, -1, "ping", []])
@example([0, True, "ping", []])
@example([0, 1, b"ping", []])
@example([0, 1, "ping", {}])
@example([1, 1, "ping", []])
@example([0.0, 1, "ping", []])
@example([False, 1, "ping", []])
def test_request_shape_is_checked(header):
    decoded = decode_request(msgpack.packb(header, use_bin_type=True))
    well_formed = (len(header) == 4 and type(header[0]) is int and header[0] == 0
                   and type(header[1]) is int and 0 <= header[1] <= U32_MAX
                   and type(header[2]) is str and type(header[3]) is list)
    if well_formed:
        assert decoded is not None and same(list(decoded), header[1:])
    else:  # not exactly [0, u32, str, array]: refused (0.0 and false are not 0)
        assert decoded is None, header


@fuzz
@given(st.integers(0, U32_MAX), st.text(max_size=30), params_lists, st.data())
def test_truncated_or_padded_header_is_a_protocol_error(msgid, method, params, data):
    header = framing.pack_header([0, msgid, method, params])
    cut = data.draw(st.integers(0, len(header) - 1), label="cut")
    assert decode_request(header[:cut]) is None  # msgpack is prefix-free: never complete
    extra = data.draw(st.binary(min_size=1, max_size=20), label="extra")
    assert decode_request(header + extra) is None  # trailing bytes: not exactly one object


# -- check_prefix -------------------------------------------------------------------------------

@fuzz
@given(st.integers(0, U32_MAX), st.integers(0, U32_MAX),
       st.integers(256, 64 << 20), st.integers(1, U32_MAX))
@example(0, 0, 256, 1)
@example(256, 1, 256, 1)  # both exactly at their bound: accepted
@example(257, 0, 256, 1)
@example(1, 2, 256, 1)
@example(U32_MAX, U32_MAX, 64 << 20, U32_MAX)
def test_check_prefix_bounds(header_length, payload_length, max_header, max_payload):
    if header_length == 0:
        expected = ErrorCode.PROTOCOL_ERROR
    elif header_length > max_header or payload_length > max_payload:
        expected = ErrorCode.FRAME_TOO_LARGE
    else:
        expected = None
    try:
        framing.check_prefix(header_length, payload_length, max_header, max_payload)
    except MooncakedError as exc:
        assert exc.code == expected, (exc, expected)
    else:
        assert expected is None


@fuzz
@given(st.binary(min_size=8, max_size=8))
def test_random_prefix_is_bounded_or_rejected(prefix):
    header_length, payload_length = framing.PREFIX.unpack(prefix)
    try:
        framing.check_prefix(header_length, payload_length, MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES)
    except MooncakedError as exc:
        assert exc.code in (ErrorCode.PROTOCOL_ERROR, ErrorCode.FRAME_TOO_LARGE)
        return
    assert 1 <= header_length <= MAX_HEADER_BYTES
    assert payload_length <= MAX_PAYLOAD_BYTES


# -- round trip ---------------------------------------------------------------------------------

@fuzz
@given(st.integers(0, U32_MAX), st.text(max_size=40), params_lists, st.integers(0, U32_MAX))
@example(U32_MAX, "put", ["k", None], 5)
@example(0, "", [], 0)
@example(7, "ключ🔑", [b"\x00" * 300, "x" * 70000, list(range(20))], U32_MAX)
def test_request_round_trip(msgid, method, params, payload_length):
    frame = framing.request_head(msgid, method, params, payload_length)
    header_length, announced_payload = framing.PREFIX.unpack_from(frame, 0)
    assert header_length == len(frame) - framing.PREFIX_BYTES
    assert announced_payload == payload_length
    framing.check_prefix(header_length, announced_payload, max(256, header_length), U32_MAX)
    header_bytes = memoryview(frame)[framing.PREFIX_BYTES:]
    decoded = decode_request(header_bytes, max_header_bytes=header_length)
    assert decoded is not None
    assert same(list(decoded), [msgid, method, params])


@fuzz
@given(st.integers(0, U32_MAX), params_values, st.integers(0, U32_MAX))
def test_response_round_trip(msgid, result, payload_length):
    frame = framing.response_head(msgid, result, payload_length)
    header_length, announced_payload = framing.PREFIX.unpack_from(frame, 0)
    assert announced_payload == payload_length
    header = framing.unpack_header(frame[framing.PREFIX_BYTES:], header_length)
    assert same(list(framing.parse_response(header)), [msgid, None, result])


@fuzz
@given(st.integers(0, U32_MAX), st.integers(-(1 << 31), -1), st.text(max_size=60))
def test_error_round_trip(msgid, code, message):
    frame = framing.error_head(msgid, code, message)
    header = framing.unpack_header(frame[framing.PREFIX_BYTES:], MAX_HEADER_BYTES)
    got_msgid, error, result = framing.parse_response(header)
    assert (got_msgid, result) == (msgid, None)
    try:
        framing.raise_error(error)
    except MooncakedError as exc:
        assert (exc.code, exc.message) == (code, message or exc.message)
    else:
        raise AssertionError("raise_error did not raise")


# -- the daemon's frame reader (Connection), driven like the event loop drives it ---------------

class FakeStats:
    def __init__(self) -> None:
        self.bytes_in = self.bytes_out = self.protocol_errors = 0

    def record(self, method, result, elapsed_ns) -> None:
        pass


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data) -> None:
        assert not self.closed, "a write after close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0  # the client reads everything at once

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class FakeDaemon:
    """The parts of the daemon a Connection uses, with three handlers.

    hello: binds the namespace; note: records params; sink: receives the payload into a
    buffer of its own (Incoming), recording completions and aborts.
    """

    def __init__(self) -> None:
        self.max_header_bytes = 4096
        self.max_payload_bytes = 1 << 20
        self.max_response_bytes = 1 << 20
        self.hello_timeout_ms = self.frame_timeout_ms = 10_000
        self.payload_timeout_ms = self.put_payload_timeout_ms = 10_000
        self.now_ms = lambda: 0
        self.stats = FakeStats()
        self.draining = False
        self.auth = None  # authentication off
        self.calls: list = []
        self.aborted: list = []
        self.closed = 0
        self.handlers = {"hello": self.hello, "note": self.note, "sink": self.sink}
        self.payload_methods = frozenset({"sink"})

    def next_connection_id(self) -> int:
        return 1

    def connection_opened(self, conn) -> None:
        pass

    def connection_closed(self, conn) -> None:
        self.closed += 1

    def hello(self, conn, params, payload_length):
        conn.namespace = "default"
        return Reply("hi")

    def note(self, conn, params, payload_length):
        self.calls.append(("note", params, b""))
        return Reply(len(params))

    def sink(self, conn, params, payload_length):
        if payload_length == 0:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "sink needs a payload")
        buffer = bytearray(payload_length)

        def complete():
            self.calls.append(("sink", params, bytes(buffer)))
            return Reply(payload_length)

        def abort():
            self.aborted.append(params)
        return Incoming([memoryview(buffer)], complete, abort)


def feed(conn: Connection, transport: FakeTransport, data: bytes, chunks: list[int]) -> None:
    """Deliver `data` as the event loop would: get_buffer, copy at most its length, updated."""
    position, index = 0, 0
    while position < len(data) and not transport.closed:
        wanted = chunks[index % len(chunks)] if chunks else len(data)
        index += 1
        buffer = conn.get_buffer(-1)
        assert len(buffer) > 0, "get_buffer returned an empty buffer (asyncio would fail)"
        count = min(wanted, len(buffer), len(data) - position)
        buffer[:count] = data[position:position + count]
        conn.buffer_updated(count)
        position += count


def new_connection():
    daemon = FakeDaemon()
    transport = FakeTransport()
    conn = Connection(daemon, "tcp")
    conn.connection_made(transport)
    return daemon, transport, conn


requests = st.lists(
    st.one_of(
        st.tuples(st.just("note"), params_lists, st.just(b"")),
        st.tuples(st.just("sink"), params_lists, st.binary(min_size=1, max_size=3000))),
    max_size=8)
chunkings = st.lists(st.integers(1, 5000), min_size=1, max_size=10)


@fuzz
@given(requests, chunkings)
def test_connection_reads_pipelined_frames_in_any_chunking(calls, chunks):
    daemon, transport, conn = new_connection()
    stream = request_frame(0, "hello", [{"protocol": 1}])
    for msgid, (method, params, payload) in enumerate(calls, start=1):
        stream += request_frame(msgid, method, params, payload)
    feed(conn, transport, stream, chunks)
    assert not transport.closed
    assert len(daemon.calls) == len(calls)
    for got, expected in zip(daemon.calls, calls):
        assert got[0] == expected[0] and same(got[1], expected[1]) and got[2] == expected[2]
    responses = split_frames(bytes(transport.written))
    assert [framing.parse_response(h)[0] for h, _ in responses] == list(range(len(calls) + 1))
    assert all(framing.parse_response(h)[1] is None for h, _ in responses)
    conn.connection_lost(None)
    assert daemon.aborted == []  # everything completed: nothing to undo


@fuzz
@given(st.binary(max_size=3000), chunkings, st.booleans())
@example(b"\x00" * 8, [8], True)  # empty header
@example(struct.pack(">II", 4097, 0), [8], True)  # header over the bound
@example(struct.pack(">II", 3, 1 << 21) + b"\x93\x00\x00", [11], True)  # payload over it
@example(struct.pack(">II", 1, 0) + b"\xc1", [9], True)  # not msgpack
@example(struct.pack(">II", 4, 0) + b"\x93\x01\x02\x03", [12], True)  # not a request
def test_connection_on_random_bytes_answers_or_closes(garbage, chunks, after_hello):
    daemon, transport, conn = new_connection()
    stream = request_frame(0, "hello", [{"protocol": 1}]) if after_hello else b""
    feed(conn, transport, stream + garbage, chunks)  # must not raise
    frames = split_frames(bytes(transport.written))
    for header, _ in frames[:-1]:
        assert type(header) is list and header[0] == framing.RESPONSE
    if transport.closed:
        assert frames, "closed without a word"
        last = frames[-1][0]
        if last[0] == framing.NOTIFICATION:
            assert last[1] == "protocol_error"
            assert last[2][0] in (ErrorCode.PROTOCOL_ERROR, ErrorCode.FRAME_TOO_LARGE)
        else:
            assert last[2][0] == ErrorCode.VERSION_MISMATCH
    conn.connection_lost(None)
    assert daemon.closed == 1
    # A payload being received when the connection ended was aborted, not completed.
    assert len(daemon.aborted) <= 1


@fuzz
@given(st.binary(min_size=2, max_size=3000), chunkings, st.data())
def test_connection_lost_mid_payload_aborts(payload, chunks, data):
    daemon, transport, conn = new_connection()
    stream = request_frame(0, "hello", [{"protocol": 1}]) + request_frame(1, "sink", ["k"],
                                                                           payload)
    cut = data.draw(st.integers(len(stream) - len(payload), len(stream) - 1), label="cut")
    feed(conn, transport, stream[:cut], chunks)
    assert not transport.closed
    conn.connection_lost(None)
    assert daemon.calls == [] and daemon.aborted == [["k"]]


@pytest.mark.parametrize("frame, code", [
    (b"\x00" * 8, ErrorCode.PROTOCOL_ERROR),
    (struct.pack(">II", 4097, 0), ErrorCode.FRAME_TOO_LARGE),
    (struct.pack(">II", 3, (1 << 20) + 1), ErrorCode.FRAME_TOO_LARGE),
    (struct.pack(">II", 1, 0) + b"\xc1", ErrorCode.PROTOCOL_ERROR),
    (struct.pack(">II", 4, 0) + b"\x93\x01\x02\x03", ErrorCode.PROTOCOL_ERROR),
    (struct.pack(">II", 2, 0) + b"\x90\x00", ErrorCode.PROTOCOL_ERROR),  # trailing byte
], ids=["empty-header", "header-too-large", "payload-too-large", "not-msgpack",
        "not-a-request", "two-objects"])
def test_connection_bad_frame_outcome(frame, code):
    daemon, transport, conn = new_connection()
    feed(conn, transport, frame, [len(frame)])
    assert transport.closed
    (header, payload), = split_frames(bytes(transport.written))
    assert header[:2] == [framing.NOTIFICATION, "protocol_error"]
    assert header[2][0] == code and type(header[2][1]) is str and payload == b""
    conn.connection_lost(None)
    assert daemon.calls == [] and daemon.closed == 1


def test_type_tag_must_be_an_int():
    """The type tag is a msgpack int: float 0.0 / bool false / true are not 0 / 1."""
    assert decode_request(msgpack.packb([0.0, 1, "ping", []])) is None
    assert decode_request(msgpack.packb([False, 1, "ping", []])) is None
    for header in ([True, 1, None, 5], [1.0, 1, None, 5]):
        try:
            framing.parse_response(header)
        except MooncakedError as exc:
            assert exc.code == ErrorCode.PROTOCOL_ERROR
        else:
            raise AssertionError(f"{header!r} was taken for a response")


@settings(deadline=None, database=None, max_examples=20)
@given(st.lists(st.integers(1000, 200_000), min_size=1, max_size=4), st.integers(0, 3000))
@example([1 << 20], 0)
def test_connection_header_larger_than_scratch(chunks, extra):
    """A header over the 256 KiB scratch buffer (allowed up to max_header_bytes) is read whole."""
    daemon, transport, conn = new_connection()
    daemon.max_header_bytes = 1 << 20
    big = "x" * (300 * 1024 + extra)
    stream = (request_frame(0, "hello", [{"protocol": 1}])
              + request_frame(1, "note", [big]) + request_frame(2, "sink", ["after"], b"abc")
              + request_frame(3, "note", [big, big]))
    feed(conn, transport, stream, chunks)
    assert not transport.closed
    assert [c[0] for c in daemon.calls] == ["note", "sink", "note"]
    assert daemon.calls[0][1] == [big] and daemon.calls[1][2] == b"abc"
    assert daemon.calls[2][1] == [big, big]
    assert [framing.parse_response(h)[0] for h, _ in split_frames(bytes(transport.written))] \
        == [0, 1, 2, 3]
