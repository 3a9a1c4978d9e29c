"""Stream transports on both loops: TCP and Unix, Protocol and BufferedProtocol.

Echo, connection loss (the peer closes; abort), EOF and half-close, write back-pressure,
64 MiB through each transport (checked by hash), 200 connections at once, asyncio streams
on top, and the extra info a transport gives. Loopback only (127.0.0.1, a temp directory).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import tempfile

import pytest

from .support import is_uring, run

MIB = 1 << 20


@pytest.fixture(params=["tcp", "unix"])
def kind(request):
    return request.param


@pytest.fixture
def unix_dir():
    with tempfile.TemporaryDirectory(prefix="mooncaked-loop-") as path:
        yield path


async def serve(loop, kind, factory, unix_dir, **kwargs):
    """A server of `kind`, and a coroutine function that opens a connection to it."""
    if kind == "tcp":
        server = await loop.create_server(factory, "127.0.0.1", 0, **kwargs)
        port = server.sockets[0].getsockname()[1]

        async def connect(client_factory):
            return await loop.create_connection(client_factory, "127.0.0.1", port)
    else:
        path = os.path.join(unix_dir, "loop.sock")
        server = await loop.create_unix_server(factory, path, **kwargs)

        async def connect(client_factory):
            return await loop.create_unix_connection(client_factory, path)
    return server, connect


class Recorder(asyncio.Protocol):
    """Records what happens to it; `done` resolves on connection_lost."""

    def __init__(self, echo: bool = False, keep_open_on_eof: bool = False) -> None:
        self.echo = echo
        self.keep_open_on_eof = keep_open_on_eof
        self.events: list = []
        self.data = bytearray()
        self.transport = None
        self.done = asyncio.get_running_loop().create_future()
        self.got_data = asyncio.Event()

    def connection_made(self, transport):
        self.transport = transport
        self.events.append("made")

    def data_received(self, data):
        assert type(data) is bytes
        self.data += data
        self.got_data.set()
        if self.echo:
            self.transport.write(data)

    def eof_received(self):
        self.events.append("eof")
        return self.keep_open_on_eof

    def connection_lost(self, exc):
        self.events.append(("lost", exc))
        if not self.done.done():
            self.done.set_result(exc)


class BufferedEcho(asyncio.BufferedProtocol):
    """Receives into its own small buffer (one message spans many reads) and echoes."""

    def __init__(self, buffer_size: int) -> None:
        self.buffer = bytearray(buffer_size)
        self.sizes: list[int] = []
        self.received = 0
        self.transport = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes):
        self.sizes.append(nbytes)
        self.received += nbytes
        self.transport.write(bytes(self.buffer[:nbytes]))

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


async def accepted(protocols: list):
    """The server side's protocol of the first connection, once it has been accepted."""
    while not protocols:
        await asyncio.sleep(0.001)
    return protocols[0]


async def read_exactly(protocol: Recorder, size: int) -> bytes:
    while len(protocol.data) < size:
        protocol.got_data.clear()
        await protocol.got_data.wait()
    return bytes(protocol.data[:size])


# -- echo ----------------------------------------------------------------------------------

def test_echo_with_protocol(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder(echo=True))
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        for i in range(20):
            transport.write(b"message %d;" % i)
        expected = b"".join(b"message %d;" % i for i in range(20))
        assert await read_exactly(client, len(expected)) == expected
        transport.writelines([b"a", bytearray(b"b"), memoryview(b"cd")])
        assert await read_exactly(client, len(expected) + 4) == expected + b"abcd"
        transport.close()
        assert await client.done is None
        assert await servers[0].done is None
        assert servers[0].events == ["made", "eof", ("lost", None)]
        server.close()
        await server.wait_closed()

    run(loop, main())


