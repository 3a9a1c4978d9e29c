"""The handshake/RPC socket protocol of Mooncake's Transfer Engine (wire/PROTOCOL.md, section
"Mooncake Transfer Engine TCP compatibility").

A frame is a u64 little-endian length, then that many bytes: a type byte and a UTF-8 JSON
text (the length counts the type byte). Types: 0 Connection (RDMA queue pair exchange; a TCP
segment answers it with empty fields), 1 Metadata (both sides swap segment descriptors),
2 Notify (a short {name, notify_msg} message), 3 Probe (liveness). The reply reuses the type.
A client makes one exchange per connection (Mooncake's server reads one request per
connection); this server answers any number of requests on one connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("mooncaked.transfer.handshake")

CONNECTION = 0
METADATA = 1
NOTIFY = 2
PROBE = 3
TYPE_NAMES = {CONNECTION: "Connection", METADATA: "Metadata", NOTIFY: "Notify", PROBE: "Probe"}

LENGTH = struct.Struct("<Q")
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # Mooncake's default handshake maximum
DEFAULT_CONNECT_TIMEOUT_MS = 5000
DEFAULT_SERVER_RECEIVE_TIMEOUT_MS = 5000
DEFAULT_CLIENT_RECEIVE_TIMEOUT_MS = 60000
DEFAULT_MAX_CONNECTIONS = 256

NOTIFY_REPLY = {"name": "", "notify_msg": "success"}
PROBE_REPLY = {"status": "success"}
# What a TCP-only segment answers to a Connection (RDMA) request: no queue pairs.
CONNECTION_REPLY = {"local_gid": "", "local_lid": 0, "local_nic_path": "", "payload": "",
                    "peer_nic_path": "", "qp_num": [], "reply_msg": ""}


class HandshakeError(Exception):
    """A malformed or oversized frame, an unknown type, or a peer that closed or timed out."""


def encode_frame(frame_type: int, body: dict) -> bytes:
    text = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    return LENGTH.pack(1 + len(text)) + bytes([frame_type]) + text


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> tuple[int, dict]:
    """One frame: (type, JSON object). Raises HandshakeError, or EOFError on a clean close
    before the first byte."""
    try:
        head = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError from None
        raise HandshakeError(f"frame length cut short at {len(e.partial)} of 8 bytes") from None
    (length,) = LENGTH.unpack(head)
    if length == 0:
        raise HandshakeError("empty frame (length 0)")
    if length > max_frame_bytes:
        raise HandshakeError(f"frame of {length} bytes is over the {max_frame_bytes}-byte limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise HandshakeError(f"frame cut short at {len(e.partial)} of {length} bytes") from None
    frame_type = body[0]
    if frame_type not in TYPE_NAMES:
        # Mooncake reads a first byte above 3 as a legacy frame without a type byte; nothing
        # this implementation talks to sends one.
        raise HandshakeError(f"unknown frame type {frame_type}")
    try:
        value = json.loads(body[1:].decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise HandshakeError(f"{TYPE_NAMES[frame_type]} frame is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise HandshakeError(f"{TYPE_NAMES[frame_type]} frame is not a JSON object")
    return frame_type, value


@dataclass
class Notify:
    name: str
    message: str


class HandshakeServer:
    """Answers handshake frames. on_metadata(peer descriptor JSON) returns this segment's
    descriptor JSON; on_notify(Notify) records a notification."""

    def __init__(self, on_metadata: Callable[[dict], dict], on_notify: Callable[[Notify], None],
                 *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 receive_timeout_ms: int = DEFAULT_SERVER_RECEIVE_TIMEOUT_MS,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self._on_metadata = on_metadata
        self._on_notify = on_notify
        self.max_frame_bytes = max_frame_bytes
        self.receive_timeout_ms = receive_timeout_ms
        self.max_connections = max_connections
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            tasks = list(self._connections)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            log.warning("handshake connection refused: %d connections open",
                        len(self._connections))
            writer.close()
            return
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    frame_type, body = await asyncio.wait_for(
                        read_frame(reader, self.max_frame_bytes), self.receive_timeout_ms / 1000)
                except EOFError:
                    return
                except asyncio.TimeoutError:
                    return  # an idle connection: close it, as Mooncake does
                writer.write(encode_frame(frame_type, self._answer(frame_type, body)))
                await writer.drain()
        except HandshakeError as e:
            log.warning("handshake from %s refused: %s", peer, e)
        except (ConnectionError, OSError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    def _answer(self, frame_type: int, body: dict) -> dict:
        if frame_type == METADATA:
            return self._on_metadata(body)
        if frame_type == NOTIFY:
            name, message = body.get("name", ""), body.get("notify_msg", "")
            if not isinstance(name, str) or not isinstance(message, str):
                raise HandshakeError("Notify name and notify_msg must be strings")
            self._on_notify(Notify(name, message))
            return NOTIFY_REPLY
        if frame_type == PROBE:
            return PROBE_REPLY
        return CONNECTION_REPLY


async def exchange(host: str, port: int, frame_type: int, body: dict, *,
                   max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                   connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
                   receive_timeout_ms: int = DEFAULT_CLIENT_RECEIVE_TIMEOUT_MS) -> dict:
    """One request and its reply, on a connection of its own. Raises HandshakeError (also
    for a refused connection or a timeout)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                connect_timeout_ms / 1000)
    except (OSError, asyncio.TimeoutError) as e:
        raise HandshakeError(f"cannot connect to {host}:{port}: {e or 'timed out'}") from None
    try:
        writer.write(encode_frame(frame_type, body))
        await writer.drain()
        reply_type, reply = await asyncio.wait_for(read_frame(reader, max_frame_bytes),
                                                   receive_timeout_ms / 1000)
    except EOFError:
        raise HandshakeError(f"{host}:{port} closed the connection without a reply") from None
    except asyncio.TimeoutError:
        raise HandshakeError(f"{host}:{port} sent no reply within {receive_timeout_ms} ms") from None
    except OSError as e:
        raise HandshakeError(f"handshake with {host}:{port} failed: {e}") from None
    finally:
        writer.close()
    if reply_type != frame_type:
        raise HandshakeError(f"{host}:{port} answered a {TYPE_NAMES[frame_type]} frame with "
                             f"a {TYPE_NAMES[reply_type]} frame")
    return reply
