"""A simulated client: the client wire protocol (wire/PROTOCOL.md) over a simulated stream to
one node's client listener, one request at a time.

It does what any client written from PROTOCOL.md does: hello, then put / upsert / get / exists /
remove with msgpack frames; it does not follow redirects (the daemon forwards to the leader).
Values check themselves: each names its key and value id and is padded with bytes derived from
both, so a get that returns anything but a whole value once written to that key is caught.
"""

from __future__ import annotations

import asyncio

import msgpack

from mooncaked.errors import MooncakedError
from mooncaked.proto import framing

NAMESPACE = "sim"


def encode_value(key: str, value_id: int, size: int) -> bytes:
    head = f"{key}={value_id};".encode()
    fill = bytes((value_id * 31 + i) & 0xFF for i in range(max(0, size - len(head))))
    return head + fill


def decode_value(key: str, data: bytes) -> int:
    """The value id a value carries; ValueError if its bytes are not one written to `key`."""
    head, sep, _ = bytes(data[:64]).partition(b";")
    name, eq, number = head.decode(errors="replace").rpartition("=")
    if not sep or not eq or name != key or not number.isdigit():
        raise ValueError(f"bytes {bytes(data[:32])!r} are no value of key {key!r}")
    value_id = int(number)
    if bytes(data) != encode_value(key, value_id, len(data)):
        raise ValueError(f"value {value_id} of key {key!r} has wrong bytes")
    return value_id


class ConnectionLost(Exception):
    """The connection closed or was reset before the answer came."""


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport = None
        self.buffer = bytearray()
        self.waiting: dict[int, asyncio.Future] = {}
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= framing.PREFIX_BYTES:
            header_length, payload_length = framing.PREFIX.unpack_from(self.buffer)
            end = framing.PREFIX_BYTES + header_length + payload_length
            if len(self.buffer) < end:
                return
            header = msgpack.unpackb(bytes(self.buffer[framing.PREFIX_BYTES:
                                                       framing.PREFIX_BYTES + header_length]),
                                     raw=False, strict_map_key=False)
            payload = bytes(self.buffer[framing.PREFIX_BYTES + header_length:end])
            del self.buffer[:end]
            try:
                msgid, error, result = framing.parse_response(header)
            except MooncakedError as exc:  # protocol_error: the daemon closes the connection
                for waiter in self.waiting.values():
                    if not waiter.done():
                        waiter.set_exception(exc)
                self.waiting.clear()
                continue
            waiter = self.waiting.pop(msgid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((error, result, payload))

    def connection_lost(self, exc) -> None:
        self.lost = True
        for waiter in self.waiting.values():
            if not waiter.done():
                waiter.set_exception(ConnectionLost(str(exc or "closed")))
        self.waiting.clear()


class WireClient:
    def __init__(self, host: str, port: int, name: str) -> None:
        self.host = host
        self.port = port
        self.name = name
        self.protocol: _ClientProtocol | None = None
        self._msgid = 0

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.protocol = await loop.create_connection(_ClientProtocol, self.host, self.port)
        await self.call("hello", [{"protocol": framing.PROTOCOL_VERSION,
                                   "namespace": NAMESPACE, "client_name": self.name}])

    @property
    def connected(self) -> bool:
        return self.protocol is not None and not self.protocol.lost

    def send(self, method: str, params: list, payload: bytes = b"",
             cut_after: int | None = None) -> asyncio.Future:
        """Write one request; the future gives (error, result, payload). With `cut_after`,
        only that many bytes of the frame are written before the connection is reset (a
        client that dies in the middle of sending)."""
        protocol = self.protocol
        self._msgid += 1
        waiter = asyncio.get_running_loop().create_future()
        if protocol is None or protocol.lost:
            waiter.set_exception(ConnectionLost("not connected"))
            return waiter
        protocol.waiting[self._msgid] = waiter
        frame = framing.request_head(self._msgid, method, params, len(payload)) + payload
        if cut_after is None:
            protocol.transport.write(frame)
        else:
            protocol.transport.write(frame[:cut_after])
            protocol.transport.abort()
        return waiter

    async def call(self, method: str, params: list, payload: bytes = b""):
        error, result, data = await self.send(method, params, payload)
        if error is not None:
            framing.raise_error(error)
        return result, data

    def abort(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.abort()

