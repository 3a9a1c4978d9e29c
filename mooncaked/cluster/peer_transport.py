"""Daemon-to-daemon connections: Raft messages, forwarded requests and replica bytes.

Peers speak the client protocol's framing (wire/PROTOCOL.md section 2): requests
`[0, msgid, method, params]` and responses `[1, msgid, error, result]`, each optionally followed
by a raw payload, and Raft messages as notifications `[2, "raft", [bytes]]`. The first frame on
a connection is a `peer_hello` request naming the sender, so a node learns the address of every
peer that talks to it.

A `PeerLink` is one outbound connection to one peer, opened on first use and reopened after a
failure. Requests on a link are answered in any order (matched by msgid), so slow requests do
not hold up fast ones; Raft messages are dropped, never queued, while the link is down (Raft
retransmits). Each node keeps one control link per peer (Raft, forwarded requests) and
`data_connections` data links (replica bytes), so a large transfer never delays a heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import framing

log = logging.getLogger(__name__)

MAX_PEER_HEADER_BYTES = 64 << 20  # a Raft APPEND batch or a snapshot travels in the header
WRITE_HIGH_WATER_BYTES = 16 << 20  # a link buffering more than this drops Raft messages

# A request handler: (method, params, payload) -> (result, payload buffers or None).
RequestHandler = Callable[[str, list, bytes | None], Awaitable[tuple[Any, list | None]]]


async def read_frame(reader: asyncio.StreamReader, max_payload_bytes: int):
    prefix = await reader.readexactly(framing.PREFIX_BYTES)
    header_length, payload_length = framing.PREFIX.unpack(prefix)
    framing.check_prefix(header_length, payload_length, MAX_PEER_HEADER_BYTES,
                         max_payload_bytes)
    header = framing.unpack_header(await reader.readexactly(header_length),
                                   MAX_PEER_HEADER_BYTES)
    payload = await reader.readexactly(payload_length) if payload_length else None
    return header, payload


def write_frame(writer: asyncio.StreamWriter, head: bytes, payload: list | None) -> None:
    if payload and sum(len(p) for p in payload) <= 64 * 1024:
        writer.write(b"".join((head, *payload)))
        return
    writer.write(head)
    for piece in payload or ():
        writer.write(piece)


class PeerLink:
    """One outbound connection to a peer, reconnected on demand."""

    def __init__(self, own_id: int, own_address: str, peer_id: int,
                 address: Callable[[], str | None], max_payload_bytes: int,
                 connect_timeout_s: float, source_host: str | None = None) -> None:
        self.own_id = own_id
        # Outbound connections leave from the peer listener's address, so a host with several
        # addresses (or a test partitioning loopback addresses) sees each node as one address.
        self.source_host = source_host
        self.own_address = own_address
        self.peer_id = peer_id
        self._address = address  # looked up at each connect: a peer may move
        self._max_payload_bytes = max_payload_bytes
        self._connect_timeout_s = connect_timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Task | None = None
        self._reader_task: asyncio.Task | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._next_msgid = 0
        self._closed = False
        self.connects = 0

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def _connect(self) -> None:
        address = self._address()
        if not address:
            raise MooncakedError(ErrorCode.RPC_FAIL, f"no address known for node {self.peer_id}")
        host, _, port = address.rpartition(":")
        local = (self.source_host, 0) if self.source_host else None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), local_addr=local), self._connect_timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(framing.request_head(0, "peer_hello", [self.own_id, self.own_address]))
        self._writer = writer
        self.connects += 1
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer))

    async def ensure_connected(self) -> None:
        if self.connected:
            return
        if self._closed:
            raise MooncakedError(ErrorCode.RPC_FAIL, "link closed")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        try:
            await asyncio.shield(self._connecting)
        except (OSError, asyncio.TimeoutError) as exc:
            raise MooncakedError(ErrorCode.RPC_FAIL,
                                 f"cannot reach node {self.peer_id}: {exc}") from None

    def _kick(self) -> None:
        """Start connecting in the background (for one-way messages)."""
        if self._closed or (self._connecting is not None and not self._connecting.done()):
            return
        task = asyncio.get_running_loop().create_task(self.ensure_connected())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header, payload = await read_frame(reader, self._max_payload_bytes)
                if header == [framing.NOTIFICATION, "peer_hello_ok", []]:
                    continue
                msgid, error, result = framing.parse_response(header)
                waiter = self._waiting.pop(msgid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result((error, result, payload))
        except (OSError, asyncio.IncompleteReadError, MooncakedError) as exc:
            log.debug("link to node %d closed: %s", self.peer_id, exc)
        finally:
            self._drop(writer)

    def _drop(self, writer) -> None:
        if self._writer is writer:
            self._writer = None
        writer.close()
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(MooncakedError(
                    ErrorCode.RPC_FAIL, f"connection to node {self.peer_id} lost"))

    def send_raft(self, data: bytes) -> bool:
        """Send one encoded Raft message if the link is up; False: dropped (Raft retries)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            self._kick()
            return False
        if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER_BYTES:
            return False
        writer.write(framing.frame_head([framing.NOTIFICATION, "raft", [data]]))
        return True

    async def call(self, method: str, params: list, payload: list | None = None,
                   timeout_s: float = 5.0) -> tuple[Any, bytes | None]:
        """A request to the peer: its result and payload, or the MooncakedError it answered."""
        await self.ensure_connected()
        self._next_msgid = (self._next_msgid + 1) & framing.U32_MAX or 1
        msgid = self._next_msgid
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[msgid] = waiter
        length = sum(len(p) for p in payload) if payload else 0
        write_frame(self._writer, framing.request_head(msgid, method, params, length), payload)
        try:
            error, result, response_payload = await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            self._waiting.pop(msgid, None)
            raise MooncakedError(ErrorCode.RPC_TIMEOUT,
                                 f"node {self.peer_id} did not answer {method} in "
                                 f"{timeout_s:.1f} s") from None
        if error is not None:
            framing.raise_error(error)
        return result, response_payload

    def close(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._drop(self._writer)
        if self._connecting is not None:
            self._connecting.cancel()


class PeerServer:
    """Accepts peer connections: Raft messages go to `on_raft`, requests to `on_request`."""

    def __init__(self, on_hello: Callable[[int, str], None], on_raft: Callable[[bytes], None],
                 on_request: RequestHandler, max_payload_bytes: int) -> None:
        self._on_hello = on_hello
        self._on_raft = on_raft
        self._on_request = on_request
        self._max_payload_bytes = max_payload_bytes
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.paused = False  # tests: a node whose peer traffic is cut

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        try:
            header, _ = await read_frame(reader, 0)
            msgid, method, params = framing.parse_request(header)
            if (method != "peer_hello" or len(params) != 2 or type(params[0]) is not int
                    or type(params[1]) is not str):
                raise MooncakedError(ErrorCode.PROTOCOL_ERROR, "a peer must say peer_hello")
            self._on_hello(params[0], params[1])
            while True:
                header, payload = await read_frame(reader, self._max_payload_bytes)
                if (type(header) is list and len(header) == 3
                        and header[0] == framing.NOTIFICATION and header[1] == "raft"):
                    if type(header[2]) is list and len(header[2]) == 1 \
                            and type(header[2][0]) is bytes:
                        self._on_raft(header[2][0])
                    continue
                msgid, method, params = framing.parse_request(header)
                task = loop.create_task(self._answer(writer, msgid, method, params, payload))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Shutting down. Ending normally: asyncio's stream server reports a cancelled
            # connection task as an error in the log.
            pass
        except MooncakedError as exc:
            log.info("peer connection closed: %s", exc.message)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, writer, msgid: int, method: str, params: list,
                      payload: bytes | None) -> None:
        try:
            result, response_payload = await self._on_request(method, params, payload)
        except MooncakedError as exc:
            head, response_payload = framing.error_head(msgid, exc.code, exc.message), None
        except Exception as exc:
            log.exception("peer request %s failed", method)
            head, response_payload = framing.error_head(
                msgid, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"), None
        else:
            length = sum(len(p) for p in response_payload) if response_payload else 0
            head = framing.response_head(msgid, result, length)
        if not writer.is_closing():
            write_frame(writer, head, response_payload)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
