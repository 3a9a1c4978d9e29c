"""Stream transports on both loops: TCP and Unix, Protocol and BufferedProtocol.

Echo, connection loss (the peer closes; abort), EOF and half-close, write back-pressure,
64 MiB through each transport (checked by hash), 200 connections at once, asyncio streams
on top, and the extra info a transport gives. Loopback only (127.0.0.1, a temp directory).

Most tests open one connection with the `connected` fixture (support.connected bound to this
test's loop, kind and directory): `async with connected(ServerProtocol, ClientProtocol) as c`
gives the server, our end (`c.transport`, `c.client`) and the accepted side (`c.peer`), and
closes the server when the block is left.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import tempfile

import pytest

from . import support
from .support import BufferedEcho, Recorder, accepted, is_uring, read_exactly, recording, run

MIB = 1 << 20


@pytest.fixture(params=["tcp", "unix"])
def kind(request):
    return request.param


@pytest.fixture
def unix_dir():
    with tempfile.TemporaryDirectory(prefix="mooncaked-loop-") as path:
        yield path


@pytest.fixture
def connected(loop, kind, unix_dir):
    """support.connected for this test's loop, kind and directory.

    Tests that use it still name `kind` after `loop`: that keeps their ids `[tcp-uring]`
    (kind first), as for every other test here.
    """
    return functools.partial(support.connected, loop, kind, unix_dir)


# -- echo ----------------------------------------------------------------------------------

def test_echo_with_protocol(loop, kind, connected):
    async def main():
        async with connected(lambda: Recorder(echo=True), wait_closed=True) as c:
            for i in range(20):
                c.transport.write(b"message %d;" % i)
            expected = b"".join(b"message %d;" % i for i in range(20))
            assert await read_exactly(c.client, len(expected)) == expected
            c.transport.writelines([b"a", bytearray(b"b"), memoryview(b"cd")])
            assert await read_exactly(c.client, len(expected) + 4) == expected + b"abcd"
            c.transport.close()
            assert await c.client.done is None
            assert await c.peer.done is None
            assert c.peer.events == ["made", "eof", ("lost", None)]

    run(loop, main())


def test_echo_with_buffered_protocol_small_buffers(loop, kind, connected):
    async def main():
        async with connected(lambda: BufferedEcho(7)) as c:
            message = os.urandom(10_000)
            c.transport.write(message)
            assert await read_exactly(c.client, len(message)) == message
            assert c.peer.received == len(message)
            assert max(c.peer.sizes) <= 7 and len(c.peer.sizes) >= len(message) // 7
            c.transport.close()
            assert await c.peer.lost is None

    run(loop, main())


def test_buffered_protocol_client(loop, kind, connected):
    class Collect(asyncio.BufferedProtocol):
        def __init__(self):
            self.buffer = bytearray(64 * 1024)
            self.view = memoryview(self.buffer)
            self.filled = 0
            self.enough = asyncio.get_running_loop().create_future()

        def connection_made(self, transport):
            self.transport = transport

        def get_buffer(self, sizehint):
            return self.view[self.filled:self.filled + 1000]

        def buffer_updated(self, nbytes):
            self.filled += nbytes
            if self.filled >= 50_000 and not self.enough.done():
                self.enough.set_result(None)

        def connection_lost(self, exc):
            pass

    async def main():
        async with connected(lambda: Recorder(echo=True), Collect) as c:
            payload = os.urandom(50_000)
            c.transport.write(payload)
            await c.client.enough
            assert bytes(c.client.buffer[:50_000]) == payload
            c.transport.close()

    run(loop, main())


# -- connection loss and EOF ---------------------------------------------------------------

def test_peer_close_gives_eof_then_connection_lost(loop, kind, connected):
    async def main():
        async with connected(Recorder) as c:
            c.transport.write(b"last words")
            c.transport.close()
            assert c.transport.is_closing()
            assert await c.peer.done is None
            assert bytes(c.peer.data) == b"last words"
            assert c.peer.events == ["made", "eof", ("lost", None)]
            assert await c.client.done is None

    run(loop, main())


def test_abort_drops_queued_data_and_reports_loss(loop, kind, connected):
    async def main():
        async with connected(Recorder) as c:
            c.transport.write(b"x")
            await read_exactly(c.peer, 1)
            c.peer.transport.abort()
            assert c.peer.transport.is_closing()
            assert await c.peer.done is None
            assert c.peer.events == ["made", ("lost", None)]
            lost = await c.client.done  # the peer sees the socket go: EOF, or a reset
            assert lost is None or isinstance(lost, ConnectionResetError)

    run(loop, main())


def test_abort_with_unsent_data(loop, kind, connected):
    class Stubborn(asyncio.Protocol):
        """Never reads, so the server's writes pile up."""

        def connection_made(self, transport):
            transport.pause_reading()

    async def main():
        async with connected(Recorder, Stubborn) as c:
            big = b"z" * (8 * MIB)
            for _ in range(8):
                c.peer.transport.write(big)
            assert c.peer.transport.get_write_buffer_size() > 0
            c.peer.transport.abort()
            assert await c.peer.done is None
            c.transport.close()

    run(loop, main())


