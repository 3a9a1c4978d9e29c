"""Helpers shared by the event-loop tests (fixtures live in conftest.py and test modules)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from mooncaked.io import uring

TIMEOUT_S = 60.0  # only so a broken loop fails the test instead of hanging the suite


def run(loop, coro, timeout: float = TIMEOUT_S):
    """Run coro to completion on loop; a hang becomes a TimeoutError, not a stuck suite."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def is_uring(loop) -> bool:
    return isinstance(loop, uring.UringEventLoop)


# -- protocols for the transport tests -----------------------------------------------------

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


def recording(protocols: list, factory: Callable[[], Any]) -> Callable[[], Any]:
    """A protocol factory that makes protocols with `factory` and keeps each in `protocols`."""

    def make():
        protocols.append(factory())
        return protocols[-1]

    return make


# -- servers and connections for the transport tests ---------------------------------------

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


@dataclass
class Served:
    """A listening server; `protocols` holds the server side's protocol of each connection."""

    server: Any
    connect: Callable[[Callable[[], Any]], Awaitable[tuple]]
    protocols: list = field(default_factory=list)


@contextlib.asynccontextmanager
async def serving(loop, kind, unix_dir, server_protocol, *, wait_closed=False, **kwargs):
    """`async with serving(...) as served`: a server of `kind` whose connections get protocols
    from `server_protocol` (kept in `served.protocols`); closed when the block is left, and
    awaited closed too with `wait_closed` (only when the block succeeded). kwargs go to
    create_server / create_unix_server."""
    protocols: list = []
    server, connect = await serve(loop, kind, recording(protocols, server_protocol), unix_dir,
                                  **kwargs)
    try:
        yield Served(server, connect, protocols)
    finally:
        server.close()
    if wait_closed:
        await server.wait_closed()


@dataclass
class Connection:
    """One connection to a test server: our end (`transport`, `client`) and its `peer`."""

    server: Any
    transport: Any
    client: Any
    peer: Any


@contextlib.asynccontextmanager
async def connected(loop, kind, unix_dir, server_protocol, client_protocol=Recorder, *,
                    wait_closed=False):
    """`async with connected(...) as c`: a server of `kind` (as `serving` makes it), one
    connection to it with a `client_protocol`, and that connection accepted (`c.peer` is
    the server side's protocol). The server is closed when the block is left."""
    async with serving(loop, kind, unix_dir, server_protocol,
                       wait_closed=wait_closed) as served:
        transport, client = await served.connect(client_protocol)
        peer = await accepted(served.protocols)
        yield Connection(served.server, transport, client, peer)
