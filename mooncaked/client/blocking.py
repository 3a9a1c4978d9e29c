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
from typing import Sequence

from mooncaked.client import calls, operations
from mooncaked.client.calls import Call, ReplicateConfig
from mooncaked.client.reservations import ReservationStock
from mooncaked._native import buffer_address, new_bytes
from mooncaked.client.shared_memory import SharedSegments
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


def open_socket(address: str, timeout_s: float | None) -> tuple[socket.socket, str]:
    kind, target = parse_address(address)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    try:
        sock.connect(target)
    except BaseException:
        sock.close()
        raise
    return sock, kind


def raw_buffer(address: int, size_bytes: int) -> memoryview:
    """A writable view of `size_bytes` at a raw address in this process (no copy)."""
    return memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")


class BlockingClient:
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
        # Ranges the daemon reserved for this connection's next puts (one request per put).
        self.reservation_stock: ReservationStock | None = None
        self._owns_segments = True

    @classmethod
    def connect(cls, address: str, namespace: str = calls.DEFAULT_NAMESPACE,
                client_name: str = "", timeout_s: float | None = 30.0,
                map_segments: bool = True) -> "BlockingClient":
        sock, kind = open_socket(address, timeout_s)
        client = cls(sock, kind)
        try:
            client.server = client._run(calls.hello(namespace, client_name))
            if map_segments and client.server.get("segments"):
                client.segments = SharedSegments(client.server["segments"])
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
        try:
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def __enter__(self) -> "BlockingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.segments is not None and self._owns_segments:
            self.segments.close()
        self.segments = None
        self.reservation_stock = None  # the daemon frees them when the connection closes
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def lease_ttl_ms(self) -> int:
        return self.server.get("lease_ttl_ms", 0)

    def call(self, method: str, *params):
        """Any method of wire/PROTOCOL.md without a payload: its result (administration)."""
        return self._run(calls.simple(method, *params))

    # -- the socket -------------------------------------------------------------------------

    def _run(self, call: Call):
        if self._sock is None:
            raise MooncakedError(ErrorCode.RPC_FAIL, "the client is closed")
        self._msgid = (self._msgid + 1) & framing.U32_MAX
        payload_length = sum(memoryview(p).nbytes for p in call.payload)
        head = framing.request_head(self._msgid, call.method, call.params, payload_length)
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

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> bool:
        """Store a value; False if the key already existed (its value is kept)."""
        return self.drive(operations.put(self, key, value, config))

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> None:
        self._run(calls.upsert(key, value, config))

    def get(self, key: str) -> bytes:
        return self.drive(operations.get(self, key))

    def get_into(self, key: str, buffer) -> int:
        """Receive a value into a writable buffer through the socket; returns its size."""
        return self._run(calls.get(key, into=buffer))

    def exists(self, key: str) -> bool:
        return self._run(calls.exists(key))

    def get_size(self, key: str) -> int:
        return self._run(calls.get_size(key))

    def remove(self, key: str, force: bool = False) -> None:
        self._run(calls.remove(key, force))

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._run(calls.remove_by_regex(pattern, force))

    def remove_all(self, force: bool = False) -> int:
        return self._run(calls.remove_all(force))

    def batch_put(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig | None = None) -> list[int]:
        return self._run(calls.batch_put(keys, values, config))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._run(calls.batch_get(keys))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._run(calls.batch_exists(keys))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._run(calls.batch_remove(keys, force))

    def ping(self) -> str:
        return self._run(calls.simple("ping"))

    # -- values at raw addresses: shared memory when local ----------------------------------

    def put_from(self, key: str, address: int, size_bytes: int,
                 config: ReplicateConfig | None = None) -> bool:
        """Store `size_bytes` at `address` (this process's memory); False if the key existed."""
        return self.drive(operations.put_from(self, key, address, size_bytes, config))

    def get_into_address(self, key: str, address: int, size_bytes: int) -> int:
        """Copy a value to `address` (room for `size_bytes`); returns the value's size."""
        return self.drive(operations.get_into_address(self, key, address, size_bytes))

    def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        """Per key: 0 stored, 1 already existed, or a negative error code."""
        return self.drive(operations.batch_put_from(self, keys, addresses, sizes, config))

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Per key: the value's size, or a negative error code."""
        return self.drive(operations.batch_get_into(self, keys, addresses, sizes))

    def batch_put_from_ranges(self, keys: Sequence[str], sizes: Sequence[int],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              config: ReplicateConfig | None = None) -> list[int]:
        """Per key, an object of `sizes[i]` bytes gathered from `(offset, address, size)`
        ranges; per key 0 stored, 1 already existed, or a negative error code."""
        return self.drive(operations.batch_put_from_ranges(self, keys, sizes, ranges_per_key,
                                                           config))

    def batch_get_into_ranges(self, keys: Sequence[str],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              capacities: Sequence[int] | None = None) -> list[int]:
        """Per key, `(offset, address, size)` ranges of the value scattered to this process's
        memory (clipped at the value's end); per key the value's size or a negative code.
        With `capacities`, a value larger than its capacity is not copied (INVALID_PARAMS)."""
        return self.drive(operations.batch_get_into_ranges(self, keys, ranges_per_key,
                                                           capacities))

    # -- administration ---------------------------------------------------------------------

    def status(self) -> dict:
        return self._run(calls.simple("status"))

    def segment_report(self) -> list[dict]:
        return self._run(calls.simple("segments"))

    def objects_list(self, prefix: str = "", regex: str | None = None,
                     namespace: str | None = None, limit: int = 1000) -> list[dict]:
        return self._run(calls.simple("objects_list", prefix, regex, namespace, limit))

    def object_stat(self, key: str, namespace: str | None = None) -> dict:
        return self._run(calls.simple("object_stat", key, namespace))

    def config_show(self) -> dict:
        return self._run(calls.simple("config_show"))