def test_write_eof_and_half_close(loop, kind, connected):
    class Answer(Recorder):
        def eof_received(self):
            super().eof_received()
            self.transport.write(b"answer to " + bytes(self.data))
            self.transport.close()
            return True  # keep our side open to write the answer

    async def main():
        async with connected(Answer) as c:
            assert c.transport.can_write_eof()
            c.transport.write(b"question")
            c.transport.write_eof()
            with pytest.raises(RuntimeError):
                c.transport.write(b"more")
            assert await c.client.done is None
            assert bytes(c.client.data) == b"answer to question"
            assert c.client.events == ["made", "eof", ("lost", None)]
            assert c.peer.events == ["made", "eof", ("lost", None)]

    run(loop, main())


def test_protocol_exception_closes_the_transport(loop, kind, connected):
    class Faulty(Recorder):
        def data_received(self, data):
            raise ValueError("bad protocol")

    async def main():
        async with connected(Faulty) as c:
            c.transport.write(b"trigger")
            await c.peer.done
            assert await c.client.done is None  # the server closed: we see EOF

    run(loop, main())
    calls, loop.handler_calls = loop.handler_calls, []
    assert len(calls) == 1 and isinstance(calls[0]["exception"], ValueError)
    assert "data_received" in calls[0]["message"]


def test_connect_refused(loop, unix_dir):
    async def main():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]  # bound, not listening
            with pytest.raises(ConnectionRefusedError):
                await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
            await loop.create_unix_connection(asyncio.Protocol,
                                              os.path.join(unix_dir, "nobody.sock"))

    run(loop, main())


# -- flow control --------------------------------------------------------------------------

