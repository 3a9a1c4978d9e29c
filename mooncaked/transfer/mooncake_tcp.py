"""The data plane of Mooncake's TCP transport (wire/PROTOCOL.md, section "Mooncake Transfer
Engine TCP compatibility"): a server that serves READ and WRITE requests against this
process's registered memory, and an initiator that sends them to a peer's tcp_data_port.

A request is a 24-byte header, the padded C struct {u64 size; u64 addr; u8 opcode}: size and
addr little-endian, opcode READ=0 or WRITE=1, ORed with 0x80 for protocol version 2, then 7
zero bytes. A WRITE header is followed by `size` payload bytes; a READ header is answered by
`size` bytes. In version 2 an 8-byte status frame, the little-endian u64 0x4D435456_0000000X
("MCTV", X=0 accepted, X=1 refused), comes before READ data and after the last WRITE byte is in
memory; a refused request gets status 1 and the connection is closed. Version 1 has no status:
a refused request just closes the connection, and a WRITE has no acknowledgement.

Both sides are asyncio protocols (no thread per request) and receive straight into registered
memory: a WRITE's payload is read by the kernel into the destination buffer, a READ's reply
into the initiator's buffer. Memory of another process (process_memory.ProcessRange, a local
client's) goes through a staging buffer of staging_bytes per connection: a WRITE's payload is
received into it and copied into the process a staging buffer at a time; a READ is copied out
of the process a staging buffer at a time and sent.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import struct
from dataclasses import dataclass

from .descriptors import RegisteredMemory
from .process_memory import ProcessMemoryError

log = logging.getLogger("mooncaked.transfer.tcp")

HEADER = struct.Struct("<QQB7x")
STATUS = struct.Struct("<Q")
READ = 0
WRITE = 1
V2_FLAG = 0x80
STATUS_MAGIC = 0x4D435456 << 32
STATUS_OK = 0
STATUS_REJECTED = 1

DEFAULT_SLICE_BYTES = 64 * 1024
DEFAULT_MAX_REQUEST_BYTES = 1 << 40
DEFAULT_RECEIVE_TIMEOUT_MS = 30000
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_CONNECT_TIMEOUT_MS = 5000
DEFAULT_REQUEST_TIMEOUT_MS = 30000
DEFAULT_CONNECTIONS_PER_PEER = 4
DEFAULT_MAX_IN_FLIGHT_REQUESTS = 256
DEFAULT_STAGING_BYTES = 1 << 20


def encode_header(opcode: int, address: int, size: int, version: int) -> bytes:
    return HEADER.pack(size, address, opcode | (V2_FLAG if version >= 2 else 0))


def encode_status(code: int) -> bytes:
    return STATUS.pack(STATUS_MAGIC | code)


def decode_status(frame: bytes) -> int:
    """The status code of an 8-byte status frame; ValueError when it is not one."""
    (value,) = STATUS.unpack(frame)
    if value >> 32 != STATUS_MAGIC >> 32:
        raise ValueError(f"not a status frame: {value:#018x}")
    return value & 0xFFFFFFFF


# -- server -------------------------------------------------------------------------------------

class TcpDataServer:
    """Listens on the data port; every request is checked against `memory` before any byte
    of it is touched."""

    def __init__(self, memory: RegisteredMemory, *, slice_bytes: int = DEFAULT_SLICE_BYTES,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 receive_timeout_ms: int = DEFAULT_RECEIVE_TIMEOUT_MS,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.memory = memory
        self.slice_bytes = slice_bytes
        self.staging_bytes = staging_bytes
        self.max_request_bytes = max_request_bytes
        self.receive_timeout_ms = receive_timeout_ms
        self.max_connections = max_connections
        self.connections: set[_ServerConnection] = set()
        self.rejected_requests = 0
        self.served_requests = {1: 0, 2: 0}  # accepted requests by protocol version
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self.connections):
                connection.abort()
            await self._server.wait_closed()


class _ServerConnection(asyncio.BufferedProtocol):
    def __init__(self, server: TcpDataServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER.size)
        self._header_filled = 0
        self._payload: memoryview | None = None  # a WRITE's destination, while it arrives
        self._payload_filled = 0
        self._version = 2
        self._sending: memoryview | None = None  # a READ's source, while it is sent
        self._sent = 0
        # A WRITE into another process's memory: its range, the bytes copied into it so far,
        # and this connection's staging buffer (allocated on first use).
        self._remote = None
        self._remote_done = 0
        self._staging: memoryview | None = None
        self._writing_paused = False
        self._progress = 0  # bumped on every received byte; the watchdog compares it
        self._watchdog: asyncio.TimerHandle | None = None

    # connection
    def connection_made(self, transport) -> None:
        self._transport = transport
        if len(self._server.connections) >= self._server.max_connections:
            log.warning("data connection refused: %d connections open",
                        len(self._server.connections))
            transport.abort()
            return
        self._server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self._server.connections.discard(self)
        self._payload = self._sending = None
        if self._watchdog is not None:
            self._watchdog.cancel()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # receiving
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return self._payload[self._payload_filled:]
        return memoryview(self._header)[self._header_filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._progress += 1
        if self._payload is not None:
            self._payload_filled += nbytes
            if self._payload_filled == len(self._payload):
                if self._remote is not None:
                    self._flush_staging()
                else:
                    self._write_done()
            return
        self._header_filled += nbytes
        if self._header_filled < HEADER.size:
            self._arm_watchdog()
            return
        self._header_filled = 0
        self._on_header()

    def eof_received(self) -> bool:
        return False  # close; a request cut short is dropped

    def _on_header(self) -> None:
        size, address, opcode = HEADER.unpack(self._header)
        self._version = 2 if opcode & V2_FLAG else 1
        opcode &= ~V2_FLAG
        if opcode not in (READ, WRITE):
            log.warning("data request with opcode %#x: closing the connection", opcode)
            self._transport.abort()
            return
        view = None
        if size <= self._server.max_request_bytes:
            view = self._server.memory.view(address, size)
        if view is None:
            self._server.rejected_requests += 1
            log.warning("%s of %d bytes at %#x refused: %s",
                        "WRITE" if opcode == WRITE else "READ", size, address,
                        "over max_request_bytes" if size > self._server.max_request_bytes
                        else "not inside one registered buffer")
            if self._version >= 2:
                self._transport.write(encode_status(STATUS_REJECTED))
            self._transport.close()  # flushes the status, then closes
            return
        self._server.served_requests[self._version] += 1
        if type(view) is not memoryview:  # another process's memory, through staging
            if opcode == WRITE and size > 0:
                self._remote, self._remote_done = view, 0
                self._payload, self._payload_filled = self._next_staging(), 0
                self._arm_watchdog()
                return
            view = _ProcessSource(view) if opcode == READ else memoryview(b"")
        if opcode == WRITE:
            self._payload, self._payload_filled = view, 0
            if size == 0:
                self._write_done()
            else:
                self._arm_watchdog()
            return
        if self._version >= 2:
            self._transport.write(encode_status(STATUS_OK))
        self._sending, self._sent = view, 0
        self._transport.pause_reading()  # one request at a time, like Mooncake's sessions
        self._send_more()

    def _write_done(self) -> None:
        self._payload = None
        if self._version >= 2:
            self._transport.write(encode_status(STATUS_OK))

    def _next_staging(self) -> memoryview:
        if self._staging is None:
            self._staging = memoryview(bytearray(self._server.staging_bytes))
        return self._staging[:min(len(self._staging), self._remote.length - self._remote_done)]

    def _flush_staging(self) -> None:
        """Copy a full staging buffer into the process; then the next one, or the status."""
        try:
            self._remote.write_from(self._remote_done, self._payload)
        except ProcessMemoryError as e:
            self._server.rejected_requests += 1
            log.warning("WRITE into %s failed: %s", self._remote.pid, e)
            self._remote = self._payload = None
            if self._version >= 2:
                self._transport.write(encode_status(STATUS_REJECTED))
            self._transport.close()
            return
        self._remote_done += len(self._payload)
        if self._remote_done < self._remote.length:
            self._payload, self._payload_filled = self._next_staging(), 0
            return
        self._remote = None
        self._write_done()

    # sending a READ's data, a slice at a time, as flow control allows
    def _send_more(self) -> None:
        view, step = self._sending, self._server.slice_bytes
        if type(view) is _ProcessSource:
            step = self._server.staging_bytes
        while view is not None and self._sent < len(view) and not self._writing_paused:
            try:
                self._transport.write(view[self._sent:self._sent + step])
            except ProcessMemoryError as e:
                log.warning("READ from %s failed: %s", view.range.pid, e)
                self._sending = None
                self._transport.abort()  # the peer sees the data cut short
                return
            self._sent += step
        if view is not None and self._sent >= len(view):
            self._sending = None
            if not self._transport.is_closing():
                self._transport.resume_reading()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._send_more()

    # a request that stops arriving part-way is dropped after receive_timeout_ms
    def _arm_watchdog(self) -> None:
        if self._watchdog is None:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_later(self._server.receive_timeout_ms / 1000,
                                             self._check_progress, self._progress)

    def _check_progress(self, progress_then: int) -> None:
        self._watchdog = None
        mid_request = self._payload is not None or self._header_filled > 0
        if not mid_request or self._transport.is_closing():
            return
        if self._progress == progress_then:
            log.warning("data request stalled for %d ms: closing the connection",
                        self._server.receive_timeout_ms)
            self._transport.abort()
            return
        self._arm_watchdog()


class _ProcessSource:
    """A READ's source in another process: slicing copies the slice out (into a new buffer,
    which the transport may keep until it is sent)."""

    def __init__(self, source) -> None:
        self.range = source

    def __len__(self) -> int:
        return self.range.length

    def __getitem__(self, part: slice) -> bytearray:
        start, stop, _ = part.indices(self.range.length)
        chunk = bytearray(stop - start)
        self.range.read_into(start, chunk)
        return chunk


# -- initiator ----------------------------------------------------------------------------------

class TransferFailed(Exception):
    """The peer refused the request, broke the protocol, or the connection failed."""


class TransferTimeout(TransferFailed):
    pass


class _ClientConnection(asyncio.BufferedProtocol):
    """One data connection to a peer, carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._sinks: collections.deque = collections.deque()  # [view, filled, future]
        self._scratch = bytearray(256)
        self._lent: list | None = None  # the sink whose memory get_buffer last handed out
        self._writable: asyncio.Future | None = None
        self.used = False  # carried a request before (a reused connection)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if exc is not None:
            self._take_queued()
        error = TransferFailed(f"connection lost: {exc}" if exc else "peer closed the connection")
        while self._sinks:
            future = self._sinks.popleft()[2]
            if not future.done():
                future.set_exception(error)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)  # send() sees `closed` and fails

    def _take_queued(self) -> None:
        """A peer that refuses a WRITE answers and closes without reading the payload, so our
        send fails with a reset; its status frame can still be queued on the socket (both
        loops call connection_lost before they close it). Read what is there into the sinks,
        so the caller sees the refusal rather than the reset."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        fd = sock.fileno() if sock is not None else -1
        while fd >= 0 and self._sinks:
            sink = self._sinks[0]
            try:
                got = os.readv(fd, [sink[0][sink[1]:]])
            except OSError:  # nothing queued (EAGAIN), or the reset itself
                return
            if got == 0:
                return
            sink[1] += got
            self._complete_head()

    # A loop may ask for the buffer when it posts a receive, before the request that expects
    # the bytes is sent (the io_uring loop does): bytes that land in the scratch buffer are
    # copied to the sinks in order; bytes that land in the head sink's memory stay there.
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sinks:
            self._lent = self._sinks[0]
            view, filled, _ = self._lent
            return view[filled:]
        self._lent = None
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        lent, self._lent = self._lent, None
        if lent is not None:
            if not self._sinks or self._sinks[0] is not lent:
                self.transport.abort()  # its request was abandoned meanwhile
                return
            lent[1] += nbytes
            self._complete_head()
            return
        data = memoryview(self._scratch)[:nbytes]
        while data:
            if not self._sinks:
                log.warning("peer sent %d bytes nobody asked for: closing the connection",
                            len(data))
                self.transport.abort()
                return
            sink = self._sinks[0]
            view, filled, _ = sink
            take = min(len(data), len(view) - filled)
            view[filled:filled + take] = data[:take]
            sink[1] += take
            data = data[take:]
            self._complete_head()

    def _complete_head(self) -> None:
        sink = self._sinks[0]
        if sink[1] == len(sink[0]):
            self._sinks.popleft()
            if not sink[2].done():
                sink[2].set_result(None)

    def eof_received(self) -> bool:
        return False

    def expect(self, view: memoryview) -> asyncio.Future:
        """A future that completes when `view` has been filled from the socket, in order."""
        future = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_exception(TransferFailed("connection closed"))
        elif len(view) == 0:
            future.set_result(None)
        else:
            self._sinks.append([view, 0, future])
        return future

    async def send(self, data: bytes | memoryview, slice_bytes: int) -> None:
        for at in range(0, len(data), slice_bytes) if len(data) else ():
            if self.closed:
                raise TransferFailed("connection closed while sending")
            self.transport.write(data[at:at + slice_bytes])
            if self._writable is not None:
                await self._writable
        if self.closed:
            raise TransferFailed("connection closed while sending")

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class _PeerConnections:
    """At most `limit` connections to one peer; idle ones are reused."""

    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[_ClientConnection] = []


@dataclass
class TransferTarget:
    host: str
    port: int
    version: int  # 1 or 2: the framing this request uses


class TcpInitiator:
    """Sends READ and WRITE requests from registered local memory to peers' data ports."""

    def __init__(self, *, slice_bytes: int = DEFAULT_SLICE_BYTES,
                 connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
                 request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS,
                 connections_per_peer: int = DEFAULT_CONNECTIONS_PER_PEER,
                 max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS) -> None:
        self.slice_bytes = slice_bytes
        self.connect_timeout_ms = connect_timeout_ms
        self.request_timeout_ms = request_timeout_ms
        self.connections_per_peer = connections_per_peer
        self._in_flight = asyncio.Semaphore(max_in_flight_requests)
        self._peers: dict[tuple[str, int], _PeerConnections] = {}
        self.connections_opened = 0

    async def transfer(self, opcode: int, local: memoryview, target: TransferTarget,
                       remote_address: int) -> None:
        """Move len(local) bytes: WRITE local -> remote, READ remote -> local. Returns when
        done (v2: the peer confirmed it; v1 WRITE: the bytes were handed to the socket).
        Raises TransferFailed or TransferTimeout. The timeout is request_timeout_ms plus one
        nanosecond per byte (1 GB/s), as Mooncake allows."""
        timeout_s = self.request_timeout_ms / 1000 + len(local) / 1e9
        peer = self._peers.setdefault((target.host, target.port),
                                      _PeerConnections(self.connections_per_peer))
        # The peer's slot first: requests queued behind a slow peer take none of the
        # endpoint's in-flight budget from the others.
        async with peer.slots:
            async with self._in_flight:
                # A reused connection the peer has closed meanwhile fails without any reply:
                # retry once on a fresh one (READ and WRITE of the same bytes are idempotent).
                for attempt in range(2):
                    connection = await self._connection(peer, target, fresh=attempt > 0)
                    reused = connection.used
                    connection.used = True
                    try:
                        await asyncio.wait_for(
                            self._request(connection, opcode, local, target, remote_address),
                            timeout_s)
                    except asyncio.TimeoutError:
                        connection.abort()
                        raise TransferTimeout(
                            f"no completion from {target.host}:{target.port} "
                            f"within {timeout_s:.3f} s") from None
                    except _Refused:
                        connection.abort()
                        raise TransferFailed(f"{target.host}:{target.port} refused "
                                             f"[{remote_address:#x}, +{len(local)})") from None
                    except TransferFailed:
                        connection.abort()
                        if reused and attempt == 0:
                            continue
                        raise
                    except BaseException:
                        connection.abort()
                        raise
                    peer.idle.append(connection)
                    return

    async def close(self) -> None:
        """Close the idle connections (requests in flight keep theirs until they end)."""
        for peer in self._peers.values():
            while peer.idle:
                peer.idle.pop().abort()

    async def _connection(self, peer: _PeerConnections, target: TransferTarget,
                          fresh: bool) -> _ClientConnection:
        while peer.idle and not fresh:
            connection = peer.idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_ClientConnection, target.host, target.port),
                self.connect_timeout_ms / 1000)
        except (OSError, asyncio.TimeoutError) as e:
            raise TransferFailed(f"cannot connect to {target.host}:{target.port}: "
                                 f"{e or 'timed out'}") from None
        self.connections_opened += 1
        return connection

    async def _request(self, connection: _ClientConnection, opcode: int, local: memoryview,
                       target: TransferTarget, remote_address: int) -> None:
        header = encode_header(opcode, remote_address, len(local), target.version)
        status = bytearray(STATUS.size)
        status_in = connection.expect(memoryview(status)) if target.version >= 2 else None
        data_in = connection.expect(local) if opcode == READ else None
        try:
            if opcode == WRITE:
                try:
                    await connection.send(header, self.slice_bytes)
                    await connection.send(local, self.slice_bytes)
                except TransferFailed:
                    # A peer that refuses a WRITE answers at once and closes, while the
                    # payload is still being sent: report the refusal, not the close.
                    if status_in is not None and status_in.done() and \
                            status_in.exception() is None:
                        _check_status(status)
                    raise
                if status_in is not None:
                    await status_in
                    _check_status(status)
                return
            await connection.send(header, self.slice_bytes)
            if status_in is not None:
                await status_in
                _check_status(status)
            await data_in
        finally:
            for future in (status_in, data_in):
                if future is None:
                    continue
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # retrieved: a failed request leaves these unawaited


class _Refused(Exception):
    pass


def _check_status(frame: bytearray) -> None:
    try:
        code = decode_status(bytes(frame))
    except ValueError as e:
        raise TransferFailed(str(e)) from None
    if code != STATUS_OK:
        raise _Refused(code)
