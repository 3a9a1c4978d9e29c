"""Wire-protocol helpers shared by the tests: raw sockets to a daemon, frame reading, comparison.

A plain module (not a fixture file): tests import it as `from wire_helpers import ...`, since
pytest puts tests/ on sys.path (there is no tests/__init__.py), as it does for `conftest`.
"""

from __future__ import annotations

import socket

from mooncaked.proto import framing

MAX_HEADER_BYTES = 1 << 20  # the daemon's defaults (conftest does not change them)
MAX_PAYLOAD_BYTES = 1 << 30


# -- values -------------------------------------------------------------------------------------

def same(a, b) -> bool:
    """Equality that also compares types (so True is not 1 and bytes are not str)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


# -- frames as bytes ----------------------------------------------------------------------------

def request_frame(msgid: int, method: str, params: list, payload: bytes = b"") -> bytes:
    return framing.request_head(msgid, method, params, len(payload)) + payload


def split_frames(data: bytes) -> list:
    """The frames in `data`, a whole number of them: [(header, payload), ...]."""
    frames, position = [], 0
    while position < len(data):
        header_length, payload_length = framing.PREFIX.unpack_from(data, position)
        start = position + framing.PREFIX_BYTES
        end = start + header_length + payload_length
        assert end <= len(data), "a truncated frame from the daemon"
        frames.append((framing.unpack_header(data[start:start + header_length], header_length),
                       data[start + header_length:end]))
        position = end
    return frames


# -- raw sockets --------------------------------------------------------------------------------

class PeerClosed(ConnectionResetError, EOFError):
    """The daemon closed the connection mid-read (caught as either EOFError or a reset)."""


def connect(daemon, kind: str, timeout_s: float, *, nodelay: bool = False) -> socket.socket:
    """A raw stream socket to the daemon's TCP port (`kind` "tcp") or Unix socket ("unix")."""
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = daemon.unix_socket
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = ("127.0.0.1", daemon.tcp_port)
    try:
        sock.settimeout(timeout_s)
        sock.connect(target)
        if nodelay and kind != "unix":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise PeerClosed(f"the daemon closed the connection after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def read_header(sock: socket.socket):
    """The next frame's prefix and header: (header, payload_length); the payload is not read."""
    header_length, payload_length = framing.PREFIX.unpack(
        receive_exactly(sock, framing.PREFIX_BYTES))
    header = framing.unpack_header(receive_exactly(sock, header_length), max(header_length, 1))
    return header, payload_length


def read_frame(sock: socket.socket):
    """One frame from the daemon: (header, payload)."""
    header, payload_length = read_header(sock)
    return header, receive_exactly(sock, payload_length)


def read_response(sock: socket.socket):
    """(msgid, error, result, payload) of the next frame; a protocol_error notification raises."""
    header, payload_length = read_header(sock)
    msgid, error, result = framing.parse_response(header)
    return msgid, error, result, receive_exactly(sock, payload_length)

