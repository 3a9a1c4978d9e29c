"""Daemon-to-daemon connections: Raft messages, forwarded requests and replica bytes.

Peers speak the client protocol's framing (wire/PROTOCOL.md section 2): requests
`[0, msgid, method, params]` and responses `[1, msgid, error, result]`, each optionally followed
by a raw payload, and Raft messages as notifications `[2, "raft", [bytes]]`. The first frame on
a connection is a `peer_hello` request naming the sender, so a node learns the address of every
peer that talks to it. With a cluster secret, the accepting side first sends a challenge and
the hello carries a proof of the secret (cluster/peer_security.py); with [tls], every link is
mutual TLS. A connection that fails either is closed before any other frame is read.

A `PeerLink` is one outbound connection to one peer, opened on first use and reopened after a
failure. Requests on a link are answered in any order (matched by msgid), so slow requests do
not hold up fast ones; Raft messages are dropped, never queued, while the link is down (Raft
retransmits). Each node keeps one control link per peer (Raft, forwarded requests) and
`data_connections` data links (replica bytes), so a large transfer never delays a heartbeat.

Replica bytes are copied as little as the sockets allow. Both ends are `BufferedProtocol`s (as
daemon/connection.py): headers go through a small scratch buffer, but a payload is received
straight into its destination:
- a response's payload into the buffer the caller passed (`call(..., into=view)`): a striped
  read fills each stripe's slice of one buffer, nothing is reassembled;
- a request's payload into the buffer `payload_target(method, params, length)` names before it
  arrives (a `write_replica`: the segment range itself); a range it refuses is received into a
  throw-away buffer and the error answered, and the connection carries on.
Large payloads are sent as read-only views (`_frozen`), which our io_uring transport queues by
reference where it copies a writable buffer's unsent part.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from mooncaked import tls
from mooncaked.cluster import peer_security
from mooncaked.cluster.peer_security import PeerSecurity
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import framing
from mooncaked.proto.scratch import ScratchBuffer

log = logging.getLogger(__name__)

MAX_PEER_HEADER_BYTES = 64 << 20  # a Raft APPEND batch or a snapshot travels in the header
MAX_HELLO_HEADER_BYTES = 4096  # before peer_hello, from anyone who can connect: that one frame
WRITE_HIGH_WATER_BYTES = 16 << 20  # a link buffering more than this drops Raft messages
INLINE_PAYLOAD_BYTES = 64 * 1024  # smaller payloads are joined to their header in one write

_HELLO_OK = [framing.NOTIFICATION, "peer_hello_ok", []]

# A request handler: (method, params, payload) -> (result, payload buffers or None).
RequestHandler = Callable[[str, list, Any], Awaitable[tuple[Any, list | None]]]
# Where a request's payload goes: (method, params, length) -> a writable memoryview of exactly
# `length` bytes, or None for a fresh bytearray; a MooncakedError refuses the request.
PayloadTarget = Callable[[str, list, int], memoryview | None]


class PeerUnreachable(MooncakedError):
    """RPC_FAIL before anything of the request was sent (no connection to the peer): the peer
    cannot have acted on it, so the caller may send it again, there or elsewhere."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.RPC_FAIL, message)


def _uninitialized_bytearray_maker():
    try:
        import ctypes
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except (ImportError, AttributeError):  # not CPython
        return bytearray
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    return lambda size: make(None, size)


# bytearray(size) zero-fills (calloc): a 16 MiB read spent ~7% of the reading node's CPU in
# memset, and fresh pages fault in one by one. CPython's PyByteArray_FromStringAndSize(NULL, n)
# allocates without initialising.
_new_uninitialized = _uninitialized_bytearray_maker()


def uninitialized_bytearray(size: int) -> bytearray:
    """A bytearray whose bytes are whatever the allocator left there (old data of this
    process): only for a buffer that is handed on once every byte has been overwritten."""
    return _new_uninitialized(size)


