"""The blocking client: one socket, one request at a time, for one thread.

`BlockingClient.connect("unix:/run/mooncaked/mooncaked.sock")` or `("127.0.0.1:50051")`.
Over the Unix socket it maps the daemon's segments, and the `*_from` / `*_into` calls move
values by shared memory; over TCP the same calls send the bytes through the socket.
Threads that share a client use `ClientPool` (client/pool.py), which holds several of these.
"""

from __future__ import annotations

import ctypes
import select
import socket
import ssl

from mooncaked.tls import resolve_client_context, server_name
from mooncaked.client import auth, calls, operations
from mooncaked.client.api import BlockingCalls
from mooncaked.client.calls import Call
from mooncaked.client.reservations import ReservationStock
from mooncaked._native import buffer_address, new_bytes
from mooncaked.client.shared_memory import GetStagingMapping, SharedSegments
from mooncaked.errors import ErrorCode, MooncakedError, error_for
from mooncaked.proto import framing

INLINE_SEND_BYTES = 64 * 1024
READ_BUFFER_BYTES = 64 * 1024


def parse_address(address: str) -> tuple[str, object]:
    """("unix", path) for `unix:PATH` or an absolute path; ("tcp", (host, port)) for HOST:PORT."""
    if address.startswith("unix:"):
        return "unix", address[len("unix:"):]
    if address.startswith("/"):
        return "unix", address
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is neither unix:PATH, /PATH nor HOST:PORT")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


def open_socket(address: str, timeout_s: float | None,
                tls_setting: ssl.SSLContext | bool | None = False) -> tuple[socket.socket, str]:
    """A connected socket; over TCP with TLS (`tls_setting` as BlockingClient.connect takes
    it), a TLS socket whose handshake is done. TLS does not apply to unix:."""
    kind, target = parse_address(address)
    tls_context = resolve_client_context(tls_setting) if kind == "tcp" else None
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    try:
        sock.connect(target)
        if kind == "tcp" and tls_context is not None:
            sock = tls_context.wrap_socket(sock, server_hostname=server_name(target[0]))
    except BaseException:
        sock.close()
        raise
    return sock, kind


def raw_buffer(address: int, size_bytes: int) -> memoryview:
    """A writable view of `size_bytes` at a raw address in this process (no copy)."""
    return memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")


