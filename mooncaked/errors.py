"""Error codes and the exception that carries them.

The numeric codes are Mooncake Store's `ErrorCode` values, so that engines that compare
return values with constants (vLLM checks -200 exactly) behave the same against mooncaked.
Codes in the -3000 range are mooncaked's own (wire and daemon errors Mooncake has no code for).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_REPLICA_BUSY = -714
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    NOT_SUPPORTED = -1012
    # mooncaked's own codes.
    PROTOCOL_ERROR = -3000  # malformed frame or header; the connection is closed after it
    FRAME_TOO_LARGE = -3001  # a frame over the configured bound; the connection is closed
    UNKNOWN_METHOD = -3002
    VERSION_MISMATCH = -3003
    HANDSHAKE_REQUIRED = -3004
    BUSY = -3005  # a configured bound (connections, in-flight requests, objects) is reached
    SHUTTING_DOWN = -3006
    # Cluster: no leader is reachable now; the request was not applied. Retry after a moment.
    NO_LEADER = -3007
    # Cluster: the request reached the log but leadership changed before it was applied: it
    # may or may not take effect. Check (exists / get) before retrying a non-idempotent call.
    OUTCOME_UNKNOWN = -3008
    # The put would take its namespace over its quota (bytes or objects); nothing was stored.
    QUOTA_EXCEEDED = -3009
    # A connection deadline passed (hello, a frame's progress, a payload); sent as a
    # protocol_error notification, then the connection is closed.
    TIMED_OUT = -3010
    # A response would carry more than max_payload_bytes; the connection stays usable.
    RESPONSE_TOO_LARGE = -3011
    # Cluster: this node was removed from the cluster; it serves no cluster data. Ask another
    # node (or restart this one with a fresh data_dir and add it again).
    NOT_A_MEMBER = -3012
    # Authentication and roles (wire/PROTOCOL.md section 4.1).
    AUTH_FAILED = -3020  # hello's credentials were refused; the connection is closed after it
    PERMISSION_DENIED = -3021  # the principal lacks the role a request needs


def code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"ERROR_{code}"


class MooncakedError(Exception):
    """An operation failed with one of the codes above."""

    def __init__(self, code: int, message: str = "") -> None:
        self.code = int(code)
        self.message = message or code_name(code)
        super().__init__(f"{code_name(code)} ({self.code}): {self.message}")


class ObjectNotFound(MooncakedError):
    pass


class NoSpace(MooncakedError):
    pass


class ObjectHasLease(MooncakedError):
    pass


class InvalidParams(MooncakedError):
    pass


_ERROR_CLASSES: dict[int, type[MooncakedError]] = {
    ErrorCode.OBJECT_NOT_FOUND: ObjectNotFound,
    ErrorCode.NO_AVAILABLE_HANDLE: NoSpace,
    ErrorCode.OBJECT_HAS_LEASE: ObjectHasLease,
    ErrorCode.INVALID_PARAMS: InvalidParams,
}


def error_for(code: int, message: str = "") -> MooncakedError:
    """The typed exception for a code (MooncakedError when the code has no class of its own)."""
    return _ERROR_CLASSES.get(code, MooncakedError)(code, message)