def _frozen(piece):
    """A read-only view of a payload piece, so the transport sends from it without a copy.

    Our io_uring transport copies the unsent part of a writable buffer at write() (the caller
    could change it afterwards) but holds a reference to a read-only one. The pieces sent here
    stay unchanged until the peer has them: a put's value until its call is answered, a
    segment range under the reader's lease.
    """
    if type(piece) is bytes:
        return piece
    view = memoryview(piece)
    return view if view.readonly else view.toreadonly()


def write_frame(transport: asyncio.Transport, head: bytes, payload: list | None) -> None:
    if payload and sum(len(p) for p in payload) <= INLINE_PAYLOAD_BYTES:
        transport.write(b"".join((head, *payload)))
        return
    transport.write(head)
    for piece in payload or ():
        transport.write(_frozen(piece))


class _FrameReceiver(ScratchBuffer, asyncio.BufferedProtocol):
    """Cuts the byte stream into frames; each payload lands in the buffer chosen for it.

    A subclass's `_on_header(header, payload_length)` returns (target, finish): target is a
    writable memoryview of exactly payload_length bytes (None: the payload is dropped), and
    finish() runs once the payload is in (None: nothing to do). Whatever it raises closes the
    connection (`_frame_error`).
    """

    def __init__(self, max_payload_bytes: int) -> None:
        self.transport: asyncio.Transport | None = None
        self._max_payload_bytes = max_payload_bytes
        self._max_header_bytes = MAX_PEER_HEADER_BYTES
        self._init_scratch()  # headers and small frames (64 KiB; grows for a large header)
        self._target: memoryview | None = None  # the current payload's destination
        self._finish: Callable[[], None] | None = None
        self._filled = 0  # bytes of the current payload received
        self._remaining = 0  # bytes of the current payload still to come; 0: between frames
        self._failed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def eof_received(self):
        return False  # close our side too

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._failed:
            return self._discard_view()
        if self._remaining and self._start == self._end:
            # The kernel writes the payload straight into its destination.
            if self._target is None:
                return self._discard_view()[:self._remaining]
            return self._target[self._filled:]
        if self._end == len(self._scratch):
            self._compact()
        return self._scratch_view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed:
            return
        try:
            if self._remaining and self._start == self._end:
                self._filled += nbytes
                self._remaining -= nbytes
                if not self._remaining:
                    self._payload_done()
            else:
                self._end += nbytes
            self._process()
        except MooncakedError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: log it, drop the connection, keep the daemon
            log.exception("peer connection: frame handling failed")
            self._fail(MooncakedError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"))

    def _process(self) -> None:
        prefix = framing.PREFIX
        while not self._failed:
            available = self._end - self._start
            if self._remaining:  # payload bytes that came in with a header
                if not available:
                    break
                count = min(available, self._remaining)
                if self._target is not None:
                    self._target[self._filled:self._filled + count] = \
                        self._scratch_view[self._start:self._start + count]
                self._start += count
                self._filled += count
                self._remaining -= count
                if not self._remaining:
                    self._payload_done()
                continue
            if available < framing.PREFIX_BYTES:
                break
            header_length, payload_length = prefix.unpack_from(self._scratch, self._start)
            # Checked before anything is allocated for the frame.
            framing.check_prefix(header_length, payload_length, self._max_header_bytes,
                                 self._max_payload_bytes)
            frame_head = framing.PREFIX_BYTES + header_length
            if available < frame_head:
                if frame_head > len(self._scratch):
                    self._grow(frame_head)
                break
            header_start = self._start + framing.PREFIX_BYTES
            header = framing.unpack_header(
                self._scratch_view[header_start:header_start + header_length],
                self._max_header_bytes)
            self._start += frame_head
            target, finish = self._on_header(header, payload_length)
            if target is not None and len(target) != payload_length:
                raise MooncakedError(ErrorCode.INTERNAL_ERROR, "payload target of wrong size")
            self._target, self._finish = target, finish
            self._filled, self._remaining = 0, payload_length
            if not payload_length:
                self._payload_done()
        self._reset_if_consumed()

    def _payload_done(self) -> None:
        finish, self._finish, self._target = self._finish, None, None
        if finish is not None:
            finish()

    def _fail(self, exc: MooncakedError) -> None:
        self._failed = True
        self._target = self._finish = None
        self._frame_error(exc)

    def _on_header(self, header, payload_length: int):
        raise NotImplementedError

    def _frame_error(self, exc: MooncakedError) -> None:
        raise NotImplementedError

class _LinkProtocol(_FrameReceiver):
    """The receiving half of one PeerLink connection: responses, matched to waiting calls."""

    def __init__(self, link: "PeerLink") -> None:
        super().__init__(link._max_payload_bytes)
        self.link = link
        # msgid -> (future, into): the calls sent on this connection and not yet answered.
        self.waiting: dict[int, tuple[asyncio.Future, memoryview | None]] = {}
        # With a cluster secret: resolved once the peer has proven it knows the secret.
        self.authenticated: asyncio.Future | None = None
        if link._secret is not None:
            self.authenticated = asyncio.get_running_loop().create_future()
        self._client_nonce = b""
        self._expected_proof = b""

    def connection_lost(self, exc) -> None:
        self._end_handshake(f"node {self.link.peer_id} closed the connection in the peer "
                            "handshake")
        self.link._drop(self, f"connection to node {self.link.peer_id} lost")

    def _frame_error(self, exc: MooncakedError) -> None:
        log.debug("link to node %d: %s", self.link.peer_id, exc.message)
        self._end_handshake(exc.message)
        self.link._drop(self, f"connection to node {self.link.peer_id} failed: {exc.message}")

    def _end_handshake(self, reason: str) -> None:
        if self.authenticated is not None and not self.authenticated.done():
            self.authenticated.set_exception(MooncakedError(ErrorCode.RPC_FAIL, reason))
            self.authenticated.exception()  # seen: _connect may have stopped waiting

    def _on_header(self, header, payload_length: int):
        if header == _HELLO_OK:
            return None, None
        if (self.authenticated is not None and type(header) is list and len(header) == 3
                and header[0] == framing.NOTIFICATION
                and header[1] in ("peer_challenge", "peer_hello_ok")):
            self._handshake_step(header[1], header[2])
            return None, None
        msgid, error, result = framing.parse_response(header)
        entry = self.waiting.get(msgid)
        if entry is None:  # the call timed out or was cancelled: drop its payload
            return None, None
        waiter, into = entry
        if not payload_length:
            self._answer(msgid, waiter, (error, result, None))
            return None, None
        if into is not None and error is None and payload_length == len(into):
            target, payload = into, into
        else:  # no buffer given, or not the expected size: the caller sees what came
            payload = bytearray(payload_length)  # bounded by max_payload_bytes (checked)
            target = memoryview(payload)
        return target, lambda: self._answer(msgid, waiter, (error, result, payload))

    def _answer(self, msgid: int, waiter: asyncio.Future, outcome: tuple) -> None:
        self.waiting.pop(msgid, None)
        if not waiter.done():
            waiter.set_result(outcome)

    def _handshake_step(self, name: str, params) -> None:
        """The connecting side of the secret handshake (cluster/peer_security.py)."""
        link = self.link
        secret = link._secret
        if self.authenticated.done():
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR, f"{name} after the handshake")
        if type(params) is not list or len(params) != 1 or type(params[0]) is not bytes:
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR, f"malformed {name}")
        if name == "peer_challenge" and not self._client_nonce:
            server_nonce = params[0]
            self._client_nonce = peer_security.new_nonce()
            self._expected_proof = peer_security.server_proof(secret, server_nonce,
                                                              self._client_nonce)
            proof = peer_security.client_proof(secret, server_nonce, self._client_nonce,
                                               link.own_id, link.own_address)
            self.transport.write(framing.request_head(
                0, "peer_hello", [link.own_id, link.own_address, self._client_nonce, proof]))
        elif name == "peer_hello_ok" and self._client_nonce:
            if not tls.proofs_equal(params[0], self._expected_proof):
                raise MooncakedError(ErrorCode.PROTOCOL_ERROR,
                                     f"the node at {link._address()} does not know the "
                                     "cluster secret")
            self.authenticated.set_result(None)
        else:
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR, f"{name} out of order")