def test_back_pressure_pauses_and_resumes_writing(loop, kind, connected):
    chunk = b"c" * (256 * 1024)

    class Producer(asyncio.Protocol):
        def __init__(self):
            self.paused = False
            self.resumed = asyncio.Event()
            self.calls = []

        def connection_made(self, transport):
            self.transport = transport
            transport.set_write_buffer_limits(high=64 * 1024)

        def pause_writing(self):
            self.calls.append("pause")
            self.paused = True
            self.resumed.clear()

        def resume_writing(self):
            self.calls.append("resume")
            self.paused = False
            self.resumed.set()

    class SlowReader(Recorder):
        def connection_made(self, transport):
            super().connection_made(transport)
            transport.pause_reading()

    async def main():
        async with connected(Producer, SlowReader) as c:
            producer, reader = c.peer, c.client
            assert producer.transport.get_write_buffer_limits() == (16 * 1024, 64 * 1024)
            written = 0
            # A producer that honours pause_writing, facing a peer that does not read: once
            # the socket buffers are full, it stays paused and our buffer stays bounded.
            while True:
                if producer.paused:
                    try:
                        await asyncio.wait_for(producer.resumed.wait(), 0.05)
                        continue  # a pause the kernel absorbed; the peer still does not read
                    except asyncio.TimeoutError:
                        break
                producer.transport.write(chunk)
                written += len(chunk)
                assert producer.transport.get_write_buffer_size() <= 64 * 1024 + len(chunk)
                await asyncio.sleep(0)
            assert producer.calls[-1] == "pause"
            assert producer.calls == (["pause", "resume"] * (len(producer.calls) // 2)
                                      + ["pause"])
            assert (16 * 1024 < producer.transport.get_write_buffer_size()
                    <= 64 * 1024 + len(chunk))
            c.transport.resume_reading()
            await producer.resumed.wait()
            assert producer.calls[-1] == "resume"
            assert producer.transport.get_write_buffer_size() <= 16 * 1024
            producer.transport.close()
            await reader.done
            assert len(reader.data) == written and reader.data.count(b"c") == written

    run(loop, main())


def test_pause_reading_stops_delivery_until_resumed(loop, kind, connected):
    async def main():
        async with connected(Recorder) as c:
            peer = c.peer
            assert peer.transport.is_reading()
            c.transport.write(b"first")
            await read_exactly(peer, 5)
            peer.transport.pause_reading()
            assert not peer.transport.is_reading()
            c.transport.write(b"second")
            for _ in range(20):
                await asyncio.sleep(0.001)
            assert bytes(peer.data) == b"first"
            peer.transport.resume_reading()
            assert await read_exactly(peer, 11) == b"firstsecond"
            c.transport.close()
            await peer.done

    run(loop, main())


def test_set_write_buffer_limits_checks_its_arguments(loop, kind, connected):
    async def main():
        async with connected(Recorder) as c:
            with pytest.raises(ValueError):
                c.transport.set_write_buffer_limits(high=1, low=2)
            c.transport.set_write_buffer_limits(low=100)
            assert c.transport.get_write_buffer_limits() == (100, 400)
            c.transport.close()

    run(loop, main())


# -- large transfers -----------------------------------------------------------------------

class HashingSink(asyncio.BufferedProtocol):
    """Hashes everything it receives (1 MiB reads) and answers with the digest at EOF."""

    def __init__(self):
        self.buffer = bytearray(MIB)
        self.hash = hashlib.sha256()
        self.count = 0

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return self.buffer

    def buffer_updated(self, nbytes):
        self.hash.update(memoryview(self.buffer)[:nbytes])
        self.count += nbytes

    def eof_received(self):
        self.transport.write(self.hash.digest() + self.count.to_bytes(8, "little"))
        self.transport.close()
        return True


class Sender(Recorder):
    """Writes with back-pressure honoured (it waits while paused)."""

    def __init__(self):
        super().__init__()
        self.can_write = asyncio.Event()
        self.can_write.set()

    def pause_writing(self):
        self.can_write.clear()

    def resume_writing(self):
        self.can_write.set()


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_64_mib_through_the_transport(loop, kind, unix_dir, direction):
    transfer_64_mib(loop, kind, unix_dir, direction)


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_zero_copy_sends_keep_the_data_intact(loop, unix_dir, direction):
    if not is_uring(loop):
        pytest.skip("SEND_ZC is the io_uring loop's")
    from mooncaked import _native
    _native.set_zerocopy_threshold(4096)  # every 1 MiB bytes write goes out as SEND_ZC
    try:
        transfer_64_mib(loop, "tcp", unix_dir, direction)
    finally:
        _native.set_zerocopy_threshold(0)


def transfer_64_mib(loop, kind, unix_dir, direction):
    """64 MiB up to a hashing server, or down from a streaming one; checked by SHA-256."""
    total = 64 * MIB
    block = os.urandom(MIB)
    blocks = [bytes(block[i:] + block[:i]) for i in range(0, 64 * 4096, 4096)]
    expected = hashlib.sha256()
    for piece in blocks:
        expected.update(piece)

    class Source(asyncio.Protocol):
        """Download: streams the blocks to whoever connects, then closes."""

        def connection_made(self, transport):
            self.transport = transport
            self.index = 0
            self.paused = False
            self.pump()

        def pump(self):
            while not self.paused and self.index < len(blocks):
                # bytes and bytearray alternate: both the by-reference and the copy path
                piece = blocks[self.index]
                self.transport.write(piece if self.index % 2 else bytearray(piece))
                self.index += 1
            if self.index == len(blocks):
                # Not close() itself: from inside resume_writing, 3.11's selector transport
                # can call connection_lost twice when close() runs within its write path.
                asyncio.get_running_loop().call_soon(self.transport.close)

        def pause_writing(self):
            self.paused = True

        def resume_writing(self):
            self.paused = False
            self.pump()

    async def upload():
        async with support.connected(loop, kind, unix_dir, HashingSink, Sender) as c:
            for piece in blocks:
                await c.client.can_write.wait()
                c.transport.write(piece)
            c.transport.write_eof()
            await c.client.done
            return bytes(c.client.data)

    async def download():
        async with support.connected(loop, kind, unix_dir, Source) as c:
            await c.client.done
            data = c.client.data
            return hashlib.sha256(data).digest() + len(data).to_bytes(8, "little")

    answer = run(loop, upload() if direction == "upload" else download())
    assert answer == expected.digest() + total.to_bytes(8, "little")


# -- many connections ----------------------------------------------------------------------

def test_200_concurrent_connections(loop, kind, unix_dir):
    async def main():
        async with support.serving(loop, kind, unix_dir, lambda: BufferedEcho(4096),
                                   wait_closed=True, backlog=512) as served:

            async def one(i):
                transport, client = await served.connect(Recorder)
                message = b"connection %d " % i * 50
                transport.write(message)
                echoed = await read_exactly(client, len(message))
                transport.close()
                await client.done
                return echoed == message

            return await asyncio.gather(*(one(i) for i in range(200)))

    assert run(loop, main()) == [True] * 200


# -- streams -------------------------------------------------------------------------------

def test_start_server_and_open_connection(loop, kind, unix_dir):
    async def handle(reader, writer):
        while line := await reader.readline():
            writer.write(line.upper())
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def main():
        if kind == "tcp":
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        else:
            path = os.path.join(unix_dir, "streams.sock")
            server = await asyncio.start_unix_server(handle, path)
            reader, writer = await asyncio.open_unix_connection(path)
        lines = []
        for word in (b"alpha\n", b"beta\n", b"gamma\n"):
            writer.write(word)
            await writer.drain()
            lines.append(await reader.readline())
        writer.write_eof()
        assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()
        async with server:
            pass
        return lines

    assert run(loop, main()) == [b"ALPHA\n", b"BETA\n", b"GAMMA\n"]


def test_server_serve_forever_and_close(loop):
    async def main():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0,
                                            start_serving=False)
        assert not server.is_serving()
        task = asyncio.ensure_future(server.serve_forever())
        await asyncio.sleep(0.01)
        assert server.is_serving()
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await reader.read() == b""
        writer.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not server.is_serving() and server.sockets == ()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(loop, main())


