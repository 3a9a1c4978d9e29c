"""mooncaked's Mooncake-compatible transfer layer on real sockets: the data server's framing
and validation (it touches registered memory only), the initiator's handling of peers that
refuse, break the protocol or disconnect, the handshake frames, and the bounds."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

import pytest

from mooncaked.transfer import (READ, WRITE, RegisteredMemory, SegmentDescriptor,
                                TransferEndpoint, TransferRequest, TransferState)
from mooncaked.transfer import handshake
from mooncaked.transfer.descriptors import DescriptorError
from mooncaked.transfer.mooncake_tcp import (TcpDataServer, TcpInitiator, TransferFailed,
                                             TransferTarget, TransferTimeout, decode_status,
                                             encode_header, encode_status)
from transfer_helpers import LOOP_KINDS, GuardedMemory, LoopThread, loop_usable, pattern

OK = bytes.fromhex("000000005654434d")
REFUSED = bytes.fromhex("010000005654434d")


@pytest.fixture(params=LOOP_KINDS)
def loop(request):
    usable, why = loop_usable(request.param)
    if not usable:
        pytest.skip(f"the io_uring loop cannot run here: {why}")
    thread = LoopThread(request.param)
    yield thread
    thread.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closes without sending anything more (waits up to 30 s)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class DataServer:
    """A TcpDataServer on the loop thread over `regions` (GuardedMemory each), registered."""

    def __init__(self, loop: LoopThread, *regions: GuardedMemory, adjacent: bool = False,
                 **options) -> None:
        self.loop = loop
        self.memory = RegisteredMemory()
        for region in regions:
            self.memory.register(region.address, region.length)
        self.server = TcpDataServer(self.memory, **options)
        self.port = loop.run(self.server.start("127.0.0.1", 0))

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        return sock

    def close(self) -> None:
        self.loop.run(self.server.close())


@pytest.fixture
def region():
    memory = GuardedMemory(256 * 1024)
    yield memory
    assert memory.guards_intact()


# -- the data server --------------------------------------------------------------------------

def test_header_layout():
    assert encode_header(WRITE, 0x10000080, 4096, 2).hex() == \
        "0010000000000000" "8000001000000000" "81" "00000000000000"
    assert encode_header(READ, 1, 2, 1).hex() == \
        "0200000000000000" "0100000000000000" "00" "00000000000000"
    assert encode_status(0) == OK and encode_status(1) == REFUSED
    assert decode_status(REFUSED) == 1
    with pytest.raises(ValueError):
        decode_status(b"\x00" * 8)


def test_v2_write_then_read_pipelined_on_one_connection(loop, region):
    server = DataServer(loop, region)
    data = pattern(100_000, 1)
    with server.connect() as sock:
        # Both requests in one send: the server answers them in order.
        sock.sendall(encode_header(WRITE, region.address + 3, len(data), 2) + data +
                     encode_header(READ, region.address + 3, len(data), 2))
        assert recv_exactly(sock, 8) == OK  # the WRITE is in memory
        assert recv_exactly(sock, 8) == OK  # the READ's data follows
        assert recv_exactly(sock, len(data)) == data
    assert region.read(3, len(data)) == data
    assert region.read(0, 3) == bytes(3)
    assert server.server.served_requests == {1: 0, 2: 2}
    server.close()


def test_v1_write_and_read_have_no_status(loop, region):
    server = DataServer(loop, region)
    with server.connect() as sock:
        sock.sendall(encode_header(WRITE, region.address, 5, 1) + b"hello" +
                     encode_header(READ, region.address, 5, 1))
        assert recv_exactly(sock, 5) == b"hello"
    server.close()


def test_large_read_is_sent_in_slices_under_flow_control(loop):
    region = GuardedMemory(8 << 20)
    region.write(0, pattern(8 << 20, 2))
    server = DataServer(loop, region, slice_bytes=4096)
    with server.connect() as sock:
        sock.sendall(encode_header(READ, region.address, 8 << 20, 2))
        assert recv_exactly(sock, 8) == OK
        assert recv_exactly(sock, 8 << 20) == pattern(8 << 20, 2)
        # The connection serves the next request after a long READ.
        sock.sendall(encode_header(READ, region.address + 1, 2, 2))
        assert recv_exactly(sock, 10) == OK + pattern(8 << 20, 2)[1:3]
    server.close()
    assert region.guards_intact()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("opcode", [READ, WRITE])
def test_range_outside_registered_memory_is_refused(loop, region, version, opcode):
    server = DataServer(loop, region)
    region.write(0, pattern(region.length, 3))
    for address, length in [(region.address - 1, 16),  # starts in the guard before
                            (region.address + region.length - 8, 16),  # runs past the end
                            (region.address + region.length, 1),  # just after
                            (0, 16)]:
        with server.connect() as sock:
            payload = b"\xff" * length if opcode == WRITE else b""
            sock.sendall(encode_header(opcode, address, length, version) + payload)
            if version == 2:
                assert recv_exactly(sock, 8) == REFUSED
            assert closed_by_peer(sock)
    assert region.read(0, region.length) == pattern(region.length, 3)
    assert server.server.rejected_requests == 4
    server.close()


def test_range_straddling_two_adjacent_buffers_is_refused(loop):
    both = GuardedMemory(8192)
    memory = RegisteredMemory()
    memory.register(both.address, 4096)
    memory.register(both.address + 4096, 4096)  # adjacent, a buffer of its own
    server = TcpDataServer(memory)
    port = loop.run(server.start("127.0.0.1", 0))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(encode_header(WRITE, both.address + 4000, 200, 2) + b"\xff" * 200)
        assert recv_exactly(sock, 8) == REFUSED
        assert closed_by_peer(sock)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(encode_header(WRITE, both.address + 4096, 200, 2) + b"\x01" * 200)
        assert recv_exactly(sock, 8) == OK
    assert both.read(0, 4096) == bytes(4096)
    assert both.read(4096, 200) == b"\x01" * 200
    loop.run(server.close())
    assert both.guards_intact()


def test_oversize_request_is_refused(loop):
    region = GuardedMemory(2 << 20)
    server = DataServer(loop, region, max_request_bytes=1 << 20)
    with server.connect() as sock:
        sock.sendall(encode_header(READ, region.address, (1 << 20) + 1, 2))
        assert recv_exactly(sock, 8) == REFUSED
        assert closed_by_peer(sock)
    with server.connect() as sock:  # 2^64 - 1 bytes: refused, nothing read or written
        sock.sendall(encode_header(WRITE, region.address, (1 << 64) - 1, 2) + b"\xff" * 64)
        assert recv_exactly(sock, 8) == REFUSED
    with server.connect() as sock:  # at the bound: served
        sock.sendall(encode_header(READ, region.address, 1 << 20, 2))
        assert recv_exactly(sock, 8 + (1 << 20)) == OK + bytes(1 << 20)
    assert region.read(0, region.length) == bytes(region.length)
    server.close()
    assert region.guards_intact()


@pytest.mark.parametrize("opcode_byte", [0x02, 0x82, 0x7F, 0xFF])
def test_unknown_opcode_closes_the_connection(loop, region, opcode_byte):
    server = DataServer(loop, region)
    with server.connect() as sock:
        sock.sendall(struct.pack("<QQB7x", 16, region.address, opcode_byte) + b"\xff" * 16)
        assert closed_by_peer(sock)
    assert region.read(0, 64) == bytes(64)
    server.close()


def test_short_header_and_disconnect_mid_write(loop, region):
    server = DataServer(loop, region)
    with server.connect() as sock:
        sock.sendall(encode_header(WRITE, region.address, 16, 2)[:10])
    # The peer disconnects after 1000 of 4096 payload bytes: only the target range is
    # touched (its first bytes), and no status is sent.
    with server.connect() as sock:
        sock.sendall(encode_header(WRITE, region.address + 8192, 4096, 2) + b"\x11" * 1000)
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock)
    assert region.read(0, 8192) == bytes(8192)
    assert region.read(8192 + 4096, 4096) == bytes(4096)
    # The server keeps serving.
    with server.connect() as sock:
        sock.sendall(encode_header(WRITE, region.address, 4, 2) + b"abcd")
        assert recv_exactly(sock, 8) == OK
    assert region.read(0, 4) == b"abcd"
    server.close()


def test_stalled_request_is_dropped_but_idle_connection_kept(loop, region):
    server = DataServer(loop, region, receive_timeout_ms=200)
    with server.connect() as idle, server.connect() as stalled:
        stalled.sendall(encode_header(WRITE, region.address, 4096, 2) + b"\x22" * 100)
        assert closed_by_peer(stalled)
        # The idle connection (between requests) is still served afterwards.
        idle.sendall(encode_header(READ, region.address + 200, 4, 2))
        assert recv_exactly(idle, 12) == OK + bytes(4)
    server.close()


def test_connections_over_the_bound_are_closed(loop, region):
    server = DataServer(loop, region, max_connections=2)
    first, second = server.connect(), server.connect()
    for sock in (first, second):  # both accepted and served
        sock.sendall(encode_header(READ, region.address, 1, 2))
        assert recv_exactly(sock, 9) == OK + b"\x00"
    with server.connect() as third:
        assert closed_by_peer(third)
    first.close()
    second.close()
    server.close()


def test_zero_length_write_inside_a_buffer(loop, region):
    server = DataServer(loop, region)
    with server.connect() as sock:
        sock.sendall(encode_header(WRITE, region.address + 10, 0, 2))
        assert recv_exactly(sock, 8) == OK
    server.close()


# -- the initiator against peers that misbehave ---------------------------------------------

class FakePeer:
    """A blocking data server on a thread: behaviour(conn, size, address, opcode) answers
    each request; it returns False to close the connection."""

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    size, address, opcode = struct.unpack("<QQB7x", recv_exactly(conn, 24))
                except (EOFError, OSError):
                    return
                with self._lock:
                    self.active += 1
                    self.most_active = max(self.most_active, self.active)
                try:
                    if self.behaviour(conn, size, address, opcode) is False:
                        return
                finally:
                    with self._lock:
                        self.active -= 1

    def target(self, version: int = 2) -> TransferTarget:
        return TransferTarget("127.0.0.1", self.port, version)

    def close(self) -> None:
        self.listener.close()


def answer_then_close(answer: bytes):
    def behaviour(conn, size, address, opcode):
        conn.sendall(answer if callable(answer) is False else answer(size))
        return False
    return behaviour


def run_initiator(loop: LoopThread, opcode: int, local: memoryview, target: TransferTarget,
                  address: int = 0x1000, **options):
    async def go():
        initiator = TcpInitiator(**options)
        try:
            await initiator.transfer(opcode, local, target, address)
            return initiator.connections_opened
        finally:
            await initiator.close()
    return loop.run(go())


def test_initiator_write_and_read_against_a_peer(loop, region):
    received = {}

    def behaviour(conn, size, address, opcode):
        if opcode == 0x81:
            received[address] = recv_exactly(conn, size)
            conn.sendall(OK)
        else:
            conn.sendall(OK + pattern(size, 4))
    peer = FakePeer(behaviour)
    region.write(0, pattern(70_000, 5))
    run_initiator(loop, WRITE, region.view(0, 70_000), peer.target())
    assert received == {0x1000: pattern(70_000, 5)}
    run_initiator(loop, READ, region.view(100, 70_000), peer.target())
    assert region.read(100, 70_000) == pattern(70_000, 4)
    peer.close()


@pytest.mark.parametrize("answer, error", [
    (REFUSED, TransferFailed),
    (b"\x00" * 8, TransferFailed),  # not a status frame
    (OK + b"\x01" * 1000, TransferFailed),  # READ data cut short by a disconnect
])
def test_initiator_read_fails_on_a_bad_answer(loop, region, answer, error):
    peer = FakePeer(answer_then_close(answer))
    with pytest.raises(error) as raised:
        run_initiator(loop, READ, region.view(0, 4096), peer.target())
    assert not isinstance(raised.value, TransferTimeout)
    assert region.read(0, 4096)[1000:] == bytes(3096)
    peer.close()


def test_initiator_write_fails_when_the_peer_disconnects_mid_transfer(loop):
    region = GuardedMemory(32 << 20)

    def behaviour(conn, size, address, opcode):
        recv_exactly(conn, 1000)
        return False  # closes with most of the payload unread
    peer = FakePeer(behaviour)
    with pytest.raises(TransferFailed):
        run_initiator(loop, WRITE, region.view(0, 32 << 20), peer.target())
    peer.close()


def test_initiator_reports_a_refused_write_while_still_sending(loop):
    region = GuardedMemory(32 << 20)
    peer = FakePeer(answer_then_close(REFUSED))  # refuses on the header, payload unread
    with pytest.raises(TransferFailed, match="refused"):
        run_initiator(loop, WRITE, region.view(0, 32 << 20), peer.target())
    peer.close()


def test_initiator_times_out_on_a_silent_peer(loop, region):
    hold = threading.Event()
    peer = FakePeer(lambda conn, size, address, opcode: hold.wait(30))
    with pytest.raises(TransferTimeout):
        run_initiator(loop, READ, region.view(0, 16), peer.target(), request_timeout_ms=200)
    hold.set()
    peer.close()


def test_initiator_connect_refused(loop, region):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(TransferFailed, match="cannot connect"):
        run_initiator(loop, READ, region.view(0, 16), TransferTarget("127.0.0.1", port, 2))


def test_initiator_retries_once_when_a_reused_connection_was_closed(loop, region):
    # The peer answers one request per connection, then closes it.
    peer = FakePeer(answer_then_close(lambda size: OK + b"z" * size))

    async def two_reads():
        initiator = TcpInitiator()
        try:
            for offset in (0, 100):
                await initiator.transfer(READ, region.view(offset, 10), peer.target(), 0x1000)
            return initiator.connections_opened
        finally:
            await initiator.close()
    assert loop.run(two_reads()) == 2
    assert region.read(0, 10) == region.read(100, 10) == b"z" * 10
    peer.close()


def test_initiator_bounds_requests_in_flight(loop, region):
    def behaviour(conn, size, address, opcode):
        conn.sendall(OK + b"q" * size)
    peer = FakePeer(behaviour)

    async def many_reads():
        initiator = TcpInitiator(max_in_flight_requests=2, connections_per_peer=8)
        try:
            await asyncio.gather(*[
                initiator.transfer(READ, region.view(i * 64, 64), peer.target(), 0x1000)
                for i in range(40)])
            return initiator.connections_opened
        finally:
            await initiator.close()
    opened = loop.run(many_reads())
    assert peer.most_active <= 2 and opened <= 2
    assert region.read(0, 40 * 64) == b"q" * (40 * 64)
    peer.close()


# -- the endpoint: local checks before anything is sent ---------------------------------------

def test_endpoint_checks_ranges_and_segment_names(loop, region):
    async def go():
        a, b = TransferEndpoint(), TransferEndpoint()
        await a.start()
        await b.start()
        other = GuardedMemory(4096)
        await a.register_memory(region.address, region.length)
        await b.register_memory(other.address, other.length)
        region.write(0, b"x" * 4096)
        requests = [
            TransferRequest(WRITE, region.address, b.name, other.address, 4096),  # good
            TransferRequest(WRITE, region.address - 1, b.name, other.address, 16),  # local out
            TransferRequest(WRITE, region.address, b.name, other.address + 1, 4096),  # remote out
            TransferRequest(READ, region.address, "no-port", other.address, 16),
            TransferRequest(READ, region.address, "127.0.0.1:1", other.address, 16),
            TransferRequest(7, region.address, b.name, other.address, 16),
        ]
        statuses = await a.transfer(requests)
        await a.close()
        await b.close()
        return [s.state for s in statuses], other
    states, other = loop.run(go())
    assert states == [TransferState.COMPLETED, TransferState.INVALID, TransferState.INVALID,
                      TransferState.FAILED, TransferState.FAILED, TransferState.INVALID]
    assert other.read(0, 4096) == b"x" * 4096 and other.guards_intact()


def test_endpoint_refetches_a_stale_descriptor(loop, region):
    async def go():
        a, b = TransferEndpoint(), TransferEndpoint()
        await a.start()
        await b.start()
        first, second = GuardedMemory(4096), GuardedMemory(4096)
        await a.register_memory(region.address, region.length)
        await b.register_memory(first.address, first.length)
        await a.open_segment(b.name)  # cached with `first` only
        await b.register_memory(second.address, second.length)
        region.write(0, b"y" * 100)
        statuses = await a.transfer([TransferRequest(WRITE, region.address, b.name,
                                                     second.address, 100)])
        await a.close()
        await b.close()
        return statuses[0].state, second.read(0, 100)
    assert loop.run(go()) == (TransferState.COMPLETED, b"y" * 100)


# -- handshake frames -------------------------------------------------------------------------

class Handshake:
    def __init__(self, loop: LoopThread, **options) -> None:
        self.loop = loop
        self.notifies = []
        self.server = handshake.HandshakeServer(lambda peer: {"name": "me", "peer": peer},
                                                self.notifies.append, **options)
        self.port = loop.run(self.server.start("127.0.0.1", 0))

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def close(self) -> None:
        self.loop.run(self.server.close())


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    (length,) = struct.unpack("<Q", recv_exactly(sock, 8))
    body = recv_exactly(sock, length)
    return body[0], body[1:]


def test_handshake_answers_like_mooncake_on_one_connection(loop):
    server = Handshake(loop)
    with server.connect() as sock:
        sock.sendall(handshake.encode_frame(handshake.PROBE, {}))
        assert read_reply(sock) == (3, b'{"status":"success"}\n')
        sock.sendall(handshake.encode_frame(handshake.NOTIFY, {"name": "p", "notify_msg": "m"}))
        assert read_reply(sock) == (2, b'{"name":"","notify_msg":"success"}\n')
        sock.sendall(handshake.encode_frame(handshake.METADATA, {"name": "peer"}))
        kind, body = read_reply(sock)
        assert kind == 1 and json.loads(body) == {"name": "me", "peer": {"name": "peer"}}
        sock.sendall(handshake.encode_frame(handshake.CONNECTION, {"qp_num": [1]}))
        kind, body = read_reply(sock)
        assert kind == 0 and json.loads(body)["qp_num"] == []
    assert [(n.name, n.message) for n in server.notifies] == [("p", "m")]
    server.close()


@pytest.mark.parametrize("frame", [
    struct.pack("<Q", 0),  # empty
    struct.pack("<Q", 2 << 20) + b"\x03{}",  # over the limit
    struct.pack("<Q", 3) + b"\x09{}",  # unknown type
    struct.pack("<Q", 4) + b"\x03{]}",  # not JSON
    struct.pack("<Q", 3) + b"\x03[]",  # not an object
    struct.pack("<Q", 100) + b"\x03{}",  # cut short (then the client shuts down)
    struct.pack("<Q", 30) + b'\x02{"name":1,"notify_msg":"m"}\n',  # wrong field type
])
def test_handshake_bad_frames_close_the_connection(loop, frame):
    server = Handshake(loop, max_frame_bytes=1 << 20)
    with server.connect() as sock:
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock)
    with server.connect() as sock:  # still serving
        sock.sendall(handshake.encode_frame(handshake.PROBE, {}))
        assert read_reply(sock)[0] == 3
    assert server.notifies == []
    server.close()


def test_handshake_client_rejects_bad_replies(loop):
    def serve(reply: bytes) -> int:
        listener = socket.create_server(("127.0.0.1", 0))

        def one():
            conn, _ = listener.accept()
            with conn:
                (length,) = struct.unpack("<Q", recv_exactly(conn, 8))
                recv_exactly(conn, length)
                conn.sendall(reply)
            listener.close()
        threading.Thread(target=one, daemon=True).start()
        return listener.getsockname()[1]

    for reply, message in [(handshake.encode_frame(handshake.NOTIFY, {}), "answered"),
                           (struct.pack("<Q", 1 << 30), "over"),
                           (b"", "without a reply")]:
        port = serve(reply)
        with pytest.raises(handshake.HandshakeError, match=message):
            loop.run(handshake.exchange("127.0.0.1", port, handshake.PROBE, {}))


# -- descriptors and registered memory --------------------------------------------------------

def test_registered_memory_refuses_overlaps_and_straddling_views():
    memory = RegisteredMemory()
    block = GuardedMemory(3 * 4096)
    memory.register(block.address, 4096)
    memory.register(block.address + 4096, 4096)
    for address, length in [(block.address + 100, 10), (block.address - 10, 20),
                            (block.address + 8000, 400)]:
        with pytest.raises(ValueError, match="overlaps"):
            memory.register(address, length)
    with pytest.raises(ValueError):
        memory.register(block.address + 8192, 0)
    assert memory.view(block.address + 4000, 192) is None
    assert memory.view(block.address + 8192, 1) is None
    assert memory.view(block.address - 1, 1) is None
    assert len(memory.view(block.address + 4096, 4096)) == 4096
    memory.unregister(block.address)
    assert memory.view(block.address, 1) is None
    with pytest.raises(KeyError):
        memory.unregister(block.address)


def test_descriptor_round_trip_and_errors():
    value = {"buffers": [{"addr": 4096, "length": 100, "name": "cpu:0"}], "name": "h:1",
             "protocol": "tcp", "rdma_server_name": "", "tcp_data_host": "h",
             "tcp_data_port": 7, "tcp_proto_version": 2, "timestamp": "t"}
    descriptor = SegmentDescriptor.from_json(value)
    assert descriptor.to_json() == value
    assert descriptor.find_buffer(4096, 100) and not descriptor.find_buffer(4097, 100)
    # An older descriptor without tcp_data_host or tcp_proto_version: the segment's host, v1.
    older = dict(value)
    del older["tcp_data_host"], older["tcp_proto_version"]
    parsed = SegmentDescriptor.from_json(older, default_host="10.0.0.1")
    assert (parsed.tcp_data_host, parsed.tcp_proto_version) == ("10.0.0.1", 1)
    for broken in [[], {"protocol": "tcp"}, dict(value, tcp_data_port=0),
                   dict(value, tcp_data_port="7"), dict(value, buffers={}),
                   dict(value, buffers=[{"addr": -1, "length": 1}]),
                   dict(value, buffers=[{"addr": True, "length": 1}])]:
        with pytest.raises(DescriptorError):
            SegmentDescriptor.from_json(broken)


# -- golden vectors (wire/vectors/mooncake_te.json) --------------------------------------------

def test_golden_vectors():
    import os
    from conftest import REPO
    with open(os.path.join(REPO, "wire", "vectors", "mooncake_te.json")) as f:
        vectors = json.load(f)
    opcodes = {"READ": READ, "WRITE": WRITE}
    for v in vectors["data_headers"]:
        frame = bytes.fromhex(v["hex"])
        assert encode_header(opcodes[v["opcode"]], v["address"], v["size"], v["version"]) == frame
        size, address, opcode = struct.unpack("<QQB7x", frame)
        assert (size, address, opcode & 0x7F, 2 if opcode & 0x80 else 1) == \
            (v["size"], v["address"], opcodes[v["opcode"]], v["version"])
    for v in vectors["status_frames"]:
        assert encode_status(v["code"]).hex() == v["hex"]
        assert decode_status(bytes.fromhex(v["hex"])) == v["code"]
    for v in vectors["handshake_frames"]:
        frame = bytes.fromhex(v["hex"])
        assert handshake.encode_frame(v["type"], v["json"]) == frame
        (length,) = struct.unpack("<Q", frame[:8])
        assert length == len(frame) - 8 and frame[8] == v["type"]
        assert json.loads(frame[9:]) == v["json"]


# -- the HTTP metadata client -----------------------------------------------------------------

class FakeMetadataServer:
    """A threaded HTTP server: `answers` maps a method to (status, headers, body)."""

    def __init__(self, answers: dict) -> None:
        import http.server

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                seen.append((self.command, self.path, self.rfile.read(length)))
                status, headers, body = answers[self.command]
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_PUT = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metadata"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_http_metadata_client(loop):
    from mooncaked.transfer.metadata import HttpMetadata, MetadataError
    value = {"name": "n", "x": 1}
    body = json.dumps(value).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:5], body[5:], b""))
    cases = [
        ({"GET": (200, {"Content-Length": str(len(body))}, body)}, value),
        ({"GET": (200, {"Transfer-Encoding": "chunked"}, chunked)}, value),
        ({"GET": (404, {"Content-Length": "9"}, b"not found")}, None),
        ({"GET": (500, {"Content-Length": "4"}, b"oops")}, MetadataError),
        ({"GET": (200, {"Content-Length": "3"}, b"{]}")}, MetadataError),
        ({"GET": (200, {"Content-Length": "2"}, b"[]")}, MetadataError),
        ({"GET": (200, {"Content-Length": str(2 << 20)}, b"")}, MetadataError),  # over the bound
    ]
    for answers, expected in cases:
        server = FakeMetadataServer(answers)
        store = HttpMetadata(server.url, max_response_bytes=1 << 20)
        if expected is MetadataError:
            with pytest.raises(MetadataError):
                loop.run(store.get("mooncake/ram/a b/c"))
        else:
            assert loop.run(store.get("mooncake/ram/a b/c")) == expected
        # The key travels URL-encoded in the query.
        assert server.seen[0][:2] == ("GET", "/metadata?key=mooncake%2Fram%2Fa%20b%2Fc")
        server.close()

    server = FakeMetadataServer({"PUT": (200, {"Content-Length": "0"}, b""),
                                 "DELETE": (404, {"Content-Length": "0"}, b"")})
    store = HttpMetadata(server.url)
    loop.run(store.put("k", value))
    loop.run(store.delete("k"))  # an absent key is already withdrawn
    assert server.seen == [("PUT", "/metadata?key=k", body), ("DELETE", "/metadata?key=k", b"")]
    server.close()

    listener = socket.create_server(("127.0.0.1", 0))
    closed_port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(MetadataError):
        loop.run(HttpMetadata(f"http://127.0.0.1:{closed_port}/m").get("k"))
    with pytest.raises(ValueError):
        HttpMetadata("https://example.invalid/metadata")


def test_http_mode_endpoints_find_each_other(loop, region):
    """Two endpoints through one metadata store (a dict behind a fake server)."""
    import http.server
    store = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            key = self.path.split("key=", 1)[1]
            self._reply(200, store[key]) if key in store else self._reply(404, b"")

        def do_PUT(self):
            store[self.path.split("key=", 1)[1]] = self.rfile.read(
                int(self.headers["Content-Length"]))
            self._reply(200, b"")

        def do_DELETE(self):
            store.pop(self.path.split("key=", 1)[1], None)
            self._reply(200, b"")

        def _reply(self, status, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metadata"

    async def go():
        a = TransferEndpoint(metadata_server=url, segment_name="node-a")
        b = TransferEndpoint(metadata_server=url, segment_name="node-b")
        await a.start()
        await b.start()
        other = GuardedMemory(4096)
        await a.register_memory(region.address, region.length)
        await b.register_memory(other.address, other.length)
        region.write(0, b"m" * 4096)
        states = [s.state for s in await a.transfer([
            TransferRequest(WRITE, region.address, "node-b", other.address, 4096),
            TransferRequest(WRITE, region.address, "node-c", other.address, 16)])]
        await a.send_notify("node-b", "node-a", "sent")
        notifies = [(n.name, n.message) for n in b.take_notifies()]
        await a.close()
        await b.close()
        return states, notifies, other
    states, notifies, other = loop.run(go())
    assert states == [TransferState.COMPLETED, TransferState.FAILED]
    assert notifies == [("node-a", "sent")]
    assert other.read(0, 4096) == b"m" * 4096
    assert store == {}  # both withdrew their keys
    server.shutdown()
    server.server_close()


def test_handshake_connections_over_the_bound_are_closed(loop):
    server = Handshake(loop, max_connections=1)
    with server.connect() as first:
        first.sendall(handshake.encode_frame(handshake.PROBE, {}))
        assert read_reply(first)[0] == 3  # the first is being served
        with server.connect() as second:
            assert closed_by_peer(second)
    server.close()


def test_endpoint_bound_to_every_interface(loop, region):
    async def go():
        a = TransferEndpoint("127.0.0.1", bind_host="0.0.0.0")
        b = TransferEndpoint("127.0.0.1", bind_host="0.0.0.0")
        await a.start()
        await b.start()
        other = GuardedMemory(4096)
        await a.register_memory(region.address, region.length)
        await b.register_memory(other.address, other.length)
        other.write(0, b"r" * 4096)
        statuses = await a.transfer([TransferRequest(READ, region.address, b.name,
                                                     other.address, 4096)])
        await a.close()
        await b.close()
        return b.name, statuses[0].state
    name, state = loop.run(go())
    assert name.startswith("127.0.0.1:") and state == TransferState.COMPLETED
    assert region.read(0, 4096) == b"r" * 4096
