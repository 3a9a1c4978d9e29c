"""Transfer segments the daemon serves for its local clients (wire/PROTOCOL.md section 9,
README "Transfer layer"): the `te_*` methods, which mooncaked.transfer_engine.TransferEngine
speaks.

A client on the Unix socket opens one segment per connection (te_open): the daemon starts, on
its own loop, a transfer endpoint for it (a handshake listener and a data listener; in P2P
mode the segment name is `host:rpc_port`, in HTTP metadata mode the descriptor is published),
whose registered memory is the client's own, reached with process_vm_readv / writev by the
pid SO_PEERCRED names (transfer/process_memory.py). The client's batches run on the loop;
their statuses are read with te_status or te_wait. The segment closes with its connection.
Other connections of the same process may attach to it (te_attach, with the token te_open
returned), so that the client's threads each use a connection of their own.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import logging
import secrets
import socket
from typing import Any

from mooncaked.daemon.connection import Reply
from mooncaked.daemon.fd_handover import peer_pid
from mooncaked.daemon.params import arity, invalid, optional
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.transfer import (READ, WRITE, SegmentError, TransferEndpoint, TransferRequest,
                                TransferState)
from mooncaked.transfer.handshake import HandshakeError
from mooncaked.transfer.metadata import P2P_HANDSHAKE, MetadataError
from mooncaked.transfer.process_memory import ProcessMemory, ProcessMemoryError

log = logging.getLogger("mooncaked.transfer.segments")

_NULL = Reply(None)
_OPEN_KEYS = frozenset({"local_hostname", "metadata_server", "protocol", "device_name"})
PORT_ATTEMPTS = 16  # picks of a port pair in [port_min, port_max] before giving up


class _Batch:
    """One te_submit: its requests on the endpoint, and the notify sent when all succeeded."""

    def __init__(self, batch, finish: asyncio.Future) -> None:
        self.batch = batch
        self.finish = finish  # done when every request is done and the notify was sent

    def statuses(self) -> list:
        return [[int(s.state), s.transferred_bytes, s.error] for s in self.batch.statuses]


class ClientSegment:
    """One client's segment: its endpoint, its batches and its counters."""

    def __init__(self, connection_id: int, pid: int, endpoint: TransferEndpoint) -> None:
        self.connection_id = connection_id
        self.pid = pid
        self.endpoint = endpoint
        self.batches: dict[int, _Batch] = {}
        self.held_requests = 0  # requests of batches not yet freed
        self.next_batch_id = 1
        self.submitted_requests = 0
        self.completed_requests = 0
        self.failed_requests = 0
        self.attach_token = secrets.token_hex(16)
        self.attached: set[int] = set()  # connection ids of the other connections using it

    def report(self) -> dict:
        data = self.endpoint._data
        return {"segment": self.endpoint.name, "pid": self.pid,
                "connection_id": self.connection_id,
                "attached_connections": len(self.attached),
                "rpc_port": self.endpoint.rpc_port, "data_port": self.endpoint.data_port,
                "buffers": len(self.endpoint.memory),
                "registered_bytes": self.endpoint.memory.registered_bytes(),
                "batches": len(self.batches), "requests_held": self.held_requests,
                "requests_submitted": self.submitted_requests,
                "requests_completed": self.completed_requests,
                "requests_failed": self.failed_requests,
                "served_requests": sum(data.served_requests.values()),
                "refused_requests": data.rejected_requests,
                "data_connections": len(data.connections)}


