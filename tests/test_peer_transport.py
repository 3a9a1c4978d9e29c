"""The peer transport's receive paths (mooncaked/cluster/peer_transport.py), on loopback.

A PeerServer and PeerLink in one process, on both event loops (ours and asyncio's): a striped
read lands in one buffer, a write_replica lands in the range its target callback names (or is
refused and dropped without harming the link), and a connection cut mid-payload fails the call.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from mooncaked.cluster.peer_security import PeerSecurity
from mooncaked.cluster.peer_transport import PeerLink, PeerServer, PeerUnreachable
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.io import uring
from mooncaked.proto import framing

MAX_PAYLOAD = 64 << 20
SEGMENT = 8 << 20


@pytest.fixture(params=["uring", "asyncio"])
def loop_factory(request):
    if request.param == "uring":
        ok, reason = uring.usable()
        if not ok:
            pytest.skip(f"io_uring loop not usable here: {reason}")
        return uring.new_event_loop
    return asyncio.new_event_loop


def run(loop_factory, coroutine):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(asyncio.wait_for(coroutine, 60))


class Node:
    """A peer server over one bytearray 'segment', as cluster/service.py serves its own."""

    def __init__(self) -> None:
        self.segment = bytearray(os.urandom(SEGMENT))
        self.view = memoryview(self.segment)
        self.placed = []  # the payloads on_request saw for write_replica
        self.hellos = []
        self.raft = []
        self.server = PeerServer(lambda i, a: self.hellos.append((i, a)), self.raft.append,
                                 self.on_request, MAX_PAYLOAD, self.payload_target)

    def range(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > SEGMENT:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "range outside the segment")
        return self.view[offset:offset + size]

    def payload_target(self, method, params, length):
        return self.range(params[0], length) if method == "write_replica" else None

    async def on_request(self, method, params, payload):
        if method == "write_replica":
            self.placed.append(payload)
            return 0, None
        if method == "read_replica":
            offset, size = params
            return size, [self.range(offset, size)]
        if method == "echo":
            return len(payload or b""), [payload] if payload else None
        if method == "slow":
            await asyncio.sleep(0.5)
            return 0, [self.view[:1 << 20]]
        raise MooncakedError(ErrorCode.UNKNOWN_METHOD, method)

    async def link(self) -> PeerLink:
        port = self.server.port or await self.server.start("127.0.0.1", 0)
        return PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", MAX_PAYLOAD, 5.0)


def test_striped_read_lands_in_one_buffer(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        try:
            size, stripes = 6 << 20, 4
            value = memoryview(bytearray(size))
            piece = -(-size // stripes)
            parts = [value[start:start + piece] for start in range(0, size, piece)]
            offset = 12345
            answers = await asyncio.gather(*(
                link.call("read_replica", [offset + i * piece, len(part)], into=part)
                for i, part in enumerate(parts)))
            for part, (result, payload) in zip(parts, answers):
                assert payload is part and result == len(part)  # received in place
            assert value == node.view[offset:offset + size]
            assert node.hellos == [(7, "127.0.0.1:1")]
            # A payload of another size than `into` comes back on its own: the caller sees it.
            into = memoryview(bytearray(100))
            _, payload = await link.call("read_replica", [0, 50], into=into)
            assert type(payload) is bytearray and payload == node.segment[:50]
            assert link.connects == 1
        finally:
            link.close()
            node.server.close()
    run(loop_factory, main())


def test_write_replica_lands_in_segment_and_refusal_keeps_link(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        try:
            data = os.urandom(3 << 20)
            assert await link.call("write_replica", [4096], [data]) == (0, None)
            assert node.segment[4096:4096 + len(data)] == data
            # on_request got the segment range itself: nothing was copied after receiving.
            (placed,) = node.placed
            assert type(placed) is memoryview and placed.obj is node.segment
            # A range outside the segment is refused before the payload arrives; the payload
            # is dropped and the error answered, and the same connection carries on.
            before = bytes(node.segment)
            with pytest.raises(MooncakedError) as refused:
                await link.call("write_replica", [SEGMENT - 100], [os.urandom(2 << 20)])
            assert refused.value.code == ErrorCode.INVALID_PARAMS
            assert bytes(node.segment) == before and len(node.placed) == 1
            small = b"x" * 100  # joined to its header: the scratch-buffer path
            assert await link.call("write_replica", [0], [small]) == (0, None)
            assert node.segment[:100] == small
            result, payload = await link.call("echo", [], [b"abc" * 50000])
            assert result == 150000 and payload == b"abc" * 50000
            assert link.connects == 1
        finally:
            link.close()
            node.server.close()
    run(loop_factory, main())


def test_late_answer_is_dropped_and_link_keeps_working(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        try:
            into = memoryview(bytearray(1 << 20))
            with pytest.raises(MooncakedError) as late:
                await link.call("slow", [], timeout_s=0.1, into=into)
            assert late.value.code == ErrorCode.RPC_TIMEOUT
            await asyncio.sleep(0.6)  # its 1 MiB answer arrives and is dropped
            value = memoryview(bytearray(1000))
            _, payload = await link.call("read_replica", [5, 1000], into=value)
            assert payload is value and value == node.view[5:1005]
            assert link.connects == 1
        finally:
            link.close()
            node.server.close()
    run(loop_factory, main())


def test_raft_messages_and_large_headers(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        try:
            await link.ensure_connected()
            big = os.urandom(3 << 20)  # in the header, as a Raft snapshot travels: the scratch
            assert link.send_raft(b"small") and link.send_raft(big)  # buffer grows for it
            _, payload = await link.call("echo", [], [b"after"])
            assert payload == b"after"
            assert node.raft == [b"small", big]
        finally:
            link.close()
            node.server.close()
    run(loop_factory, main())


async def _fake_peer(answer: bytes):
    """A peer that reads a request, sends `answer` and hangs up."""
    async def serve(reader, writer):
        prefix = await reader.readexactly(framing.PREFIX_BYTES)
        await reader.readexactly(framing.PREFIX.unpack(prefix)[0])  # peer_hello
        prefix = await reader.readexactly(framing.PREFIX_BYTES)
        header_length, payload_length = framing.PREFIX.unpack(prefix)
        header = framing.unpack_header(await reader.readexactly(header_length), 1 << 20)
        await reader.readexactly(payload_length)
        writer.write(answer.replace(b"MSGID", framing.pack_header(header[1])))
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("cut", ["mid_payload", "payload_too_large"])
def test_connection_cut_fails_the_call(loop_factory, cut):
    async def main():
        if cut == "mid_payload":  # announces 1 MiB, sends 1,000 bytes of it
            size = 1 << 20
            head = framing.response_head(1, size, size)
            answer = head + b"y" * 1000
        else:  # announces more than the link accepts: dropped before anything is allocated
            answer = framing.response_head(1, 0, MAX_PAYLOAD + 1)
        server, port = await _fake_peer(answer)
        link = PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", MAX_PAYLOAD, 5.0)
        try:
            into = memoryview(bytearray(1 << 20))
            with pytest.raises(MooncakedError) as failed:
                await link.call("read_replica", [0, 1 << 20], into=into, timeout_s=10)
            assert failed.value.code == ErrorCode.RPC_FAIL
            # Sent before the connection failed: the peer may have acted on it.
            assert not isinstance(failed.value, PeerUnreachable)
            assert not link.connected
        finally:
            link.close()
            server.close()
    run(loop_factory, main())


def test_a_call_that_times_out_mid_payload_writes_nothing_more_into_its_buffer(loop_factory):
    """The answer's payload is half received when the call times out: the connection is
    dropped, so the rest, sent later, never lands in `into` (a get staging range is reused
    at once after a failed fetch)."""
    async def main():
        size = 1 << 20

        async def serve(reader, writer):
            prefix = await reader.readexactly(framing.PREFIX_BYTES)
            await reader.readexactly(framing.PREFIX.unpack(prefix)[0])  # peer_hello
            prefix = await reader.readexactly(framing.PREFIX_BYTES)
            header_length, payload_length = framing.PREFIX.unpack(prefix)
            await reader.readexactly(header_length + payload_length)
            writer.write(framing.response_head(1, size, size) + b"y" * 1000)
            await writer.drain()
            await asyncio.sleep(0.5)  # the call times out meanwhile
            try:
                writer.write(b"z" * (size - 1000))
                await writer.drain()
            except ConnectionError:
                pass
            writer.close()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", MAX_PAYLOAD, 5.0)
        try:
            into = memoryview(bytearray(size))
            with pytest.raises(MooncakedError) as late:
                await link.call("read_replica", [0, size], into=into, timeout_s=0.2)
            assert late.value.code == ErrorCode.RPC_TIMEOUT
            await asyncio.sleep(0.8)  # the rest of the payload has been sent by now
            assert bytes(into[1000:]) == bytes(size - 1000)
            assert not link.connected
        finally:
            link.close()
            server.close()
    run(loop_factory, main())


def test_a_call_to_an_unreachable_peer_says_nothing_was_sent(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        try:
            assert (await link.call("echo", [], [b"x"], timeout_s=10))[0] == 1
            node.server.close()  # the peer is gone: its connection closes, new ones are refused
            while link.connected:  # until the link has seen its connection close
                await asyncio.sleep(0.01)
            for _ in range(2):
                with pytest.raises(PeerUnreachable) as failed:
                    await link.call("echo", [], [b"x"], timeout_s=10)
                assert failed.value.code == ErrorCode.RPC_FAIL  # the code clients know
                assert "cannot reach node 1" in failed.value.message
        finally:
            link.close()
    run(loop_factory, main())


def test_server_survives_a_write_cut_mid_payload(loop_factory):
    async def main():
        node = Node()
        link = await node.link()
        port = node.server.port
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(framing.request_head(0, "peer_hello", [9, "127.0.0.1:2"]))
            writer.write(framing.request_head(1, "write_replica", [0], 1 << 20) + b"z" * 5000)
            await writer.drain()
            writer.close()
            await asyncio.sleep(0.1)
            assert node.placed == []  # never completed: on_request not called
            data = os.urandom(1 << 20)
            assert await link.call("write_replica", [0], [data]) == (0, None)
            assert node.segment[:1 << 20] == data
        finally:
            link.close()
            node.server.close()
    run(loop_factory, main())


def test_a_large_header_before_peer_hello_closes_the_connection(loop_factory):
    """Before peer_hello only that small request may come: a prefix announcing a large header
    closes the connection instead of making the listener allocate for it (up to 64 MiB per
    connection from anyone who can reach the port)."""
    async def main():
        node = Node()
        port = await node.server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(framing.PREFIX.pack(32 << 20, 0) + b"\x94" * 100)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server
            writer.close()
            protocols = [t.get_protocol() for t in node.server._transports]
            assert all(len(p._scratch) <= 64 * 1024 for p in protocols)
        finally:
            node.server.close()
    run(loop_factory, main())


def test_a_connect_nobody_waits_for_any_more_fails_quietly(loop_factory, caplog):
    """A caller that stops waiting (its own timeout) while the link still connects: when the
    connect then fails, asyncio must not report an exception nobody retrieved."""
    import gc
    import logging
    import socket

    async def main():
        silent = socket.socket()  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        # With a cluster secret the link waits for the peer's challenge, which never comes.
        link = PeerLink(7, "127.0.0.1:1", 1, lambda: f"127.0.0.1:{port}", MAX_PAYLOAD, 0.3,
                        security=PeerSecurity(secret=os.urandom(32)))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(link.ensure_connected(), 0.05)
        await asyncio.sleep(0.6)  # the connect's own timeout passes: it fails
        silent.close()  # the link stays open, as a daemon's links to its peers do
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        run(loop_factory, main())
        gc.collect()  # a failed task nobody looked at is reported when it is freed
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
