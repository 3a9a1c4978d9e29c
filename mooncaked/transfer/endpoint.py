"""A transfer endpoint that speaks Mooncake's Transfer Engine protocols over TCP: one segment
(this process's registered memory) served on a handshake port and a data port, and batches of
READ/WRITE requests against remote segments, with a status per request.

P2P handshake mode: the segment name is `host:rpc_port`; opening a remote segment sends it a
Metadata handshake carrying this segment's descriptor and caches the descriptor it answers.
Everything runs on the running asyncio loop; submit() returns at once and the requests
complete on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

from . import handshake
from .descriptors import (DescriptorError, RegisteredMemory, SegmentDescriptor,
                          now_timestamp)
from .mooncake_tcp import (DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_CONNECTIONS_PER_PEER,
                           DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IN_FLIGHT_REQUESTS,
                           DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RECEIVE_TIMEOUT_MS,
                           DEFAULT_REQUEST_TIMEOUT_MS, DEFAULT_SLICE_BYTES, READ, WRITE,
                           TcpDataServer, TcpInitiator, TransferFailed, TransferTarget,
                           TransferTimeout)

log = logging.getLogger("mooncaked.transfer")

__all__ = ["READ", "WRITE", "TransferEndpoint", "TransferRequest", "TransferState",
           "TransferStatus", "TransferBatch", "SegmentError"]


class TransferState(enum.IntEnum):
    """Mooncake's TransferStatusEnum, same values."""
    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6


@dataclass(frozen=True)
class TransferRequest:
    opcode: int  # READ (remote -> local) or WRITE (local -> remote)
    local_address: int
    segment: str  # the remote segment's name
    remote_address: int  # absolute, inside one of the remote segment's buffers
    length: int


@dataclass
class TransferStatus:
    state: TransferState = TransferState.WAITING
    transferred_bytes: int = 0
    error: str = ""


class SegmentError(Exception):
    """A segment name that cannot be resolved, or a peer whose descriptor is unusable."""


class TransferBatch:
    """The requests of one submit() and their statuses; wait() returns when all are done."""

    def __init__(self, requests: list[TransferRequest]) -> None:
        self.requests = requests
        self.statuses = [TransferStatus() for _ in requests]
        self._tasks: list[asyncio.Task] = []

    @property
    def done(self) -> bool:
        return all(s.state != TransferState.WAITING for s in self.statuses)

    @property
    def failed(self) -> bool:
        return any(s.state not in (TransferState.WAITING, TransferState.COMPLETED)
                   for s in self.statuses)

    async def wait(self) -> list[TransferStatus]:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        return self.statuses


