"""What a byte stream of the client protocol should get back, worked out without the daemon.

`expected_requests` walks the frames a client sent (wire/PROTOCOL.md section 3) and says which
requests the daemon must answer and whether the stream holds a frame it must refuse with a
`protocol_error`. `decode_replies` splits what the daemon wrote into frames and checks each
one's shape. Both use msgpack directly, not mooncaked.proto, so a bug in the daemon's codec
shows as a disagreement rather than being repeated here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack

PREFIX = struct.Struct(">II")
U32_MAX = 0xFFFFFFFF


class Finding(AssertionError):
    """Behaviour the fuzz targets refuse: a crash, a hang, a leak, a wrong answer."""


@dataclass
class SentStream:
    msgids: list = field(default_factory=list)  # requests received whole, in order
    methods: list = field(default_factory=list)
    malformed: bool = False  # a frame the daemon must refuse follows those requests


def _decode(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)


def expected_requests(stream: bytes, max_header_bytes: int, max_payload_bytes: int) -> SentStream:
    sent = SentStream()
    position = 0
    while len(stream) - position >= PREFIX.size:
        header_length, payload_length = PREFIX.unpack_from(stream, position)
        if (header_length == 0 or header_length > max_header_bytes
                or payload_length > max_payload_bytes):
            sent.malformed = True
            return sent
        header_end = position + PREFIX.size + header_length
        if header_end > len(stream):
            return sent
        try:
            header = _decode(stream[position + PREFIX.size:header_end])
        except Exception:  # any msgpack failure: malformed
            sent.malformed = True
            return sent
        if (type(header) is not list or len(header) != 4 or type(header[0]) is not int
                or header[0] != 0 or type(header[1]) is not int
                or not 0 <= header[1] <= U32_MAX or type(header[2]) is not str
                or type(header[3]) is not list):
            sent.malformed = True
            return sent
        if header_end + payload_length > len(stream):
            return sent  # the payload did not all arrive: no answer yet
        sent.msgids.append(header[1])
        sent.methods.append(header[2])
        position = header_end + payload_length
    return sent


@dataclass
class Reply:
    msgid: int | None  # None: the protocol_error notification
    error: list | None
    result: object
    payload_length: int


def decode_replies(data: bytes) -> list[Reply]:
    """Every frame the daemon wrote, checked for shape; raises Finding on a bad byte."""
    replies = []
    position = 0
    while position < len(data):
        if len(data) - position < PREFIX.size:
            raise Finding(f"the daemon wrote {len(data) - position} bytes that are not a frame")
        header_length, payload_length = PREFIX.unpack_from(data, position)
        header_end = position + PREFIX.size + header_length
        if header_length == 0 or header_end + payload_length > len(data):
            raise Finding(f"the daemon wrote a truncated frame at byte {position}")
        try:
            header = _decode(data[position + PREFIX.size:header_end])
        except Exception as exc:
            raise Finding(f"the daemon wrote an undecodable header: {exc}") from None
        if (type(header) is list and len(header) == 3 and header[0] == 2
                and header[1] == "protocol_error"):
            error = header[2]
            _check_error(error)
            if payload_length:
                raise Finding("a protocol_error notification with a payload")
            replies.append(Reply(None, error, None, 0))
        elif (type(header) is list and len(header) == 4 and header[0] == 1
                and type(header[1]) is int and 0 <= header[1] <= U32_MAX):
            error = header[2]
            if error is not None:
                _check_error(error)
                if header[3] is not None or payload_length:
                    raise Finding(f"an error response with a result or payload: {header!r:.200}")
            replies.append(Reply(header[1], error, header[3], payload_length))
        else:
            raise Finding(f"the daemon wrote a frame that is neither response nor notification: "
                          f"{header!r:.200}")
        position = header_end + payload_length
    return replies


def _check_error(error) -> None:
    if (type(error) is not list or len(error) != 2 or type(error[0]) is not int
            or type(error[1]) is not str):
        raise Finding(f"a malformed error object: {error!r:.200}")