def test_extra_info(loop, kind, connected):
    async def main():
        async with connected(Recorder) as c:
            sock = c.transport.get_extra_info("socket")
            assert sock.family == (socket.AF_INET if kind == "tcp" else socket.AF_UNIX)
            assert c.transport.get_extra_info("sockname") == sock.getsockname()
            assert c.transport.get_extra_info("peername") == sock.getpeername()
            assert c.transport.get_extra_info("no such thing", "default") == "default"
            if kind == "tcp":
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                server_address = c.server.sockets[0].getsockname()
                assert c.transport.get_extra_info("peername") == server_address
            assert c.transport.get_protocol() is c.client
            c.transport.close()

    run(loop, main())


def test_create_server_from_a_socket_and_reuse_address(loop):
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        servers = []
        server = await loop.create_server(recording(servers, lambda: Recorder(echo=True)),
                                          sock=sock)
        port = sock.getsockname()[1]
        transport, client = await loop.create_connection(Recorder, "127.0.0.1", port)
        transport.write(b"hi")
        assert await read_exactly(client, 2) == b"hi"
        transport.close()
        # The accepted socket shares the port (without SO_REUSEADDR): let it go first.
        await (await accepted(servers)).done
        server.close()
        await server.wait_closed()
        again = await loop.create_server(Recorder, "127.0.0.1", port, reuse_address=True)
        again.close()
        with pytest.raises(ValueError):
            await loop.create_server(Recorder, "127.0.0.1", 0, sock=socket.socket())

    run(loop, main())
