"""A transfer endpoint that speaks Mooncake's Transfer Engine protocols over TCP: one segment
(this process's registered memory) served on a handshake port and a data port, and batches of
READ/WRITE requests against remote segments, with a status per request.

Metadata modes (metadata.py): P2P handshake, where the segment name is `host:rpc_port` and
opening a remote segment sends it a Metadata handshake carrying this segment's descriptor; or
an HTTP metadata server, where this segment publishes its descriptor and handshake address
under its (free-form) name and remote segments are looked up there. Descriptors are cached.
Everything runs on the running asyncio loop; submit() returns at once and the requests
complete on the loop.

The memory served is this process's (RegisteredMemory), or another process's
(process_memory.ProcessMemory: a local client's, which the daemon serves for it): then the
data server and this side's requests copy through staging buffers of staging_bytes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

from . import handshake
from .metadata import (DEFAULT_HTTP_TIMEOUT_MS, P2P_HANDSHAKE, HttpMetadata, MetadataError,
                       descriptor_key, rpc_meta_key)
from .descriptors import (DescriptorError, RegisteredMemory, SegmentDescriptor,
                          now_timestamp)
from .process_memory import ProcessMemoryError
from .mooncake_tcp import (DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_CONNECTIONS_PER_PEER,
                           DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_IN_FLIGHT_REQUESTS,
                           DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RECEIVE_TIMEOUT_MS,
                           DEFAULT_REQUEST_TIMEOUT_MS, DEFAULT_SLICE_BYTES,
                           DEFAULT_STAGING_BYTES, READ, WRITE,
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
    """host: the address peers reach this endpoint at (the segment name's host in P2P mode,
    the descriptor's tcp_data_host); bind_host: where its two ports listen (default: host;
    "0.0.0.0" for every interface). Bounds are constructor parameters (defaults in
    mooncake_tcp and handshake)."""

    def __init__(self, host: str = "127.0.0.1", rpc_port: int = 0, data_port: int = 0, *,
                 bind_host: str | None = None,
                 metadata_server: str = P2P_HANDSHAKE, segment_name: str | None = None,
                 metadata_timeout_ms: int = DEFAULT_HTTP_TIMEOUT_MS,
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
                 max_handshake_connections: int = handshake.DEFAULT_MAX_CONNECTIONS,
                 max_notifies: int = 4096,
                 memory=None, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if proto_version not in (1, 2):
            raise ValueError(f"proto_version must be 1 or 2, not {proto_version}")
        self.host = host
        self.bind_host = bind_host or host
        if metadata_server == P2P_HANDSHAKE:
            if segment_name is not None:
                raise ValueError("in P2P handshake mode the segment name is host:rpc_port")
            self._metadata = None
        else:
            self._metadata = HttpMetadata(metadata_server, timeout_ms=metadata_timeout_ms,
                                          max_response_bytes=max_handshake_frame_bytes)
        self._segment_name = segment_name
        self._rpc_port = rpc_port
        self._data_port = data_port
        self.proto_version = proto_version
        self.memory = memory if memory is not None else RegisteredMemory()
        self.staging_bytes = staging_bytes
        self._max_staged_pieces = max_in_flight_requests
        self._staging_slots: asyncio.Semaphore | None = None  # made on the loop
        self._handshake = handshake.HandshakeServer(
            self._on_metadata, self._on_notify, max_frame_bytes=max_handshake_frame_bytes,
            receive_timeout_ms=handshake_server_timeout_ms,
            max_connections=max_handshake_connections)
        self._data = TcpDataServer(self.memory, slice_bytes=slice_bytes,
                                   max_request_bytes=max_request_bytes,
                                   receive_timeout_ms=data_receive_timeout_ms,
                                   max_connections=max_data_connections,
                                   staging_bytes=staging_bytes)
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
        self._opening: dict[str, asyncio.Future] = {}
        self.name = ""

    # lifecycle
    async def start(self) -> str:
        """Listen on the handshake and data ports; returns the segment name."""
        self._rpc_port = await self._handshake.start(self.bind_host, self._rpc_port)
        self._data_port = await self._data.start(self.bind_host, self._data_port)
        self._initiator = TcpInitiator(**self._initiator_options)
        self.name = self._segment_name or f"{self.host}:{self._rpc_port}"
        if self._metadata is not None:
            await self._metadata.put(rpc_meta_key(self.name),
                                     {"ip_or_host_name": self.host, "rpc_port": self._rpc_port})
            await self.publish()
        return self.name

    async def close(self) -> None:
        if self._metadata is not None and self.name:
            for key in (rpc_meta_key(self.name), descriptor_key(self.name)):
                try:
                    await self._metadata.delete(key)
                except MetadataError as e:
                    log.warning("could not withdraw %s: %s", key, e)
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
    async def register_memory(self, address: int, length: int, location: str = "*") -> None:
        """Serve [address, address + length) to peers; with an HTTP metadata server, returns
        once the new descriptor is published."""
        self.memory.register(address, length, location)
        await self.publish()

    async def unregister_memory(self, address: int) -> None:
        self.memory.unregister(address)
        await self.publish()

    async def publish(self) -> None:
        """Publish this segment's descriptor (HTTP metadata mode; P2P peers fetch it)."""
        if self._metadata is not None and self.name:
            await self._metadata.put(descriptor_key(self.name), self.local_descriptor().to_json())

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
        """The segment's descriptor, cached; concurrent opens of one name share one fetch."""
        if not refresh and name in self._segments:
            return self._segments[name]
        if name in self._opening:
            return await asyncio.shield(self._opening[name])
        future = asyncio.ensure_future(self._fetch_descriptor(name))
        self._opening[name] = future
        try:
            descriptor = await asyncio.shield(future)
        finally:
            if self._opening.get(name) is future:
                del self._opening[name]
        self._segments[name] = descriptor
        return descriptor

    async def _fetch_descriptor(self, name: str) -> SegmentDescriptor:
        try:
            if self._metadata is None:
                host, port = _split_segment_name(name)
                reply = await handshake.exchange(host, port, handshake.METADATA,
                                                 self.local_descriptor().to_json(),
                                                 **self._handshake_options)
            else:
                reply = await self._metadata.get(descriptor_key(name))
                if reply is None:
                    raise SegmentError(f"segment {name} is not published at "
                                       f"{self._metadata.url}")
                host = "" if reply.get("tcp_data_host") else (await self._rpc_address(name))[0]
            descriptor = SegmentDescriptor.from_json(reply, default_host=host)
        except (handshake.HandshakeError, DescriptorError, MetadataError) as e:
            raise SegmentError(f"cannot open segment {name}: {e}") from None
        if descriptor.protocol != "tcp":
            raise SegmentError(f"segment {name} speaks {descriptor.protocol!r}, not tcp")
        return descriptor

    async def _rpc_address(self, segment: str) -> tuple[str, int]:
        """Where the segment's handshake port is: its name in P2P mode, else its rpc_meta."""
        if self._metadata is None:
            return _split_segment_name(segment)
        try:
            value = await self._metadata.get(rpc_meta_key(segment))
        except MetadataError as e:
            raise SegmentError(f"cannot resolve segment {segment}: {e}") from None
        if value is None:
            raise SegmentError(f"segment {segment} is not published at {self._metadata.url}")
        host, port = value.get("ip_or_host_name"), value.get("rpc_port")
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise SegmentError(f"segment {segment}: bad rpc_meta {value!r}")
        return host, port

    def forget_segment(self, name: str) -> None:
        self._segments.pop(name, None)

    async def send_notify(self, segment: str, name: str, message: str) -> None:
        """Raises SegmentError or handshake.HandshakeError when not delivered."""
        host, port = await self._rpc_address(segment)
        await handshake.exchange(host, port, handshake.NOTIFY,
                                 {"name": name, "notify_msg": message},
                                 **self._handshake_options)

    async def probe(self, segment: str) -> bool:
        try:
            host, port = await self._rpc_address(segment)
        except SegmentError:
            return False
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
            batch._tasks.append(asyncio.ensure_future(self._run_settled(request, status)))
        return batch

    async def transfer(self, requests: list[TransferRequest]) -> list[TransferStatus]:
        return await self.submit(requests).wait()

    async def _run_settled(self, request: TransferRequest, status: TransferStatus) -> None:
        """_run, and a status that leaves WAITING whatever happens."""
        try:
            await self._run(request, status)
        except asyncio.CancelledError:
            status.state, status.error = TransferState.CANCELED, "cancelled"
            raise
        except Exception as e:
            log.exception("transfer %s failed unexpectedly", request)
            status.state, status.error = TransferState.FAILED, f"{type(e).__name__}: {e}"

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
            if type(local) is memoryview:
                await self._initiator.transfer(request.opcode, local, target,
                                               request.remote_address)
            else:
                await self._transfer_staged(request.opcode, local, target,
                                            request.remote_address)
        except TransferTimeout as e:
            return fail(TransferState.TIMEOUT, str(e))
        except TransferFailed as e:
            return fail(TransferState.FAILED, str(e))
        except ProcessMemoryError as e:
            return fail(TransferState.FAILED, f"local memory: {e}")
        status.transferred_bytes = request.length
        status.state = TransferState.COMPLETED

    async def _transfer_staged(self, opcode: int, local, target: TransferTarget,
                               remote_address: int) -> None:
        """A request on another process's memory, in pieces of staging_bytes, each through a
        staging buffer of its own: at most max_in_flight_requests pieces (and buffers) at
        once in the endpoint, as many on the wire as the initiator allows."""
        step = self.staging_bytes
        if self._staging_slots is None:
            self._staging_slots = asyncio.Semaphore(self._max_staged_pieces)

        async def move(offset: int) -> None:
            async with self._staging_slots:
                buffer = bytearray(min(step, local.length - offset))
                if opcode == WRITE:
                    local.read_into(offset, buffer)
                await self._initiator.transfer(opcode, memoryview(buffer), target,
                                               remote_address + offset)
                if opcode == READ:
                    local.write_from(offset, buffer)

        results = await asyncio.gather(*(move(offset) for offset in
                                         range(0, local.length, step) or [0]),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


def _split_segment_name(name: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too) of a P2P segment name."""
    host, sep, port = name.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise SegmentError(f"segment name {name!r} is not host:rpc_port")
    return host.strip("[]"), int(port)