class TransferSegments:
    def __init__(self, settings) -> None:
        self.settings = settings  # config.TransferConfig
        self.segments: dict[int, ClientSegment] = {}  # by the owning connection's id
        self.attached: dict[int, ClientSegment] = {}  # by an attached connection's id
        self._closing: set[asyncio.Task] = set()
        self._opening = 0  # te_opens under way (they count against max_segments)

    # lifecycle
    async def open(self, conn, options: dict) -> dict:
        s = self.settings
        if conn.connection_id in self.segments or conn.connection_id in self.attached:
            raise MooncakedError(ErrorCode.SEGMENT_ALREADY_EXISTS,
                                 "this connection already has a transfer segment "
                                 f"({self.segment(conn).endpoint.name})")
        if len(self.segments) + self._opening >= s.max_segments:
            raise MooncakedError(ErrorCode.BUSY, f"{s.max_segments} transfer segments are "
                                 "open ([transfer] max_segments)")
        self._opening += 1
        try:
            return await self._open(conn, options)
        finally:
            self._opening -= 1

    async def _open(self, conn, options: dict) -> dict:
        s = self.settings
        host, port = _hostname(options.get("local_hostname"))
        metadata = options.get("metadata_server", P2P_HANDSHAKE)
        if type(metadata) is not str or not (metadata == P2P_HANDSHAKE
                                             or metadata.startswith("http://")):
            raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                                 f"metadata_server {metadata!r}: only \"P2PHANDSHAKE\" and "
                                 "http://host:port/path are supported")
        protocol = options.get("protocol", "tcp")
        if protocol != "tcp":
            raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                                 f"protocol {protocol!r}: only \"tcp\" is supported")
        pid = peer_pid(conn.transport.get_extra_info("socket"))
        segment_name = None if metadata == P2P_HANDSHAKE else \
            (f"{host}:{port}" if port else host)
        if segment_name is not None:
            # The name is free-form in HTTP mode: advertise a reachable address.
            host = await self._advertised_host(host)
        last_error: Exception | None = None
        for _ in range(PORT_ATTEMPTS):
            rpc_port, data_port = self._ports(host, port)
            endpoint = TransferEndpoint(
                host, rpc_port, data_port, bind_host=s.bind_host or None,
                metadata_server=metadata, segment_name=segment_name,
                memory=ProcessMemory(pid), staging_bytes=s.staging_bytes,
                connect_timeout_ms=s.connect_timeout_ms,
                request_timeout_ms=s.request_timeout_ms,
                data_receive_timeout_ms=s.receive_timeout_ms,
                connections_per_peer=s.connections_per_peer,
                max_in_flight_requests=s.max_in_flight_requests,
                max_data_connections=s.max_data_connections)
            try:
                name = await endpoint.start()
            except OSError as e:
                await endpoint.close()
                if e.errno != errno.EADDRINUSE:
                    raise MooncakedError(ErrorCode.INVALID_PARAMS, f"cannot listen on "
                                         f"{s.bind_host or host}: {e}") from None
                last_error = e  # a port taken meanwhile: pick again
                continue
            except (MetadataError, ValueError) as e:
                await endpoint.close()
                raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                     f"cannot publish the segment: {e}") from None
            break
        else:
            raise MooncakedError(ErrorCode.BUSY, f"no free ports for a transfer segment on "
                                 f"{s.bind_host or host}: {last_error}")
        if conn.transport is None or conn.transport.is_closing():
            await endpoint.close()  # the client left while the segment started
            raise MooncakedError(ErrorCode.RPC_FAIL, "connection closed")
        segment = ClientSegment(conn.connection_id, pid, endpoint)
        self.segments[conn.connection_id] = segment
        log.info("transfer segment %s opened for pid %d", name, pid)
        return {"segment": name, "rpc_port": endpoint.rpc_port,
                "data_port": endpoint.data_port, "daemon_pid": conn.daemon.pid,
                "attach_token": segment.attach_token}

    def attach(self, conn, name: str, token: str) -> None:
        if conn.connection_id in self.segments or conn.connection_id in self.attached:
            raise MooncakedError(ErrorCode.SEGMENT_ALREADY_EXISTS,
                                 "this connection already has a transfer segment "
                                 f"({self.segment(conn).endpoint.name})")
        pid = peer_pid(conn.transport.get_extra_info("socket"))
        for segment in self.segments.values():
            if segment.endpoint.name == name and segment.pid == pid and \
                    hmac.compare_digest(segment.attach_token.encode(), token.encode()):
                segment.attached.add(conn.connection_id)
                self.attached[conn.connection_id] = segment
                return
        raise MooncakedError(ErrorCode.SEGMENT_NOT_FOUND, f"no transfer segment {name!r} of "
                             f"this process (pid {pid}) with that token")

    async def _advertised_host(self, host: str) -> str:
        """`host` when it resolves; else [transfer] bind_host when that is one address."""
        try:
            await asyncio.get_running_loop().getaddrinfo(host, None)
            return host
        except OSError:
            pass
        bind = self.settings.bind_host
        if bind and bind not in ("0.0.0.0", "::"):
            return bind
        raise MooncakedError(ErrorCode.INVALID_PARAMS,
                             f"local_hostname {host!r} is not an address peers can reach; "
                             "name one, or set [transfer] bind_host to one")

    def _ports(self, host: str, asked: int) -> tuple[int, int]:
        """(rpc_port, data_port): the asked rpc port, or 0 (any), or two free ones of the
        configured range."""
        s = self.settings
        if not s.port_min:
            return asked, 0
        bind = s.bind_host or host
        found = []
        for port in range(s.port_min, s.port_max + 1):
            if asked and not found:
                found.append(asked)
                continue
            if port in found:
                continue
            if _port_free(bind, port):
                found.append(port)
                if len(found) == 2:
                    return found[0], found[1]
        raise MooncakedError(ErrorCode.BUSY, f"no two free ports in [transfer] port range "
                             f"{s.port_min}-{s.port_max}")

    def connection_closed(self, conn) -> None:
        attached = self.attached.pop(conn.connection_id, None)
        if attached is not None:
            attached.attached.discard(conn.connection_id)
            return
        segment = self.segments.pop(conn.connection_id, None)
        if segment is not None:
            for connection_id in segment.attached:
                self.attached.pop(connection_id, None)
            segment.attached.clear()
            task = asyncio.ensure_future(self._close(segment))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, segment: ClientSegment) -> None:
        for batch in segment.batches.values():
            batch.finish.cancel()
        segment.batches.clear()
        try:
            await segment.endpoint.close()
        except Exception:
            log.exception("closing transfer segment %s", segment.endpoint.name)
        log.info("transfer segment %s of pid %d closed", segment.endpoint.name, segment.pid)

    async def close_all(self) -> None:
        self.attached.clear()
        for connection_id in list(self.segments):
            segment = self.segments.pop(connection_id)
            await self._close(segment)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def report(self) -> dict:
        return {"segments": [s.report() for s in self.segments.values()]}

    def segment(self, conn) -> ClientSegment:
        segment = self.segments.get(conn.connection_id) or self.attached.get(conn.connection_id)
        if segment is None:
            raise MooncakedError(ErrorCode.SEGMENT_NOT_FOUND,
                                 "no transfer segment on this connection: send te_open first")
        return segment

    # batches
    def submit(self, segment: ClientSegment, requests: list[TransferRequest],
               notify: tuple[str, str] | None) -> int:
        if segment.held_requests + len(requests) > self.settings.max_requests_per_segment:
            raise MooncakedError(ErrorCode.BUSY, f"{segment.held_requests} requests held: "
                                 f"over [transfer] max_requests_per_segment "
                                 f"({self.settings.max_requests_per_segment}); free finished "
                                 "batches (te_wait, te_free)")
        batch = segment.endpoint.submit(requests)
        segment.submitted_requests += len(requests)
        segment.held_requests += len(requests)

        async def finish() -> None:
            statuses = await batch.wait()
            for status in statuses:
                if status.state == TransferState.COMPLETED:
                    segment.completed_requests += 1
                else:
                    segment.failed_requests += 1
            if notify is not None and not batch.failed and requests:
                try:
                    await segment.endpoint.send_notify(requests[0].segment, *notify)
                except (SegmentError, HandshakeError) as e:
                    log.info("notify to %s not delivered: %s", requests[0].segment, e)

        batch_id = segment.next_batch_id
        segment.next_batch_id += 1
        future = asyncio.ensure_future(finish())
        segment.batches[batch_id] = _Batch(batch, future)
        return batch_id

    def batch(self, segment: ClientSegment, batch_id: Any) -> _Batch:
        if type(batch_id) is not int or batch_id not in segment.batches:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, f"no batch {batch_id!r} on this "
                                 "segment (never submitted, or freed)")
        return segment.batches[batch_id]

    def free(self, segment: ClientSegment, batch_id: int) -> None:
        batch = segment.batches.pop(batch_id)
        segment.held_requests -= len(batch.batch.requests)
        if not batch.finish.done():
            batch.finish.cancel()  # its requests finish on the loop; nobody reads them


