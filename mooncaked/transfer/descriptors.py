"""Segments, buffers and this process's registered memory.

A segment is the address space one transfer endpoint exposes under a unique name (in P2P
handshake mode `host:rpc_port`); a buffer is one registered contiguous range of it, named by
its absolute virtual address and length. A remote request names an absolute address, and the
whole range `[address, address + length)` must lie inside one buffer: a range that straddles
two adjacent buffers is refused, as Mooncake refuses it.

`RegisteredMemory` is the local side: memory this process can reach (an mmap, a ctypes array,
a tensor's storage), registered as (address, length). Only it hands out views of memory, so
the data server and the initiator can touch nothing outside a registered range.
"""

from __future__ import annotations

import bisect
import ctypes
import time
from dataclasses import dataclass, field


class DescriptorError(ValueError):
    """A segment descriptor that is not the JSON object this protocol defines."""


@dataclass(frozen=True)
class BufferDescriptor:
    name: str  # the location tag ("cpu:0", or the segment name for "*")
    address: int
    length: int

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length


@dataclass
class SegmentDescriptor:
    """What a segment publishes (Metadata handshake reply, or the HTTP metadata value)."""
    name: str
    tcp_data_host: str
    tcp_data_port: int
    tcp_proto_version: int = 2
    protocol: str = "tcp"
    timestamp: str = ""
    buffers: list[BufferDescriptor] = field(default_factory=list)

    def find_buffer(self, address: int, length: int) -> BufferDescriptor | None:
        for buffer in self.buffers:
            if buffer.contains(address, length):
                return buffer
        return None

    def to_json(self) -> dict:
        return {
            "buffers": [{"addr": b.address, "length": b.length, "name": b.name}
                        for b in self.buffers],
            "name": self.name,
            "protocol": self.protocol,
            "rdma_server_name": "",
            "tcp_data_host": self.tcp_data_host,
            "tcp_data_port": self.tcp_data_port,
            "tcp_proto_version": self.tcp_proto_version,
            "timestamp": self.timestamp,
        }

    @classmethod
    def from_json(cls, value: object, default_host: str = "") -> SegmentDescriptor:
        """Parse a peer's descriptor. default_host: the host to dial when the descriptor has
        no `tcp_data_host` (older builds): the host part of the segment name."""
        if not isinstance(value, dict):
            raise DescriptorError("a segment descriptor must be a JSON object")
        name = _field(value, "name", str)
        protocol = _field(value, "protocol", str)
        buffers = []
        for item in _field(value, "buffers", list, []):
            if not isinstance(item, dict):
                raise DescriptorError("each buffer must be a JSON object")
            address = _field(item, "addr", int)
            length = _field(item, "length", int)
            if address < 0 or length < 0 or address + length > 1 << 64:
                raise DescriptorError(f"buffer [{address}, +{length}) is not a 64-bit range")
            buffers.append(BufferDescriptor(_field(item, "name", str, ""), address, length))
        port = _field(value, "tcp_data_port", int, 0)
        if protocol == "tcp" and not 0 < port < 65536:
            raise DescriptorError(f"tcp_data_port {port} is not a TCP port")
        return cls(name=name, protocol=protocol,
                   tcp_data_host=_field(value, "tcp_data_host", str, "") or default_host,
                   tcp_data_port=port,
                   tcp_proto_version=_field(value, "tcp_proto_version", int, 1),
                   timestamp=_field(value, "timestamp", str, ""), buffers=buffers)


def _field(obj: dict, key: str, kind: type, default: object = None):
    if key not in obj:
        if default is None:
            raise DescriptorError(f"segment descriptor lacks {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DescriptorError(f"{key!r} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def now_timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


class RegisteredMemory:
    """This process's registered buffers: sorted, non-overlapping (address, length) ranges.

    register() trusts that the caller owns the range (as Mooncake's register_memory does);
    everything after that is checked here: a view is handed out only for a range inside one
    registered buffer. A subclass reaches the memory another way by overriding `_attach`
    (called once per buffer at registration; what it returns is kept with the buffer) and
    `_range` (the view of a part of one buffer)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._buffers: dict[int, tuple[int, str, object]] = {}  # start -> (length, location, handle)

    def register(self, address: int, length: int, location: str = "*") -> None:
        if type(address) is not int or type(length) is not int:
            raise TypeError("address and length must be integers")
        if address <= 0 or length <= 0 or address + length > 1 << 64:
            raise ValueError(f"cannot register [{address:#x}, +{length}): "
                             "address and length must be positive and in 64-bit range")
        at = bisect.bisect_right(self._starts, address)
        if at > 0:
            prev = self._starts[at - 1]
            if prev + self._buffers[prev][0] > address:
                raise ValueError(f"[{address:#x}, +{length}) overlaps the buffer at {prev:#x}")
        if at < len(self._starts) and self._starts[at] < address + length:
            raise ValueError(f"[{address:#x}, +{length}) overlaps the buffer at "
                             f"{self._starts[at]:#x}")
        handle = self._attach(address, length)
        self._starts.insert(at, address)
        self._buffers[address] = (length, location, handle)

    def _attach(self, address: int, length: int) -> memoryview:
        return memoryview((ctypes.c_char * length).from_address(address)).cast("B")

    def unregister(self, address: int) -> None:
        if address not in self._buffers:
            raise KeyError(f"no buffer registered at {address:#x}")
        self._starts.remove(address)
        # Views handed out for transfers in flight keep pointing at the memory: like
        # Mooncake, the caller must not free memory while transfers on it are in flight.
        del self._buffers[address]

    def view(self, address: int, length: int):
        """A writable view of [address, address + length) when one buffer holds all of it,
        else None."""
        if length < 0:
            return None
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return None
        start = self._starts[at]
        size, _, handle = self._buffers[start]
        offset = address - start
        if offset + length > size:
            return None
        return self._range(handle, start, offset, length)

    def _range(self, handle: memoryview, start: int, offset: int, length: int) -> memoryview:
        return handle[offset:offset + length]

    def descriptors(self, segment_name: str) -> list[BufferDescriptor]:
        return [BufferDescriptor(segment_name if self._buffers[s][1] == "*" else self._buffers[s][1],
                                 s, self._buffers[s][0]) for s in self._starts]

    def registered_bytes(self) -> int:
        return sum(length for length, _, _ in self._buffers.values())

    def __len__(self) -> int:
        return len(self._starts)