def _seen(task: asyncio.Task) -> None:
    """Retrieve a background task's outcome, so that asyncio does not report it unhandled."""
    if not task.cancelled():
        task.exception()


class PeerLink:
    """One outbound connection to a peer, reconnected on demand."""

    def __init__(self, own_id: int, own_address: str, peer_id: int,
                 address: Callable[[], str | None], max_payload_bytes: int,
                 connect_timeout_s: float, source_host: str | None = None,
                 security: PeerSecurity | None = None) -> None:
        self.own_id = own_id
        self._security = security
        self._secret = security.secret if security is not None else None
        # Outbound connections leave from the peer listener's address, so a host with several
        # addresses (or a test partitioning loopback addresses) sees each node as one address.
        self.source_host = source_host
        self.own_address = own_address
        self.peer_id = peer_id
        self._address = address  # looked up at each connect: a peer may move
        self._max_payload_bytes = max_payload_bytes
        self._connect_timeout_s = connect_timeout_s
        self._protocol: _LinkProtocol | None = None
        self._connecting: asyncio.Task | None = None
        self._next_msgid = 0
        self._closed = False
        self.connects = 0

    @property
    def connected(self) -> bool:
        protocol = self._protocol
        return protocol is not None and not protocol.transport.is_closing()

    async def _connect(self) -> None:
        address = self._address()
        if not address:
            raise PeerUnreachable(f"no address known for node {self.peer_id}")
        host, _, port = address.rpartition(":")
        local = (self.source_host, 0) if self.source_host else None
        loop = asyncio.get_running_loop()
        security = self._security
        # Both loops set TCP_NODELAY on TCP transports.
        if security is not None and security.client_context is not None:
            opening = tls.open_connection(loop, lambda: _LinkProtocol(self), host, int(port),
                                          security.client_context, None,
                                          security.handshake_timeout_s, local_addr=local)
        else:
            opening = loop.create_connection(lambda: _LinkProtocol(self), host, int(port),
                                             local_addr=local)
        transport, protocol = await asyncio.wait_for(opening, self._connect_timeout_s)
        if protocol.authenticated is None:
            transport.write(framing.request_head(0, "peer_hello",
                                                 [self.own_id, self.own_address]))
        else:  # the hello answers the peer's challenge (_handshake_step)
            try:
                await asyncio.wait_for(asyncio.shield(protocol.authenticated),
                                       self._connect_timeout_s)
            except BaseException:
                transport.abort()
                raise
        if self._closed:
            transport.close()
            return
        self._protocol = protocol
        self.connects += 1

    async def ensure_connected(self) -> None:
        if self.connected:
            return
        if self._closed:
            raise PeerUnreachable("link closed")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            # Seen here even when every caller stopped waiting (a call's timeout cancels the
            # shield, not the task): a peer that is down is no unhandled error.
            self._connecting.add_done_callback(_seen)
        try:
            await asyncio.shield(self._connecting)
        except (OSError, asyncio.TimeoutError) as exc:
            raise PeerUnreachable(f"cannot reach node {self.peer_id}: {exc}") from None
        except PeerUnreachable:
            raise
        except MooncakedError as exc:  # the peer handshake failed: nothing was sent either
            raise PeerUnreachable(f"cannot reach node {self.peer_id}: {exc.message}") from None

    def _kick(self) -> None:
        """Start connecting in the background (for one-way messages)."""
        if self._closed or (self._connecting is not None and not self._connecting.done()):
            return
        task = asyncio.get_running_loop().create_task(self.ensure_connected())
        task.add_done_callback(_seen)

    def _drop(self, protocol: _LinkProtocol, reason: str, abort: bool = True) -> None:
        """A connection is gone, broken or closed: close it and fail the calls sent on it."""
        if self._protocol is protocol:
            self._protocol = None
        if protocol.transport is not None:
            # Broken: what it still had to send is of no use. Closed by us: let it go out.
            if abort:
                protocol.transport.abort()
            else:
                protocol.transport.close()
        waiting, protocol.waiting = protocol.waiting, {}
        for waiter, _ in waiting.values():
            if not waiter.done():
                waiter.set_exception(MooncakedError(ErrorCode.RPC_FAIL, reason))

    def send_raft(self, data: bytes) -> bool:
        """Send one encoded Raft message if the link is up; False: dropped (Raft retries)."""
        protocol = self._protocol
        if protocol is None or protocol.transport.is_closing():
            self._kick()
            return False
        transport = protocol.transport
        if transport.get_write_buffer_size() > WRITE_HIGH_WATER_BYTES:
            return False
        transport.write(framing.frame_head([framing.NOTIFICATION, "raft", [data]]))
        return True

    async def call(self, method: str, params: list, payload: list | None = None,
                   timeout_s: float = 5.0, into=None) -> tuple[Any, Any]:
        """A request to the peer: its result and payload, or the MooncakedError it answered.

        `payload` buffers must stay unchanged until the call returns (they are sent by
        reference). With `into` (a writable buffer), a response payload of exactly its size is
        received straight into it and returned as that memoryview; any other response payload
        comes back as a new bytearray. When the call ends without its answer (timeout,
        cancellation) while that answer's payload is being received into `into`, the
        connection is dropped: once the call has returned or raised, nothing writes into
        `into` any more, so it may be reused (a get staging range is).
        """
        if into is not None:
            if not (type(into) is memoryview and into.format == "B" and into.c_contiguous):
                into = memoryview(into).cast("B")  # flat bytes (a memoryview passes as it is)
            if into.readonly:
                raise ValueError("into must be a writable buffer")
        await self.ensure_connected()
        protocol = self._protocol
        if protocol is None:  # lost again between connecting and now
            raise PeerUnreachable(f"connection to node {self.peer_id} lost")
        self._next_msgid = (self._next_msgid + 1) & framing.U32_MAX or 1
        msgid = self._next_msgid
        waiter = asyncio.get_running_loop().create_future()
        protocol.waiting[msgid] = (waiter, into)
        length = sum(len(p) for p in payload) if payload else 0
        try:
            write_frame(protocol.transport,
                        framing.request_head(msgid, method, params, length), payload)
            error, result, response_payload = await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise MooncakedError(ErrorCode.RPC_TIMEOUT,
                                 f"node {self.peer_id} did not answer {method} in "
                                 f"{timeout_s:.1f} s") from None
        finally:
            protocol.waiting.pop(msgid, None)  # a late answer's payload is then dropped
            if into is not None and protocol._target is into:  # ... unless it is arriving
                self._drop(protocol, f"{method} to node {self.peer_id} ended while its "
                           "answer was being received")
        if error is not None:
            framing.raise_error(error)
        return result, response_payload

    def close(self) -> None:
        self._closed = True
        if self._protocol is not None:
            self._drop(self._protocol, "link closed", abort=False)
        if self._connecting is not None:
            self._connecting.cancel()