def _hostname(value: Any) -> tuple[str, int]:
    """`host` or `host:port` (`[v6]:port`) of te_open's local_hostname."""
    if type(value) is not str or not value:
        raise invalid("local_hostname must be a non-empty str (the address peers reach the "
                      "segment at)")
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and host and (host.startswith("[") or ":" not in host):
        if not 0 < int(port) < 65536:
            raise invalid(f"local_hostname {value!r}: port out of range")
        return host.strip("[]"), int(port)
    return value, 0


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


# -- handlers (the te_* wire methods) -----------------------------------------------------------

def _transfer(conn) -> TransferSegments:
    transfer = conn.daemon.transfer
    if transfer is None:
        raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                             "the transfer engine is off ([transfer] enabled = false)")
    if conn.transport_kind != "unix":
        raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                             "transfer segments are for local clients: use the Unix socket")
    return transfer


def _checked_first(handler):
    """A te_* coroutine handler whose first checks (the engine is on, a Unix socket) raise
    before a task is made: those errors answer at once, as a synchronous handler's do."""
    @functools.wraps(handler)
    def checked(conn, params: list, payload_length: int):
        _transfer(conn)
        return handler(conn, params, payload_length)
    return checked


@_checked_first
async def handle_te_open(conn, params: list, payload_length: int):
    transfer = _transfer(conn)
    arity(params, 1, 1, "[options]")
    options = params[0]
    if type(options) is not dict:
        raise invalid("te_open takes one map")
    unknown = set(options) - _OPEN_KEYS
    if unknown:
        raise invalid(f"unknown te_open keys: {', '.join(sorted(map(str, unknown)))}")
    return Reply(await transfer.open(conn, options))