class TransferEndpoint:
    """Bounds are constructor parameters (defaults in mooncake_tcp and handshake)."""

    def __init__(self, host: str = "127.0.0.1", rpc_port: int = 0, data_port: int = 0, *,
                 proto_version: int = 2,
                 slice_bytes: int = DEFAULT_SLICE_BYTES,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 data_receive_timeout_ms: int = DEFAULT_RECEIVE_TIMEOUT_MS,
                 max_data_connections: int = DEFAULT_MAX_CONNECTIONS,
                 connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
                 request_timeout_ms: int = DEFAULT_REQUEST_TIMEOUT_MS,
                 connections_per_peer: int = DEFAULT_CONNECTIONS_PER_PEER,
                 max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
                 max_handshake_frame_bytes: int = handshake.DEFAULT_MAX_FRAME_BYTES,
                 handshake_server_timeout_ms: int = handshake.DEFAULT_SERVER_RECEIVE_TIMEOUT_MS,
                 handshake_client_timeout_ms: int = handshake.DEFAULT_CLIENT_RECEIVE_TIMEOUT_MS,
                 max_notifies: int = 4096) -> None:
        if proto_version not in (1, 2):
            raise ValueError(f"proto_version must be 1 or 2, not {proto_version}")
        self.host = host
        self._rpc_port = rpc_port
        self._data_port = data_port
        self.proto_version = proto_version
        self.memory = RegisteredMemory()
        self._handshake = handshake.HandshakeServer(
            self._on_metadata, self._on_notify, max_frame_bytes=max_handshake_frame_bytes,
            receive_timeout_ms=handshake_server_timeout_ms)
        self._data = TcpDataServer(self.memory, slice_bytes=slice_bytes,
                                   max_request_bytes=max_request_bytes,
                                   receive_timeout_ms=data_receive_timeout_ms,
                                   max_connections=max_data_connections)
        self._initiator: TcpInitiator | None = None
        self._initiator_options = dict(
            slice_bytes=slice_bytes, connect_timeout_ms=connect_timeout_ms,
            request_timeout_ms=request_timeout_ms, connections_per_peer=connections_per_peer,
            max_in_flight_requests=max_in_flight_requests)
        self._handshake_options = dict(max_frame_bytes=max_handshake_frame_bytes,
                                       connect_timeout_ms=connect_timeout_ms,
                                       receive_timeout_ms=handshake_client_timeout_ms)
        self.max_notifies = max_notifies
        self._notifies: list[handshake.Notify] = []
        self._segments: dict[str, SegmentDescriptor] = {}
        self.name = ""

    # lifecycle
    async def start(self) -> str:
        """Listen on the handshake and data ports; returns the segment name."""
        self._rpc_port = await self._handshake.start(self.host, self._rpc_port)
        self._data_port = await self._data.start(self.host, self._data_port)
        self._initiator = TcpInitiator(**self._initiator_options)
        self.name = f"{self.host}:{self._rpc_port}"
        return self.name

    async def close(self) -> None:
        await self._handshake.close()
        await self._data.close()
        if self._initiator is not None:
            await self._initiator.close()

    @property
    def rpc_port(self) -> int:
        return self._rpc_port

    @property
    def data_port(self) -> int:
        return self._data_port

    # local memory
    def register_memory(self, address: int, length: int, location: str = "*") -> None:
        self.memory.register(address, length, location)

    def unregister_memory(self, address: int) -> None:
        self.memory.unregister(address)

    def local_descriptor(self) -> SegmentDescriptor:
        return SegmentDescriptor(name=self.name, tcp_data_host=self.host,
                                 tcp_data_port=self._data_port, tcp_proto_version=2,
                                 timestamp=now_timestamp(),
                                 buffers=self.memory.descriptors(self.name))

    # handshake callbacks
    def _on_metadata(self, peer: dict) -> dict:
        return self.local_descriptor().to_json()

    def _on_notify(self, notify: handshake.Notify) -> None:
        if len(self._notifies) >= self.max_notifies:
            log.warning("notify from %r dropped: %d unread notifies", notify.name,
                        len(self._notifies))
            return
        self._notifies.append(notify)

    def take_notifies(self) -> list[handshake.Notify]:
        """The notifies received since the last call (Mooncake's get_notifies)."""
        notifies, self._notifies = self._notifies, []
        return notifies

    # remote segments
    async def open_segment(self, name: str, refresh: bool = False) -> SegmentDescriptor:
        if not refresh and name in self._segments:
            return self._segments[name]
        host, port = _split_segment_name(name)
        try:
            reply = await handshake.exchange(host, port, handshake.METADATA,
                                             self.local_descriptor().to_json(),
                                             **self._handshake_options)
            descriptor = SegmentDescriptor.from_json(reply, default_host=host)
        except (handshake.HandshakeError, DescriptorError) as e:
            raise SegmentError(f"cannot open segment {name}: {e}") from None
        if descriptor.protocol != "tcp":
            raise SegmentError(f"segment {name} speaks {descriptor.protocol!r}, not tcp")
        self._segments[name] = descriptor
        return descriptor

    def forget_segment(self, name: str) -> None:
        self._segments.pop(name, None)

    async def send_notify(self, segment: str, name: str, message: str) -> None:
        host, port = _split_segment_name(segment)
        await handshake.exchange(host, port, handshake.NOTIFY,
                                 {"name": name, "notify_msg": message},
                                 **self._handshake_options)

    async def probe(self, segment: str) -> bool:
        host, port = _split_segment_name(segment)
        try:
            reply = await handshake.exchange(host, port, handshake.PROBE, {},
                                             **self._handshake_options)
        except handshake.HandshakeError:
            return False
        return reply.get("status") == "success"

    # transfers
    def submit(self, requests: list[TransferRequest]) -> TransferBatch:
        """Start every request now; each completes on the loop with its own status."""
        if self._initiator is None:
            raise RuntimeError("start() the endpoint before submitting transfers")
        batch = TransferBatch(list(requests))
        for request, status in zip(batch.requests, batch.statuses):
            batch._tasks.append(asyncio.ensure_future(self._run(request, status)))
        return batch

    async def transfer(self, requests: list[TransferRequest]) -> list[TransferStatus]:
        return await self.submit(requests).wait()

    async def _run(self, request: TransferRequest, status: TransferStatus) -> None:
        def fail(state: TransferState, error: str) -> None:
            status.state, status.error = state, error
            log.info("transfer %s failed: %s", request, error)

        if request.opcode not in (READ, WRITE) or request.length < 0:
            return fail(TransferState.INVALID, "opcode must be READ or WRITE, length >= 0")
        local = self.memory.view(request.local_address, request.length)
        if local is None:
            return fail(TransferState.INVALID, f"local range [{request.local_address:#x}, "
                        f"+{request.length}) is not inside one registered buffer")
        try:
            descriptor = await self.open_segment(request.segment)
        except SegmentError as e:
            return fail(TransferState.FAILED, str(e))
        if descriptor.find_buffer(request.remote_address, request.length) is None:
            # The cached descriptor may be stale: fetch it once more before refusing.
            try:
                descriptor = await self.open_segment(request.segment, refresh=True)
            except SegmentError as e:
                return fail(TransferState.FAILED, str(e))
            if descriptor.find_buffer(request.remote_address, request.length) is None:
                return fail(TransferState.INVALID, f"remote range [{request.remote_address:#x}, "
                            f"+{request.length}) is not inside one buffer of {request.segment}")
        version = 2 if self.proto_version >= 2 and descriptor.tcp_proto_version >= 2 else 1
        target = TransferTarget(descriptor.tcp_data_host, descriptor.tcp_data_port, version)
        try:
            await self._initiator.transfer(request.opcode, local, target, request.remote_address)
        except TransferTimeout as e:
            return fail(TransferState.TIMEOUT, str(e))
        except TransferFailed as e:
            return fail(TransferState.FAILED, str(e))
        status.transferred_bytes = request.length
        status.state = TransferState.COMPLETED


def _split_segment_name(name: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too) of a P2P segment name."""
    host, sep, port = name.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise SegmentError(f"segment name {name!r} is not host:rpc_port")
    return host.strip("[]"), int(port)
