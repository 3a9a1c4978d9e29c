"""The asyncio client: many requests in flight on one connection.

    client = await Client.connect("unix:/run/mooncaked/mooncaked.sock", namespace="llama-3")
    await client.put("block:0", b"...")
    value = await client.get("block:0")

Requests are pipelined; the daemon answers in order, so responses are matched to a FIFO of
waiting futures (and checked by msgid). Over the Unix socket, `put_from` / `get_into_address`
move values through the daemon's shared-memory segments.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Sequence

from mooncaked import tls as tls_module
from mooncaked.client import auth, calls, operations
from mooncaked.client.blocking import parse_address
from mooncaked.client.calls import Call, ReplicateConfig
from mooncaked.client.reservations import ReservationStock
from mooncaked.client.shared_memory import GetStagingMapping, SharedSegments
from mooncaked.errors import ErrorCode, MooncakedError, error_for
from mooncaked.proto import framing
from mooncaked.tls import resolve_client_context


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[tuple[int, Call, asyncio.Future]] = collections.deque()
        self._buffer = bytearray()
        self._lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self._lost = MooncakedError(ErrorCode.RPC_FAIL, f"connection lost: {exc or 'closed'}")
        while self.waiting:
            _, _, future = self.waiting.popleft()
            if not future.done():
                future.set_exception(self._lost)

    def send(self, msgid: int, call: Call, server: dict) -> asyncio.Future:
        """Send a request; `server` is the hello result, whose frame bounds it must keep."""
        if self._lost is not None:
            raise self._lost
        payload_length = sum(memoryview(p).nbytes for p in call.payload)
        head = framing.request_head(msgid, call.method, call.params, payload_length)
        calls.check_frame_bounds(server, len(head) - framing.PREFIX_BYTES, payload_length)
        future = asyncio.get_running_loop().create_future()
        if payload_length <= 64 * 1024:
            self.transport.write(b"".join((head, *call.payload)) if call.payload else head)
        else:
            self.transport.write(head)
            for piece in call.payload:
                self.transport.write(piece)
        self.waiting.append((msgid, call, future))
        return future

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= framing.PREFIX_BYTES:
            header_length, payload_length = framing.PREFIX.unpack_from(buffer, start)
            end = start + framing.PREFIX_BYTES + header_length + payload_length
            if len(buffer) < end:
                break
            header_end = start + framing.PREFIX_BYTES + header_length
            header = framing.unpack_header(bytes(buffer[start + framing.PREFIX_BYTES:
                                                        header_end]), header_length)
            payload = bytes(buffer[header_end:end])
            start = end
            self._deliver(header, payload)
        del buffer[:start]

    def _deliver(self, header, payload: bytes) -> None:
        try:
            msgid, error, result = framing.parse_response(header)
        except MooncakedError as exc:  # the daemon's protocol_error: it is closing
            self.connection_lost(exc)
            return
        if not self.waiting or self.waiting[0][0] != msgid:
            self.transport.abort()
            return
        _, call, future = self.waiting.popleft()
        if future.done():
            return
        try:
            if error is not None:
                framing.raise_error(error)
            if call.receive_into is not None:
                future.set_result(_copy_into(call.receive_into, payload))
            else:
                future.set_result(call.parse(result, payload))
        except MooncakedError as exc:
            future.set_exception(exc)


def _copy_into(target, payload: bytes) -> int:
    """A `get` into a caller's buffer: the value's size; INVALID_PARAMS if it does not fit."""
    view = memoryview(target).cast("B")
    if len(payload) > len(view):
        raise error_for(ErrorCode.INVALID_PARAMS,
                        f"the value has {len(payload)} bytes, the buffer {len(view)}")
    view[:len(payload)] = payload
    return len(payload)


class Client:
    def __init__(self, protocol: _ClientProtocol, kind: str) -> None:
        self._protocol = protocol
        self.transport_kind = kind
        self._msgid = 0
        self.server: dict = {}
        self.segments: SharedSegments | None = None
        # A cluster node's get staging area, mapped (get_staged), else None.
        self.get_staging: GetStagingMapping | None = None
        # Ranges the daemon reserved for this connection's next puts (one request per put).
        self.reservation_stock: ReservationStock | None = None

    @classmethod
    async def connect(cls, address: str, namespace: str = calls.DEFAULT_NAMESPACE,
                      client_name: str = "", map_segments: bool = True,
                      *, tls=None, principal: str | None = None,
                      secret: bytes | str | None = None) -> "Client":
        """`tls` as BlockingClient.connect takes it; TLS runs on any event loop.
        `principal` and `secret`: credentials (else $MOONCAKED_PRINCIPAL and
        $MOONCAKED_SECRET or $MOONCAKED_SECRET_FILE; client/auth.py)."""
        credentials = auth.resolve(principal, secret)
        loop = asyncio.get_running_loop()
        kind, target = parse_address(address)
        tls_context = resolve_client_context(tls) if kind == "tcp" else None
        if kind == "unix":
            _, protocol = await loop.create_unix_connection(_ClientProtocol, target)
        elif tls_context is not None:
            # Both loops set TCP_NODELAY on TCP transports.
            _, protocol = await tls_module.open_connection(
                loop, _ClientProtocol, target[0], target[1], tls_context,
                tls_module.server_name(target[0]))
        else:
            transport, protocol = await loop.create_connection(_ClientProtocol, *target)
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP,
                                                          socket.TCP_NODELAY, 1)
        client = cls(protocol, kind)
        try:
            client.server = await client.drive(auth.handshake(namespace, client_name,
                                                              credentials))
            if map_segments and client.server.get("segments"):
                client.segments = SharedSegments(client.server["segments"],
                                                 client.server.get("fd_socket", ""))
            if map_segments and client.server.get("get_staging"):
                client.get_staging = GetStagingMapping(client.server["get_staging"])
            if client.server.get("max_reserved_bytes"):
                client.reservation_stock = ReservationStock(
                    client.server["max_reserved_bytes"], client.server["reservation_ttl_ms"])
        except BaseException:
            await client.close()
            raise
        return client

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.segments is not None:
            self.segments.close()
            self.segments = None
        self.reservation_stock = None  # the daemon frees them when the connection closes
        if self.get_staging is not None:  # the daemon frees its ranges when it closes too
            self.get_staging.close()
            self.get_staging = None
        transport = self._protocol.transport
        if transport is not None and not transport.is_closing():
            transport.close()
            await asyncio.sleep(0)

    def _run(self, call: Call) -> asyncio.Future:
        self._msgid = (self._msgid + 1) & framing.U32_MAX
        return self._protocol.send(self._msgid, call, self.server)

    @property
    def lease_ttl_ms(self) -> int:
        return self.server.get("lease_ttl_ms", 0)

    async def drive(self, operation: operations.Operation):
        """Run an operation's requests (client/operations.py, shared with the blocking
        client) on this connection; its result."""
        try:
            call = next(operation)
            while True:
                try:
                    result = await self._run(call)
                except MooncakedError as exc:
                    call = operation.throw(exc)
                else:
                    call = operation.send(result)
        except StopIteration as done:
            return done.value

    # -- values -----------------------------------------------------------------------------

    async def put(self, key: str, value, config: ReplicateConfig | None = None) -> bool:
        """Store a value; False if the key already existed (its value is kept)."""
        return await self.drive(operations.put(self, key, value, config))

    async def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> None:
        await self._run(calls.upsert(key, value, config))

    async def get(self, key: str) -> bytes:
        return await self.drive(operations.get(self, key))

    async def get_into(self, key: str, buffer) -> int:
        """Receive a value into a writable buffer through the socket; returns its size."""
        return await self._run(calls.get(key, into=buffer))

    async def exists(self, key: str) -> bool:
        return await self._run(calls.exists(key))

    async def get_size(self, key: str) -> int:
        return await self._run(calls.get_size(key))

    async def remove(self, key: str, force: bool = False) -> None:
        await self._run(calls.remove(key, force))

    async def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return await self._run(calls.remove_by_regex(pattern, force))

    async def remove_all(self, force: bool = False) -> int:
        return await self._run(calls.remove_all(force))

    async def batch_put(self, keys: Sequence[str], values: Sequence,
                        config: ReplicateConfig | None = None) -> list[int]:
        return await self._run(calls.batch_put(keys, values, config))

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._run(calls.batch_get(keys))

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(calls.batch_exists(keys))

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return await self._run(calls.batch_remove(keys, force))

    async def ping(self) -> str:
        return await self._run(calls.simple("ping"))

    # -- values at raw addresses: shared memory when local ----------------------------------

    async def put_from(self, key: str, address: int, size_bytes: int,
                       config: ReplicateConfig | None = None) -> bool:
        return await self.drive(operations.put_from(self, key, address, size_bytes, config))

    async def get_into_address(self, key: str, address: int, size_bytes: int) -> int:
        return await self.drive(operations.get_into_address(self, key, address, size_bytes))

    async def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int],
                             sizes: Sequence[int],
                             config: ReplicateConfig | None = None) -> list[int]:
        return await self.drive(operations.batch_put_from(self, keys, addresses, sizes, config))

    async def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                             sizes: Sequence[int]) -> list[int]:
        return await self.drive(operations.batch_get_into(self, keys, addresses, sizes))

    async def batch_put_from_ranges(self, keys: Sequence[str], sizes: Sequence[int],
                                    ranges_per_key: Sequence[Sequence[operations.Range]],
                                    config: ReplicateConfig | None = None) -> list[int]:
        return await self.drive(operations.batch_put_from_ranges(self, keys, sizes,
                                                                 ranges_per_key, config))

    async def batch_get_into_ranges(
            self, keys: Sequence[str],
            ranges_per_key: Sequence[Sequence[operations.Range]],
            capacities: Sequence[int] | None = None) -> list[int]:
        return await self.drive(operations.batch_get_into_ranges(self, keys, ranges_per_key,
                                                                 capacities))

    # -- administration ---------------------------------------------------------------------

    async def status(self) -> dict:
        return await self._run(calls.simple("status"))

    async def segment_report(self) -> list[dict]:
        return await self._run(calls.simple("segments"))

    async def objects_list(self, prefix: str = "", regex: str | None = None,
                           namespace: str | None = None, limit: int = 1000) -> list[dict]:
        return await self._run(calls.simple("objects_list", prefix, regex, namespace, limit))

    async def object_stat(self, key: str, namespace: str | None = None) -> dict:
        return await self._run(calls.simple("object_stat", key, namespace))
