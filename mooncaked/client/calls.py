"""What each client call sends and how its answer is read, shared by both clients.

A `Call` is the method, the params, the request payload (a list of buffers) and a function
that turns the response (result, payload) into the call's return value. The blocking and the
asyncio client only differ in how they move a Call over the socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mooncaked.errors import ErrorCode, error_for

DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class ReplicateConfig:
    """Where and how an object is kept (wire/PROTOCOL.md section 5)."""
    replica_num: int = 1
    preferred_segments: Sequence[str] = ()
    with_soft_pin: bool = False
    soft_pin_ttl_ms: int | None = None
    with_hard_pin: bool = False
    # Write the value to the daemon's disk tier at put end as well; None: as its [ssd]
    # write_through says.
    write_through: bool | None = None

    def to_wire(self) -> dict | None:
        wire: dict[str, Any] = {}
        if self.replica_num != 1:
            wire["replica_num"] = self.replica_num
        if self.preferred_segments:
            wire["preferred_segments"] = list(self.preferred_segments)
        if self.with_soft_pin:
            wire["with_soft_pin"] = True
        if self.soft_pin_ttl_ms is not None:
            wire["soft_pin_ttl_ms"] = self.soft_pin_ttl_ms
        if self.with_hard_pin:
            wire["with_hard_pin"] = True
        if self.write_through is not None:
            wire["write_through"] = self.write_through
        return wire or None


def wire_config(config: ReplicateConfig | None) -> dict | None:
    return None if config is None else config.to_wire()


def _identity(result, payload):
    return result


@dataclass
class Call:
    method: str
    params: list
    payload: list = field(default_factory=list)
    parse: Callable[[Any, bytes | memoryview], Any] = _identity
    # When set, the response payload is received into this writable buffer (blocking client).
    receive_into: Any = None


def check_frame_bounds(server: dict, header_bytes: int, payload_length: int) -> None:
    """Refuse a request over the frame bounds the daemon announced in `hello` before any of
    it is sent: the daemon would close the connection on it. INVALID_PARAMS, and the
    connection stays usable. `server` is the hello result ({} before hello: no check)."""
    max_payload = server.get("max_payload_bytes")
    if max_payload is not None and payload_length > max_payload:
        raise error_for(ErrorCode.INVALID_PARAMS,
                        f"the values of this request are {payload_length} bytes, over the "
                        f"daemon's max_payload_bytes ({max_payload}); nothing was sent")
    max_header = server.get("max_header_bytes")
    if max_header is not None and header_bytes > max_header:
        raise error_for(ErrorCode.INVALID_PARAMS,
                        f"this request's header packs to {header_bytes} bytes, over the "
                        f"daemon's max_header_bytes ({max_header}); nothing was sent")


def hello(namespace: str, client_name: str, **credentials) -> Call:
    """`credentials`: principal and proof, after auth_start (client/auth.py)."""
    return Call("hello", [{"protocol": 1, "namespace": namespace, "client_name": client_name,
                           **credentials}])


def put(key: str, value, config: ReplicateConfig | None) -> Call:
    return Call("put", [key, wire_config(config)], [value])


def upsert(key: str, value, config: ReplicateConfig | None) -> Call:
    return Call("upsert", [key, wire_config(config)], [value], lambda result, payload: None)


def get(key: str, into=None) -> Call:
    if into is not None:
        return Call("get", [key], receive_into=into)
    return Call("get", [key], parse=lambda result, payload: bytes(payload))


def get_staged(key: str, release: list) -> Call:
    """A cluster node's get into its staging area; the result is ([offset or None, size],
    payload): the payload is the value when offset is None."""
    return Call("get_staged", [key, release], parse=lambda result, payload: (result, payload))


def exists(key: str) -> Call:
    return Call("exists", [key])


def get_size(key: str) -> Call:
    return Call("get_size", [key])


def remove(key: str, force: bool) -> Call:
    return Call("remove", [key, force], parse=lambda result, payload: None)


def remove_by_regex(pattern: str, force: bool) -> Call:
    return Call("remove_by_regex", [pattern, force])


def remove_all(force: bool) -> Call:
    return Call("remove_all", [force])


def batch_put(keys: Sequence[str], values: Sequence, config: ReplicateConfig | None) -> Call:
    values = list(values)
    if len(values) != len(keys):
        raise error_for(ErrorCode.INVALID_PARAMS, "keys and values differ in length")
    sizes = [memoryview(v).nbytes for v in values]
    return Call("batch_put", [list(keys), sizes, wire_config(config)], values)


def _split_batch_get(results: list, payload, keep_codes: bool) -> list:
    values, offset = [], 0
    view = memoryview(payload)
    for size in results:
        if size < 0:
            values.append(size if keep_codes else None)
        else:
            values.append(bytes(view[offset:offset + size]))
            offset += size
    return values


def batch_get(keys: Sequence[str], keep_codes: bool = False) -> Call:
    """Per key the value; for a key not read, None (or its error code with `keep_codes`)."""
    return Call("batch_get", [list(keys)],
                parse=lambda result, payload: _split_batch_get(result, payload, keep_codes))


def batch_exists(keys: Sequence[str]) -> Call:
    return Call("batch_exists", [list(keys)],
                parse=lambda result, payload: [bool(r) for r in result])


def batch_remove(keys: Sequence[str], force: bool) -> Call:
    return Call("batch_remove", [list(keys), force])


def put_start(key: str, size: int, config: ReplicateConfig | None) -> Call:
    return Call("put_start", [key, size, wire_config(config)])


def batch_put_start(keys: Sequence[str], sizes: Sequence[int],
                    config: ReplicateConfig | None) -> Call:
    return Call("batch_put_start", [list(keys), list(sizes), wire_config(config)])


def simple(method: str, *params) -> Call:
    return Call(method, list(params))


def reserve(wanted: list, release: list) -> Call:
    """Reserve ranges, [[size, count], ...]; the result lists [segment_id, offset, size]."""
    return Call("reserve", [wanted, release])


def put_commit(key: str, segment_id: int, offset: int, size: int,
               config: ReplicateConfig | None, wanted: list, release: list) -> Call:
    """Store a reserved range as `key`; the result is [stored, newly reserved ranges]."""
    return Call("put_commit", [key, segment_id, offset, size, wire_config(config), wanted,
                               release])


def batch_put_commit(keys: Sequence[str], ranges: list, config: ReplicateConfig | None,
                     wanted: list, release: list) -> Call:
    """Per key store a reserved range ([segment_id, offset, size]); the result is [codes,
    newly reserved ranges]."""
    return Call("batch_put_commit", [list(keys), ranges, wire_config(config), wanted, release])