def handle_te_attach(conn, params: list, payload_length: int) -> Reply:
    transfer = _transfer(conn)
    arity(params, 2, 2, "[segment, attach_token]")
    if any(type(p) is not str for p in params):
        raise invalid("segment and attach_token must be strs")
    transfer.attach(conn, params[0], params[1])
    return _NULL


def _ranges(value: Any) -> list[tuple[int, int]]:
    if type(value) is not list or not value:
        raise invalid("buffers must be a non-empty list of [address, length]")
    ranges = []
    for item in value:
        if (type(item) is not list or len(item) != 2 or type(item[0]) is not int
                or type(item[1]) is not int or item[0] <= 0 or item[1] <= 0):
            raise invalid(f"buffer {item!r} is not [address > 0, length > 0]")
        ranges.append((item[0], item[1]))
    return ranges


@_checked_first
async def handle_te_register(conn, params: list, payload_length: int):
    transfer = _transfer(conn)
    segment = transfer.segment(conn)
    arity(params, 1, 2, "[buffers, location?]")
    ranges = _ranges(params[0])
    location = optional(params, 1, "*")
    if type(location) is not str or not location:
        raise invalid("location must be a non-empty str")
    memory = segment.endpoint.memory
    done = []
    try:
        for address, length in ranges:
            memory.register(address, length, location)
            done.append(address)
    except ProcessMemoryError as e:
        for address in done:
            memory.unregister(address)
        raise MooncakedError(ErrorCode.INVALID_PARAMS, f"cannot reach the memory: {e}") from None
    except (ValueError, TypeError) as e:
        for address in done:
            memory.unregister(address)
        raise invalid(str(e)) from None
    try:
        await segment.endpoint.publish()
    except MetadataError as e:
        raise MooncakedError(ErrorCode.RPC_FAIL, f"registered, but not published: {e}") from None
    return _NULL


@_checked_first
async def handle_te_unregister(conn, params: list, payload_length: int):
    segment = _transfer(conn).segment(conn)
    arity(params, 1, 1, "[addresses]")
    addresses = params[0]
    if type(addresses) is not list or not addresses or \
            any(type(a) is not int for a in addresses):
        raise invalid("addresses must be a non-empty list of ints")
    memory = segment.endpoint.memory
    registered = {buffer.address for buffer in memory.descriptors("")}
    missing = [a for a in addresses if a not in registered]
    if missing:
        raise invalid(f"no buffer registered at {', '.join(hex(a) for a in missing)}")
    for address in addresses:
        memory.unregister(address)
    try:
        await segment.endpoint.publish()
    except MetadataError as e:
        raise MooncakedError(ErrorCode.RPC_FAIL, f"unregistered, but not published: {e}") \
            from None
    return _NULL


