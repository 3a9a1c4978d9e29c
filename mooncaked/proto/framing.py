"""Frames and headers of the wire protocol (wire/PROTOCOL.md), with no I/O.

A frame is an 8-byte prefix (header length, payload length; big-endian u32), a msgpack header,
and a raw payload. This module builds prefixes and headers and checks decoded headers' shapes;
it never reads a socket. Limits on untrusted input are passed in, never assumed.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from mooncaked.errors import ErrorCode, MooncakedError, error_for

PROTOCOL_VERSION = 1

PREFIX = struct.Struct(">II")
PREFIX_BYTES = PREFIX.size
U32_MAX = 0xFFFFFFFF

REQUEST = 0
RESPONSE = 1
NOTIFICATION = 2

_packer = msgpack.Packer(use_bin_type=True)


def pack_header(header: Any) -> bytes:
    return _packer.pack(header)


def frame_head(header: Any, payload_length: int = 0) -> bytes:
    """Prefix and packed header of a frame; the payload is sent after it, separately."""
    packed = _packer.pack(header)
    return PREFIX.pack(len(packed), payload_length) + packed


def request_head(msgid: int, method: str, params: list, payload_length: int = 0) -> bytes:
    return frame_head([REQUEST, msgid, method, params], payload_length)


def response_head(msgid: int, result: Any, payload_length: int = 0) -> bytes:
    return frame_head([RESPONSE, msgid, None, result], payload_length)


def error_head(msgid: int, code: int, message: str) -> bytes:
    return frame_head([RESPONSE, msgid, [int(code), message], None])


def protocol_error_head(code: int, message: str) -> bytes:
    return frame_head([NOTIFICATION, "protocol_error", [int(code), message]])


def check_prefix(header_length: int, payload_length: int, max_header_bytes: int,
                 max_payload_bytes: int) -> None:
    """Raise FRAME_TOO_LARGE / PROTOCOL_ERROR for a prefix outside the bounds."""
    if header_length == 0:
        raise MooncakedError(ErrorCode.PROTOCOL_ERROR, "empty header")
    if header_length > max_header_bytes:
        raise MooncakedError(ErrorCode.FRAME_TOO_LARGE,
                             f"header of {header_length} bytes exceeds {max_header_bytes}")
    if payload_length > max_payload_bytes:
        raise MooncakedError(ErrorCode.FRAME_TOO_LARGE,
                             f"payload of {payload_length} bytes exceeds {max_payload_bytes}")


def unpack_header(data, max_header_bytes: int) -> Any:
    """Decode exactly one msgpack object; malformed or trailing bytes are a protocol error."""
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_header_bytes, max_bin_len=max_header_bytes,
            max_array_len=max_header_bytes, max_map_len=max_header_bytes,
            max_ext_len=max_header_bytes)
    except Exception as exc:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise MooncakedError(ErrorCode.PROTOCOL_ERROR, f"malformed header: {exc}") from None


def parse_request(header: Any) -> tuple[int, str, list]:
    """Check a decoded header is `[0, msgid, method, params]`; return its parts."""
    if (type(header) is not list or len(header) != 4 or type(header[0]) is not int
            or header[0] != REQUEST or type(header[1]) is not int or not 0 <= header[1] <= U32_MAX
            or type(header[2]) is not str or type(header[3]) is not list):
        raise MooncakedError(ErrorCode.PROTOCOL_ERROR,
                             "a request must be [0, msgid:u32, method:str, params:array]")
    return header[1], header[2], header[3]


def parse_response(header: Any) -> tuple[int, Any, Any]:
    """Check a decoded header is a response (or the daemon's protocol_error notification).

    Returns (msgid, error, result); a notification raises the error it carries.
    """
    if (type(header) is list and len(header) == 3 and type(header[0]) is int
            and header[0] == NOTIFICATION):
        code, message = _error_parts(header[2])
        raise MooncakedError(code, message)
    if (type(header) is not list or len(header) != 4 or type(header[0]) is not int
            or header[0] != RESPONSE or type(header[1]) is not int):
        raise MooncakedError(ErrorCode.PROTOCOL_ERROR, f"not a response: {header!r:.200}")
    return header[1], header[2], header[3]


def _error_parts(error: Any) -> tuple[int, str]:
    if (type(error) is list and len(error) == 2 and type(error[0]) is int
            and type(error[1]) is str):
        return error[0], error[1]
    return int(ErrorCode.PROTOCOL_ERROR), f"malformed error object: {error!r:.200}"


def raise_error(error: Any) -> None:
    code, message = _error_parts(error)
    raise error_for(code, message)