class _ServerProtocol(_FrameReceiver):
    """One inbound peer connection: peer_hello first, then Raft messages and requests."""

    def __init__(self, server: "PeerServer") -> None:
        super().__init__(0)  # no payload before peer_hello
        self._max_header_bytes = MAX_HELLO_HEADER_BYTES
        self.server = server
        self.hello = False
        self._nonce = b""  # this connection's challenge, with a cluster secret

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._transports.add(transport)
        if self.server._secret is not None:
            self._nonce = peer_security.new_nonce()
            transport.write(framing.frame_head(
                [framing.NOTIFICATION, "peer_challenge", [self._nonce]]))

    def connection_lost(self, exc) -> None:
        self.server._transports.discard(self.transport)

    def _frame_error(self, exc: MooncakedError) -> None:
        if self.hello:
            log.info("peer connection closed: %s", exc.message)
        else:
            log.warning("peer connection from %s refused: %s",
                        self.transport.get_extra_info("peername"), exc.message)
        self.transport.close()

    def _on_header(self, header, payload_length: int):
        server = self.server
        if not self.hello:
            msgid, method, params = framing.parse_request(header)
            secret = server._secret
            if (method != "peer_hello" or len(params) != (2 if secret is None else 4)
                    or type(params[0]) is not int or type(params[1]) is not str):
                raise MooncakedError(ErrorCode.PROTOCOL_ERROR, "a peer must say peer_hello" + (
                    "" if secret is None else " with a proof of the cluster secret"))
            if secret is not None:
                self._check_proof(secret, params)
            server._on_hello(params[0], params[1])
            self.hello = True
            self._max_payload_bytes = server._max_payload_bytes
            self._max_header_bytes = MAX_PEER_HEADER_BYTES
            return None, None
        if (type(header) is list and len(header) == 3
                and header[0] == framing.NOTIFICATION and header[1] == "raft"):
            if type(header[2]) is list and len(header[2]) == 1 and type(header[2][0]) is bytes:
                server._on_raft(header[2][0])
            return None, None  # a payload (none is sent) is dropped
        msgid, method, params = framing.parse_request(header)
        transport = self.transport
        if not payload_length:
            server._answer_soon(transport, msgid, method, params, None)
            return None, None
        target, error = server._place(method, params, payload_length)
        if error is not None:  # refused before it arrives: drop the payload, then answer
            return None, lambda: server._reply(transport, framing.error_head(
                msgid, error.code, error.message))
        payload = target
        if target is None:
            payload = bytearray(payload_length)  # bounded by max_payload_bytes (checked)
            target = memoryview(payload)
        return target, lambda: server._answer_soon(transport, msgid, method, params, payload)


    def _check_proof(self, secret: bytes, params: list) -> None:
        node_id, address, client_nonce, proof = params
        if (type(client_nonce) is not bytes or len(client_nonce) != peer_security.NONCE_BYTES
                or type(proof) is not bytes or not tls.proofs_equal(
                    proof, peer_security.client_proof(secret, self._nonce, client_nonce,
                                                      node_id, address))):
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR,
                                 f"node {node_id} ({address}) does not know the cluster secret")
        self.transport.write(framing.frame_head([
            framing.NOTIFICATION, "peer_hello_ok",
            [peer_security.server_proof(secret, self._nonce, client_nonce)]]))