def _request(item: Any) -> TransferRequest:
    if type(item) is not list or len(item) != 5:
        raise invalid(f"request {item!r} is not [opcode, local_address, segment, "
                      "remote_address, length]")
    opcode, local, segment, remote, length = item
    if opcode not in (READ, WRITE) or type(opcode) is not int:
        raise invalid(f"opcode {opcode!r} is not 0 (READ) or 1 (WRITE)")
    for name, value in (("local_address", local), ("remote_address", remote),
                        ("length", length)):
        if type(value) is not int or value < 0 or value >= 1 << 64:
            raise invalid(f"{name} {value!r} is not a u64")
    if type(segment) is not str or not segment:
        raise invalid("segment must be a non-empty str")
    return TransferRequest(opcode, local, segment, remote, length)


def handle_te_submit(conn, params: list, payload_length: int) -> Reply:
    transfer = _transfer(conn)
    segment = transfer.segment(conn)
    arity(params, 1, 2, "[requests, notify?]")
    if type(params[0]) is not list or not params[0]:
        raise invalid("requests must be a non-empty list")
    requests = [_request(item) for item in params[0]]
    notify = optional(params, 1, None)
    if notify is not None:
        if type(notify) is not list or len(notify) != 2 or \
                any(type(n) is not str for n in notify):
            raise invalid("notify must be [name, message]")
        notify = (notify[0], notify[1])
    return Reply(transfer.submit(segment, requests, notify))


def handle_te_status(conn, params: list, payload_length: int) -> Reply:
    transfer = _transfer(conn)
    segment = transfer.segment(conn)
    arity(params, 1, 1, "[batch_id]")
    batch = transfer.batch(segment, params[0])
    return Reply({"done": batch.finish.done(), "statuses": batch.statuses()})


@_checked_first
async def handle_te_wait(conn, params: list, payload_length: int):
    transfer = _transfer(conn)
    segment = transfer.segment(conn)
    arity(params, 1, 1, "[batch_id]")
    batch_id = params[0]
    batch = transfer.batch(segment, batch_id)
    await asyncio.shield(batch.finish)
    statuses = batch.statuses()
    if segment.batches.get(batch_id) is batch:
        transfer.free(segment, batch_id)
    return Reply(statuses)


def handle_te_free(conn, params: list, payload_length: int) -> Reply:
    transfer = _transfer(conn)
    segment = transfer.segment(conn)
    arity(params, 1, 1, "[batch_id]")
    transfer.batch(segment, params[0])
    transfer.free(segment, params[0])
    return _NULL


@_checked_first
async def handle_te_buffers(conn, params: list, payload_length: int):
    segment = _transfer(conn).segment(conn)
    arity(params, 1, 1, "[segment]")
    name = params[0]
    if type(name) is not str or not name:
        raise invalid("segment must be a non-empty str")
    endpoint = segment.endpoint
    if name == endpoint.name:
        buffers = endpoint.memory.descriptors(name)
    else:
        try:
            buffers = (await endpoint.open_segment(name, refresh=True)).buffers
        except SegmentError as e:
            raise MooncakedError(ErrorCode.SEGMENT_NOT_FOUND, str(e)) from None
    return Reply([[b.address, b.length, b.name] for b in buffers])


@_checked_first
async def handle_te_notify(conn, params: list, payload_length: int):
    segment = _transfer(conn).segment(conn)
    arity(params, 3, 3, "[segment, name, message]")
    if any(type(p) is not str for p in params) or not params[0]:
        raise invalid("segment, name and message must be strs (segment non-empty)")
    try:
        await segment.endpoint.send_notify(params[0], params[1], params[2])
    except (SegmentError, HandshakeError) as e:
        raise MooncakedError(ErrorCode.TRANSFER_FAIL, f"notify not delivered: {e}") from None
    return _NULL


def handle_te_notifies(conn, params: list, payload_length: int) -> Reply:
    segment = _transfer(conn).segment(conn)
    arity(params, 0, 0, "[]")
    return Reply([[n.name, n.message] for n in segment.endpoint.take_notifies()])


@_checked_first
async def handle_te_probe(conn, params: list, payload_length: int):
    segment = _transfer(conn).segment(conn)
    arity(params, 1, 1, "[segment]")
    if type(params[0]) is not str or not params[0]:
        raise invalid("segment must be a non-empty str")
    return Reply(await segment.endpoint.probe(params[0]))


def handle_te_close(conn, params: list, payload_length: int) -> Reply:
    transfer = _transfer(conn)
    arity(params, 0, 0, "[]")
    transfer.segment(conn)
    transfer.connection_closed(conn)
    return _NULL


HANDLERS = {name[len("handle_"):]: function for name, function in globals().items()
            if name.startswith("handle_te_")}