class BlockingClient(BlockingCalls):
    def __init__(self, sock: socket.socket, kind: str) -> None:
        self._sock = sock
        self.transport_kind = kind
        self._msgid = 0
        self._read_buffer = bytearray(READ_BUFFER_BYTES)
        self._read_view = memoryview(self._read_buffer)
        self._start = 0  # buffered, unread bytes are _read_buffer[_start:_end]
        self._end = 0
        self.server: dict = {}
        self.segments: SharedSegments | None = None
        # A cluster node's get staging area, mapped (get_staged), else None.
        self.get_staging: GetStagingMapping | None = None
        # Ranges the daemon reserved for this connection's next puts (one request per put).
        self.reservation_stock: ReservationStock | None = None
        self._owns_segments = True

    @classmethod
    def connect(cls, address: str, namespace: str = calls.DEFAULT_NAMESPACE,
                client_name: str = "", timeout_s: float | None = 30.0,
                map_segments: bool = True, *, tls: ssl.SSLContext | bool | None = None,
                principal: str | None = None, secret: bytes | str | None = None
                ) -> "BlockingClient":
        """`tls`: an SSLContext for TCP (mooncaked.tls.client_context builds one), False for
        plain TCP, None for $MOONCAKED_TLS_CA and friends (plain when unset).
        `principal` and `secret`: credentials (else $MOONCAKED_PRINCIPAL and
        $MOONCAKED_SECRET or $MOONCAKED_SECRET_FILE; client/auth.py)."""
        credentials = auth.resolve(principal, secret)
        sock, kind = open_socket(address, timeout_s, tls)
        client = cls(sock, kind)
        try:
            client.server = client.drive(auth.handshake(namespace, client_name, credentials))
            if map_segments and client.server.get("segments"):
                client.segments = SharedSegments(client.server["segments"],
                                                 client.server.get("fd_socket", ""))
            if map_segments and client.server.get("get_staging"):
                client.get_staging = GetStagingMapping(client.server["get_staging"])
            if client.server.get("max_reserved_bytes"):
                client.reservation_stock = ReservationStock(
                    client.server["max_reserved_bytes"], client.server["reservation_ttl_ms"])
        except BaseException:
            client.close()
            raise
        return client

    def use_segments(self, segments: SharedSegments | None) -> None:
        """Share a mapping of the daemon's segments that someone else owns (and closes)."""
        self.segments = segments
        self._owns_segments = False

    @property
    def closed(self) -> bool:
        return self._sock is None

    def peer_closed(self) -> bool:
        """True when the daemon has closed this idle connection (it restarted or stopped):
        a check before reuse, so a request is not sent into a dead socket."""
        if self._sock is None:
            return True
        if self._end > self._start:
            return False
        # poll, not recv(MSG_DONTWAIT): a socket with a timeout waits for data before recv.
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        if not poller.poll(0):
            return False
        if isinstance(self._sock, ssl.SSLSocket):
            return self._tls_peer_closed()
        try:
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _tls_peer_closed(self) -> bool:
        """TLS has no MSG_PEEK, and a readable socket may hold only TLS records (session
        tickets): read what is there without waiting; bytes read stay buffered."""
        sock, timeout = self._sock, self._sock.gettimeout()
        sock.settimeout(0)
        try:
            count = sock.recv_into(self._read_view[self._end:])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return False
        except OSError:
            return True
        finally:
            sock.settimeout(timeout)
        self._end += count
        return count == 0

    def __enter__(self) -> "BlockingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.segments is not None and self._owns_segments:
            self.segments.close()
        self.segments = None
        self.reservation_stock = None  # the daemon frees them when the connection closes
        if self.get_staging is not None:  # the daemon frees its ranges when it closes too
            self.get_staging.close()
            self.get_staging = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def lease_ttl_ms(self) -> int:
        return self.server.get("lease_ttl_ms", 0)

    # -- the socket -------------------------------------------------------------------------

    def _run(self, call: Call):
        if self._sock is None:
            raise MooncakedError(ErrorCode.RPC_FAIL, "the client is closed")
        payload_length = sum(memoryview(p).nbytes for p in call.payload)
        head = framing.request_head((self._msgid + 1) & framing.U32_MAX, call.method,
                                    call.params, payload_length)
        calls.check_frame_bounds(self.server, len(head) - framing.PREFIX_BYTES, payload_length)
        self._msgid = (self._msgid + 1) & framing.U32_MAX
        try:
            self._send(head, call.payload, payload_length)
            return self._receive(call)
        except OSError as exc:
            self.close()
            raise MooncakedError(ErrorCode.RPC_FAIL, f"connection lost: {exc}") from exc

    def _send(self, head: bytes, payload: list, payload_length: int) -> None:
        sock = self._sock
        if payload_length <= INLINE_SEND_BYTES:
            sock.sendall(b"".join((head, *payload)) if payload else head)
        else:
            sock.sendall(head)
            for piece in payload:
                sock.sendall(piece)

    def _buffer(self, size: int) -> memoryview:
        """The next `size` received bytes, read with as few recv calls as possible.

        Small responses arrive whole in one recv into the read buffer; the view is valid
        until the next call.
        """
        if size > len(self._read_buffer):
            bigger = bytearray(size)
            bigger[:self._end - self._start] = self._read_view[self._start:self._end]
            self._read_buffer, self._read_view = bigger, memoryview(bigger)
            self._end -= self._start
            self._start = 0
        elif self._start + size > len(self._read_buffer):
            kept = self._end - self._start
            self._read_buffer[:kept] = self._read_view[self._start:self._end]
            self._start, self._end = 0, kept
        while self._end - self._start < size:
            count = self._sock.recv_into(self._read_view[self._end:])
            if count == 0:
                raise ConnectionResetError("the daemon closed the connection")
            self._end += count
        view = self._read_view[self._start:self._start + size]
        self._start += size
        if self._start == self._end:
            self._start = self._end = 0
        return view

    def _receive_into(self, target: memoryview) -> None:
        """Fill `target`: bytes already buffered first, the rest straight from the socket."""
        buffered = min(self._end - self._start, len(target))
        if buffered:
            target[:buffered] = self._buffer(buffered)
        received, size = buffered, len(target)
        while received < size:
            count = self._sock.recv_into(target[received:], size - received)
            if count == 0:
                raise ConnectionResetError("the daemon closed the connection")
            received += count

    def _receive(self, call: Call):
        header_length, payload_length = framing.PREFIX.unpack(self._buffer(framing.PREFIX_BYTES))
        header = framing.unpack_header(self._buffer(header_length), max(header_length, 1))
        try:
            msgid, error, result = framing.parse_response(header)
        except MooncakedError:
            self.close()  # the daemon is closing this connection
            raise
        if msgid != self._msgid:
            self.close()
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR,
                                 f"response {msgid} to request {self._msgid}")
        if call.receive_into is not None and error is None:
            target = memoryview(call.receive_into).cast("B")
            if payload_length > len(target):
                self._receive_into(memoryview(bytearray(payload_length)))
                raise error_for(ErrorCode.INVALID_PARAMS,
                                f"the value has {payload_length} bytes, the buffer "
                                f"{len(target)}")
            self._receive_into(target[:payload_length])
            return payload_length
        payload = new_bytes(payload_length)  # filled here, before anyone else sees it
        if payload_length:
            self._receive_into(raw_buffer(buffer_address(payload), payload_length))
        if error is not None:
            framing.raise_error(error)
        return call.parse(result, payload)

    # -- values ---------------------------------------------------------------------------
    # Calls of more than one request are operations (client/operations.py), shared with the
    # asyncio client; over the Unix socket they move bytes through shared memory.

    def drive(self, operation: operations.Operation):
        """Run an operation's requests on this connection; its result."""
        try:
            call = next(operation)
            while True:
                try:
                    result = self._run(call)
                except MooncakedError as exc:
                    call = operation.throw(exc)
                else:
                    call = operation.send(result)
        except StopIteration as done:
            return done.value

    # -- BlockingCalls (client/api.py): every call, written once ----------------------------

    def _request(self, call: Call, reads_only: bool):
        return self._run(call)

    def _operation(self, start, reads_only: bool):
        return self.drive(start(self))