class PeerServer:
    """Accepts peer connections: Raft messages go to `on_raft`, requests to `on_request`.

    With `payload_target`, a request's payload is received where it names (see PayloadTarget)
    and reaches `on_request` as that same memoryview, already filled; any other payload
    reaches it as a bytearray.
    """

    def __init__(self, on_hello: Callable[[int, str], None], on_raft: Callable[[bytes], None],
                 on_request: RequestHandler, max_payload_bytes: int,
                 payload_target: PayloadTarget | None = None,
                 security: PeerSecurity | None = None) -> None:
        self._security = security
        self._secret = security.secret if security is not None else None
        self._on_hello = on_hello
        self._on_raft = on_raft
        self._on_request = on_request
        self._payload_target = payload_target
        self._max_payload_bytes = max_payload_bytes
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._transports: set[asyncio.Transport] = set()
        self.port = 0
        self.paused = False  # tests: a node whose peer traffic is cut

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        factory = lambda: _ServerProtocol(self)  # noqa: E731
        security = self._security
        if security is not None and security.server_context is not None:
            factory = tls.server_factory(loop, factory, security.server_context,
                                         security.handshake_timeout_s)
        self._server = await loop.create_server(factory, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _place(self, method: str, params: list, length: int):
        """(target or None, error or None) for a request's payload, before it arrives."""
        if self._payload_target is None:
            return None, None
        try:
            target = self._payload_target(method, params, length)
        except MooncakedError as exc:
            return None, exc
        except Exception as exc:
            log.exception("peer request %s: placing its payload failed", method)
            return None, MooncakedError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        if target is not None and (len(target) != length or target.readonly):
            return None, MooncakedError(ErrorCode.INTERNAL_ERROR, "unusable payload target")
        return target, None

    def _answer_soon(self, transport, msgid: int, method: str, params: list, payload) -> None:
        task = asyncio.get_running_loop().create_task(
            self._answer(transport, msgid, method, params, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, transport, msgid: int, method: str, params: list, payload) -> None:
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
        if not transport.is_closing():
            write_frame(transport, head, response_payload)

    @staticmethod
    def _reply(transport, head: bytes) -> None:
        if not transport.is_closing():
            transport.write(head)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for transport in list(self._transports):
            transport.close()
        for task in list(self._tasks):
            task.cancel()