def test_echo_with_buffered_protocol_small_buffers(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(
            loop, kind, lambda: servers.append(BufferedEcho(7)) or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        message = os.urandom(10_000)
        transport.write(message)
        assert await read_exactly(client, len(message)) == message
        assert servers[0].received == len(message)
        assert max(servers[0].sizes) <= 7 and len(servers[0].sizes) >= len(message) // 7
        transport.close()
        assert await servers[0].lost is None
        server.close()

    run(loop, main())


def test_buffered_protocol_client(loop, kind, unix_dir):
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
        server, connect = await serve(loop, kind, lambda: Recorder(echo=True), unix_dir)
        transport, client = await connect(Collect)
        payload = os.urandom(50_000)
        transport.write(payload)
        await client.enough
        assert bytes(client.buffer[:50_000]) == payload
        transport.close()
        server.close()

    run(loop, main())


# -- connection loss and EOF ---------------------------------------------------------------

def test_peer_close_gives_eof_then_connection_lost(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        transport.write(b"last words")
        transport.close()
        assert transport.is_closing()
        assert await servers[0].done is None
        assert bytes(servers[0].data) == b"last words"
        assert servers[0].events == ["made", "eof", ("lost", None)]
        assert await client.done is None
        server.close()

    run(loop, main())


def test_abort_drops_queued_data_and_reports_loss(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        transport.write(b"x")
        await read_exactly(await accepted(servers), 1)
        servers[0].transport.abort()
        assert servers[0].transport.is_closing()
        assert await servers[0].done is None
        assert servers[0].events == ["made", ("lost", None)]
        lost = await client.done  # the peer sees the socket go: EOF, or a reset
        assert lost is None or isinstance(lost, ConnectionResetError)
        server.close()

    run(loop, main())


def test_abort_with_unsent_data(loop, kind, unix_dir):
    class Stubborn(asyncio.Protocol):
        """Never reads, so the server's writes pile up."""

        def connection_made(self, transport):
            transport.pause_reading()

    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, _ = await connect(Stubborn)
        await accepted(servers)
        big = b"z" * (8 * MIB)
        for _ in range(8):
            servers[0].transport.write(big)
        assert servers[0].transport.get_write_buffer_size() > 0
        servers[0].transport.abort()
        assert await servers[0].done is None
        transport.close()
        server.close()

    run(loop, main())


def test_write_eof_and_half_close(loop, kind, unix_dir):
    class Answer(Recorder):
        def eof_received(self):
            super().eof_received()
            self.transport.write(b"answer to " + bytes(self.data))
            self.transport.close()
            return True  # keep our side open to write the answer

    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Answer())
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        assert transport.can_write_eof()
        transport.write(b"question")
        transport.write_eof()
        with pytest.raises(RuntimeError):
            transport.write(b"more")
        assert await client.done is None
        assert bytes(client.data) == b"answer to question"
        assert client.events == ["made", "eof", ("lost", None)]
        assert servers[0].events == ["made", "eof", ("lost", None)]
        server.close()

    run(loop, main())


def test_protocol_exception_closes_the_transport(loop, kind, unix_dir):
    class Faulty(Recorder):
        def data_received(self, data):
            raise ValueError("bad protocol")

    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Faulty())
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        transport.write(b"trigger")
        await servers[0].done
        assert await client.done is None  # the server closed: we see EOF
        server.close()

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

def test_back_pressure_pauses_and_resumes_writing(loop, kind, unix_dir):
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
        producers = []
        server, connect = await serve(loop, kind, lambda: producers.append(Producer())
                                      or producers[-1], unix_dir)
        transport, reader = await connect(SlowReader)
        producer = await accepted(producers)
        assert producer.transport.get_write_buffer_limits() == (16 * 1024, 64 * 1024)
        written = 0
        # A producer that honours pause_writing, facing a peer that does not read: once the
        # socket buffers are full, it stays paused and our buffer stays bounded.
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
        assert producer.calls == ["pause", "resume"] * (len(producer.calls) // 2) + ["pause"]
        assert 16 * 1024 < producer.transport.get_write_buffer_size() <= 64 * 1024 + len(chunk)
        transport.resume_reading()
        await producer.resumed.wait()
        assert producer.calls[-1] == "resume"
        assert producer.transport.get_write_buffer_size() <= 16 * 1024
        producer.transport.close()
        await reader.done
        assert len(reader.data) == written and reader.data.count(b"c") == written
        server.close()

    run(loop, main())


def test_pause_reading_stops_delivery_until_resumed(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, client = await connect(Recorder)
        await accepted(servers)
        peer = servers[0]
        assert peer.transport.is_reading()
        transport.write(b"first")
        await read_exactly(peer, 5)
        peer.transport.pause_reading()
        assert not peer.transport.is_reading()
        transport.write(b"second")
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert bytes(peer.data) == b"first"
        peer.transport.resume_reading()
        assert await read_exactly(peer, 11) == b"firstsecond"
        transport.close()
        await peer.done
        server.close()

    run(loop, main())


def test_set_write_buffer_limits_checks_its_arguments(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, _ = await connect(Recorder)
        await accepted(servers)
        with pytest.raises(ValueError):
            transport.set_write_buffer_limits(high=1, low=2)
        transport.set_write_buffer_limits(low=100)
        assert transport.get_write_buffer_limits() == (100, 400)
        transport.close()
        server.close()

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
        server, connect = await serve(loop, kind, HashingSink, unix_dir)
        transport, sender = await connect(Sender)
        for piece in blocks:
            await sender.can_write.wait()
            transport.write(piece)
        transport.write_eof()
        await sender.done
        server.close()
        return bytes(sender.data)

    async def download():
        server, connect = await serve(loop, kind, Source, unix_dir)
        transport, sink = await connect(Recorder)
        await sink.done
        server.close()
        return hashlib.sha256(sink.data).digest() + len(sink.data).to_bytes(8, "little")

    answer = run(loop, upload() if direction == "upload" else download())
    assert answer == expected.digest() + total.to_bytes(8, "little")


# -- many connections ----------------------------------------------------------------------

def test_200_concurrent_connections(loop, kind, unix_dir):
    async def main():
        server, connect = await serve(loop, kind, lambda: BufferedEcho(4096), unix_dir,
                                      backlog=512)

        async def one(i):
            transport, client = await connect(Recorder)
            message = b"connection %d " % i * 50
            transport.write(message)
            echoed = await read_exactly(client, len(message))
            transport.close()
            await client.done
            return echoed == message

        results = await asyncio.gather(*(one(i) for i in range(200)))
        server.close()
        await server.wait_closed()
        return results

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


def test_extra_info(loop, kind, unix_dir):
    async def main():
        servers = []
        server, connect = await serve(loop, kind, lambda: servers.append(Recorder())
                                      or servers[-1], unix_dir)
        transport, _ = await connect(Recorder)
        await accepted(servers)
        sock = transport.get_extra_info("socket")
        assert sock.family == (socket.AF_INET if kind == "tcp" else socket.AF_UNIX)
        assert transport.get_extra_info("sockname") == sock.getsockname()
        assert transport.get_extra_info("peername") == sock.getpeername()
        assert transport.get_extra_info("no such thing", "default") == "default"
        if kind == "tcp":
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert transport.get_extra_info("peername") == server.sockets[0].getsockname()
        assert transport.get_protocol() is _
        transport.close()
        server.close()

    run(loop, main())


def test_create_server_from_a_socket_and_reuse_address(loop):
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        servers = []
        server = await loop.create_server(lambda: servers.append(Recorder(echo=True))
                                          or servers[-1], sock=sock)
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
