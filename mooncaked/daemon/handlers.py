"""Request handlers: one `handle_<method>` per wire method (wire/PROTOCOL.md section 5).

A handler checks its params, calls the master, and returns a Reply or an Incoming (see
daemon/connection.py). It does no I/O of its own.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from mooncaked import __version__
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.daemon import params as params_module
from mooncaked.daemon import transfer_segments
from mooncaked.daemon.connection import Incoming, Reply
from mooncaked.daemon.fd_handover import peer_pid
from mooncaked.meta.commands import QUOTA_DEFAULT, RESERVED_NAMESPACE
from mooncaked.meta.master import ReplicateConfig
from mooncaked.proto import framing, scram

NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._:/-]{1,255}")  # the whole name: fullmatch
ALL_NAMESPACES = "*"
DEFAULT_LIST_LIMIT = 1000

# The methods whose request carries a payload. The connection refuses a payload sent to any
# other method before its handler runs (daemon/connection.py), so the refusal has no effect.
PAYLOAD_METHODS = frozenset({"put", "upsert", "batch_put"})

_TRUE = Reply(True)
_FALSE = Reply(False)
_ZERO = Reply(0)

# The checks of request params, shared with the cluster's handlers (daemon/params.py).
_invalid = params_module.invalid
_arity = params_module.arity
_optional = params_module.optional
_bool = params_module.as_bool
_int = params_module.as_int
_key = params_module.key
_keys = params_module.keys
_sizes = params_module.sizes
_replicate_config = params_module.replicate_config


# -- handshake ----------------------------------------------------------------------------------

def handle_hello(conn, params: list, payload_length: int) -> Reply:
    if conn.namespace is not None:
        raise MooncakedError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
                             f"hello was already sent on this connection (namespace "
                             f"{conn.namespace!r}); open a new connection for another")
    _arity(params, 1, 1, "[options]")
    options = params[0]
    if type(options) is not dict:
        raise _invalid("hello takes one map")
    unknown = set(options) - {"protocol", "namespace", "client_name", "principal", "proof"}
    if unknown:
        raise _invalid(f"unknown hello keys: {', '.join(sorted(map(str, unknown)))}")
    if options.get("protocol") != framing.PROTOCOL_VERSION:
        raise MooncakedError(ErrorCode.VERSION_MISMATCH,
                             f"this daemon speaks protocol {framing.PROTOCOL_VERSION}, "
                             f"the client asked for {options.get('protocol')!r}")
    namespace = options.get("namespace", "default")
    if type(namespace) is not str or not NAMESPACE_PATTERN.fullmatch(namespace):
        raise _invalid("namespace must be 1-255 bytes, each of [A-Za-z0-9._:/-]")
    client_name = options.get("client_name", "")
    if type(client_name) is not str:
        raise _invalid("client_name must be a str")
    daemon = conn.daemon
    if daemon.auth is not None:
        authenticated = daemon.auth.authenticate(conn, options, namespace)
    elif "principal" in options or "proof" in options:
        raise MooncakedError(ErrorCode.AUTH_FAILED, "authentication is off on this daemon: "
                             "it cannot prove itself to a client that sends credentials")
    else:
        authenticated = {"principal": None}
    conn.namespace = namespace
    conn.client_name = client_name[:255]
    _give_segments(conn)
    return Reply({
        **authenticated,
        "protocol": framing.PROTOCOL_VERSION,
        "server_version": __version__,
        "node_name": daemon.node_name,
        "pid": daemon.pid,
        "namespace": namespace,
        "max_header_bytes": daemon.max_header_bytes,
        "max_payload_bytes": daemon.max_payload_bytes,
        "max_key_bytes": daemon.max_key_bytes,
        "max_batch_keys": daemon.max_batch_keys,
        "lease_ttl_ms": daemon.config.store.lease_ttl_ms,
        "segments": daemon.segment_descriptions(conn),
        "fd_socket": daemon.fd_handover.path if conn.mappable_segments else "",
        "max_reserved_bytes": daemon.max_reserved_bytes(conn),
        "reservation_ttl_ms": daemon.config.store.put_start_release_timeout_ms,
    })


def _give_segments(conn) -> None:
    """Decide what the connection may map (once: a second hello is refused)."""
    daemon = conn.daemon
    conn.mappable_segments = daemon.mappable_segments(conn)
    if conn.mappable_segments and not conn.peer_pid:
        conn.peer_pid = peer_pid(conn.transport.get_extra_info("socket"))


def handle_auth_start(conn, params: list, payload_length: int) -> Reply:
    if conn.namespace is not None:
        raise MooncakedError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "hello already "
                             "succeeded on this connection")
    _arity(params, 2, 2, "[principal, client_nonce]")
    principal, client_nonce = params
    if type(principal) is not str or not scram.PRINCIPAL_PATTERN.fullmatch(principal):
        raise _invalid("principal must be 1-255 characters of [A-Za-z0-9._@:+-]")
    if type(client_nonce) is not bytes or not \
            scram.MIN_CLIENT_NONCE_BYTES <= len(client_nonce) <= scram.MAX_CLIENT_NONCE_BYTES:
        raise _invalid(f"client_nonce must be a bin of {scram.MIN_CLIENT_NONCE_BYTES}-"
                       f"{scram.MAX_CLIENT_NONCE_BYTES} bytes")
    if conn.daemon.auth is None:
        raise MooncakedError(ErrorCode.NOT_SUPPORTED, "authentication is off on this daemon "
                             "([auth] credentials_file is empty); send hello without "
                             "credentials")
    return Reply(conn.daemon.auth.start(conn, principal, client_nonce))


def handle_ping(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply("pong")


# -- values through the socket ------------------------------------------------------------------

def _receive_put(conn, key, payload_length: int, config: ReplicateConfig, upsert: bool):
    """Start a put whose bytes come in the payload: returns the targets and the replicas."""
    daemon = conn.daemon
    replicas = daemon.master.put_start(key, payload_length, config, upsert, conn.connection_id,
                                       daemon.now_ms())
    return daemon.replica_view(replicas[0], payload_length), replicas


def _put(conn, params: list, payload_length: int, upsert: bool):
    _arity(params, 1, 2, "[key, config?]")
    key = _key(conn, params[0])
    config = _replicate_config(conn, _optional(params, 1, None))
    if payload_length == 0:
        raise _invalid("a value must have at least 1 byte")
    daemon = conn.daemon
    try:
        target, replicas = _receive_put(conn, key, payload_length, config, upsert)
    except MooncakedError as exc:
        if exc.code == ErrorCode.OBJECT_ALREADY_EXISTS:  # write-once: drop the bytes
            return Incoming([payload_length], lambda: _FALSE)
        raise

    def complete() -> Reply:
        daemon.copy_to_other_replicas(replicas, payload_length)
        daemon.master.put_end(key, conn.connection_id, daemon.now_ms())
        return daemon.settled(_TRUE)  # an upsert's old value leaves the disk tier too

    def abort() -> None:
        daemon.master.put_revoke(key, conn.connection_id)
    return Incoming([target], complete, abort)


def handle_put(conn, params: list, payload_length: int):
    return _put(conn, params, payload_length, upsert=False)


def handle_upsert(conn, params: list, payload_length: int):
    return _put(conn, params, payload_length, upsert=True)


def _leased_version(conn, key, now_ms: int):
    """The readable version of a key, under a fresh read lease; OBJECT_NOT_FOUND if none."""
    version = conn.daemon.master.get(key, now_ms)
    if version is None:
        raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
    if not version.replicas:  # on disk only: the lease holds its record (daemon/tiering.py)
        conn.daemon.tiering.hold(key, version)
    return version


def handle_get(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 1, "[key]")
    daemon = conn.daemon
    key = _key(conn, params[0])
    version = _leased_version(conn, key, daemon.now_ms())
    if not version.replicas:  # on disk only (daemon/tiering.py)
        return _disk_get(daemon, key, version)
    if daemon.tiering is not None:
        daemon.tiering.stats.dram_hits += 1
    return Reply(version.size_bytes,
                 [daemon.replica_view(version.replicas[0], version.size_bytes)])


async def _disk_get(daemon, key, version) -> Reply:
    return Reply(version.size_bytes, [await daemon.tiering.read_value(key, version)])


def handle_exists(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 1, "[key]")
    daemon = conn.daemon
    return _TRUE if _exists(daemon, _key(conn, params[0]), daemon.now_ms()) else _FALSE


def _exists(daemon, key, now_ms: int) -> bool:
    """Whether the key is readable, under a read lease (on disk only: its record held)."""
    version = daemon.master.get(key, now_ms)
    if version is None:
        return False
    if not version.replicas:
        daemon.tiering.hold(key, version)
    return True


def handle_get_size(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 1, "[key]")
    version = _leased_version(conn, _key(conn, params[0]), conn.daemon.now_ms())
    return Reply(version.size_bytes)


def handle_remove(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 2, "[key, force?]")
    daemon = conn.daemon
    force = _bool(_optional(params, 1, False), "force")
    daemon.master.remove(_key(conn, params[0]), force, daemon.now_ms())
    return daemon.settled(_ZERO)


def handle_remove_by_regex(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 2, "[pattern, force?]")
    if type(params[0]) is not str:
        raise _invalid("pattern must be a str")
    try:
        pattern = re.compile(params[0])
    except re.error as exc:
        raise _invalid(f"bad regular expression: {exc}") from None
    force = _bool(_optional(params, 1, False), "force")
    daemon = conn.daemon
    return daemon.settled(Reply(daemon.master.remove_matching(conn.namespace, pattern, force,
                                                              daemon.now_ms())))


def handle_remove_all(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 1, "[force?]")
    force = _bool(_optional(params, 0, False), "force")
    daemon = conn.daemon
    return daemon.settled(Reply(daemon.master.remove_matching(conn.namespace, None, force,
                                                              daemon.now_ms())))


def handle_batch_put(conn, params: list, payload_length: int):
    _arity(params, 2, 3, "[keys, sizes, config?]")
    keys = _keys(conn, params[0])
    sizes = _sizes(params[1], len(keys))
    config = _replicate_config(conn, _optional(params, 2, None))
    if sum(sizes) != payload_length:
        raise _invalid(f"sizes add up to {sum(sizes)} but the payload has {payload_length} bytes")
    if len(set(keys)) != len(keys):
        raise _invalid("a batch must not repeat a key")
    daemon = conn.daemon
    targets, codes, started = [], [], []
    for key, size in zip(keys, sizes):
        try:
            target, replicas = _receive_put(conn, key, size, config, False)
        except MooncakedError as exc:
            targets.append(size)
            codes.append(1 if exc.code == ErrorCode.OBJECT_ALREADY_EXISTS else exc.code)
            continue
        targets.append(target)
        codes.append(0)
        started.append((key, replicas, size))

    def complete() -> Reply:
        now_ms = daemon.now_ms()
        for key, replicas, size in started:
            daemon.copy_to_other_replicas(replicas, size)
            daemon.master.put_end(key, conn.connection_id, now_ms)
        return Reply(codes)

    def abort() -> None:
        for key, _, _ in started:
            daemon.master.put_revoke(key, conn.connection_id)
    return Incoming(targets, complete, abort)


def handle_batch_get(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 1, "[keys]")
    keys = _keys(conn, params[0])
    daemon = conn.daemon
    readable = daemon.master.state.readable
    total = sum(v.size_bytes for v in map(readable, keys) if v is not None)
    if total > daemon.max_payload_bytes:  # checked before any lease is granted
        raise MooncakedError(ErrorCode.RESPONSE_TOO_LARGE,
                             f"the values add up to {total} bytes, over max_payload_bytes "
                             f"{daemon.max_payload_bytes}: ask for fewer keys")
    now_ms = daemon.now_ms()
    results, pieces, on_disk = [], [], []
    for key in keys:
        version = daemon.master.get(key, now_ms)
        if version is None:
            results.append(int(ErrorCode.OBJECT_NOT_FOUND))
        elif not version.replicas:  # on disk only: read below
            daemon.tiering.hold(key, version)
            on_disk.append((len(results), len(pieces), key, version))
            results.append(version.size_bytes)
            pieces.append(None)
        else:
            results.append(version.size_bytes)
            pieces.append(daemon.replica_view(version.replicas[0], version.size_bytes))
    if daemon.tiering is not None:
        daemon.tiering.stats.dram_hits += len(pieces) - len(on_disk)
    if on_disk:
        return _disk_batch_get(daemon, results, pieces, on_disk)
    return Reply(results, pieces)


async def _disk_batch_get(daemon, results: list, pieces: list, on_disk: list) -> Reply:
    """Fill in the values of a batch_get that are on disk only; one that cannot be read is
    a miss (its result OBJECT_NOT_FOUND, no piece)."""
    read = await asyncio.gather(*(daemon.tiering.read_value(key, version)
                                  for _, _, key, version in on_disk), return_exceptions=True)
    for (result_index, piece_index, _, _), value in zip(on_disk, read):
        if isinstance(value, MooncakedError):
            results[result_index] = int(value.code)
        elif isinstance(value, BaseException):
            raise value
        else:
            pieces[piece_index] = value
    return Reply(results, [piece for piece in pieces if piece is not None])


def handle_batch_exists(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 1, "[keys]")
    keys = _keys(conn, params[0])
    daemon = conn.daemon
    now_ms = daemon.now_ms()
    return Reply([1 if _exists(daemon, key, now_ms) else 0 for key in keys])


def handle_batch_remove(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 2, "[keys, force?]")
    keys = _keys(conn, params[0])
    force = _bool(_optional(params, 1, False), "force")
    daemon = conn.daemon
    now_ms = daemon.now_ms()
    codes = []
    for key in keys:
        try:
            daemon.master.remove(key, force, now_ms)
            codes.append(0)
        except MooncakedError as exc:
            codes.append(exc.code)
    return daemon.settled(Reply(codes))


# -- values through shared memory ---------------------------------------------------------------

def _start_shared_put(conn, key, size: int, config: ReplicateConfig) -> list[int]:
    daemon = conn.daemon
    if daemon.puts_in_progress() >= daemon.config.server.max_puts_in_progress:
        raise MooncakedError(ErrorCode.BUSY, "too many puts in progress")
    replicas = daemon.master.put_start(key, size, config, False, conn.connection_id,
                                       daemon.now_ms())
    first = replicas[0]
    if first.segment_id not in conn.mappable_segments:  # placement keeps pools apart
        daemon.master.put_revoke(key, conn.connection_id)
        _require_mappable(conn, first.segment_id)
    conn.puts_in_progress[key] = (replicas, size)
    return [first.segment_id, first.offset]


def _end_shared_put(conn, key) -> None:
    daemon = conn.daemon
    started = conn.puts_in_progress.get(key)
    if started is not None:
        daemon.copy_to_other_replicas(*started)
    daemon.master.put_end(key, conn.connection_id, daemon.now_ms())
    conn.puts_in_progress.pop(key, None)


def _revoke_shared_put(conn, key) -> None:
    conn.daemon.master.put_revoke(key, conn.connection_id)
    conn.puts_in_progress.pop(key, None)


def _require_unix(conn) -> None:
    """Shared-memory calls need segments the connection may map (daemon.mappable_segments)."""
    if conn.transport_kind != "unix":
        raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                             "shared-memory transfers need the Unix socket")
    if not conn.mappable_segments:
        raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                             f"no segment memory is shared with namespace {conn.namespace!r} "
                             "([segments] share_with_local_clients is false and it has no "
                             "pool): send values through the socket")


def _require_mappable(conn, segment_id: int, code: int = ErrorCode.SEGMENT_NOT_FOUND) -> None:
    if segment_id not in conn.mappable_segments:
        raise MooncakedError(code, f"segment {segment_id} is not one this connection may map")


def handle_put_start(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 2, 3, "[key, size, config?]")
    key = _key(conn, params[0])
    size = _int(params[1], "size", 1)
    return Reply(_start_shared_put(conn, key, size,
                                   _replicate_config(conn, _optional(params, 2, None))))


def handle_put_end(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 1, 1, "[key]")
    _end_shared_put(conn, _key(conn, params[0]))
    return _ZERO


def handle_put_revoke(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 1, 1, "[key]")
    _revoke_shared_put(conn, _key(conn, params[0]))
    return _ZERO


def _per_key(function, keys) -> list:
    results = []
    for key in keys:
        try:
            results.append(function(key))
        except MooncakedError as exc:
            results.append(exc.code)
    return results


def handle_batch_put_start(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 2, 3, "[keys, sizes, config?]")
    keys = _keys(conn, params[0])
    sizes = dict(zip(keys, _sizes(params[1], len(keys))))
    if len(sizes) != len(keys):
        raise _invalid("a batch must not repeat a key")
    config = _replicate_config(conn, _optional(params, 2, None))
    return Reply(_per_key(lambda key: _start_shared_put(conn, key, sizes[key], config), keys))


def handle_batch_put_end(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 1, 1, "[keys]")
    return Reply(_per_key(lambda key: _end_shared_put(conn, key) or 0,
                          _keys(conn, params[0])))


def handle_batch_put_revoke(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 1, 1, "[keys]")
    return Reply(_per_key(lambda key: _revoke_shared_put(conn, key) or 0,
                          _keys(conn, params[0])))


# -- reservations: one round trip per shared-memory put (daemon/reservations.py) ----------------

def _wanted(conn, value: Any) -> list[tuple[int, int]]:
    """[[size, count], ...]: the ranges a client asks to have reserved."""
    if value is None:
        return []
    if type(value) is not list:
        raise _invalid("wanted must be an array of [size, count]")
    wanted, total = [], 0
    for item in value:
        if type(item) is not list or len(item) != 2:
            raise _invalid("wanted must be an array of [size, count]")
        size, count = _int(item[0], "a wanted size", 1), _int(item[1], "a wanted count")
        total += count
        wanted.append((size, count))
    if total > conn.daemon.max_batch_keys:
        raise _invalid(f"at most {conn.daemon.max_batch_keys} ranges per request")
    return wanted


def _range_list(conn, value: Any, fields: int, name: str) -> list[tuple]:
    """An array of [segment_id, offset] (or [segment_id, offset, size]) of int."""
    if value is None:
        return []
    if type(value) is not list or len(value) > conn.daemon.max_batch_keys:
        raise _invalid(f"{name} must be an array of at most {conn.daemon.max_batch_keys} "
                       "ranges")
    ranges = []
    for item in value:
        if type(item) is not list or len(item) != fields \
                or any(type(v) is not int or v < 0 for v in item):
            raise _invalid(f"each of {name} must be an array of {fields} ints >= 0")
        ranges.append(tuple(item))
    return ranges


def _commit_config(conn, value: Any) -> ReplicateConfig:
    config = _replicate_config(conn, value)
    if config.replica_num != 1 or config.preferred_segments:
        raise _invalid("a reserved range holds one replica: commit with replica_num 1 and no "
                       "preferred_segments, or use put_start")
    return config


def handle_reserve(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 1, 2, "[wanted, release?]")
    wanted = _wanted(conn, params[0])
    release = _range_list(conn, _optional(params, 1, None), 2, "release")
    daemon = conn.daemon
    daemon.reservations.release(conn, release)
    return Reply(daemon.reservations.grant(conn, wanted, daemon.now_ms()))


def handle_put_commit(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 4, 7, "[key, segment_id, offset, size, config?, wanted?, release?]")
    key = _key(conn, params[0])
    segment_id = _int(params[1], "segment_id")
    offset = _int(params[2], "offset")
    size = _int(params[3], "size", 1)
    config = _commit_config(conn, _optional(params, 4, None))
    wanted = _wanted(conn, _optional(params, 5, None))
    release = _range_list(conn, _optional(params, 6, None), 2, "release")
    daemon = conn.daemon
    reservations = daemon.reservations
    now_ms = daemon.now_ms()
    reservations.release(conn, release)
    # Before the reservation table, so nothing is told about another namespace's ranges.
    _require_mappable(conn, segment_id, ErrorCode.INVALID_WRITE)
    stored = reservations.commit(conn, key, segment_id, offset, size, config, now_ms)
    return Reply([stored, reservations.grant(conn, wanted, now_ms)])


def handle_batch_put_commit(conn, params: list, payload_length: int) -> Reply:
    _require_unix(conn)
    _arity(params, 2, 5, "[keys, ranges, config?, wanted?, release?]")
    keys = _keys(conn, params[0])
    ranges = _range_list(conn, params[1], 3, "ranges")
    if len(ranges) != len(keys):
        raise _invalid("ranges must have one [segment_id, offset, size] per key")
    if len(set(keys)) != len(keys):
        raise _invalid("a batch must not repeat a key")
    if len({(r[0], r[1]) for r in ranges}) != len(ranges):
        raise _invalid("a batch must not repeat a range")
    config = _commit_config(conn, _optional(params, 2, None))
    wanted = _wanted(conn, _optional(params, 3, None))
    release = _range_list(conn, _optional(params, 4, None), 2, "release")
    daemon = conn.daemon
    reservations = daemon.reservations
    now_ms = daemon.now_ms()
    reservations.release(conn, release)
    codes = []
    for key, (segment_id, offset, size) in zip(keys, ranges):
        try:
            _require_mappable(conn, segment_id, ErrorCode.INVALID_WRITE)
            stored = reservations.commit(conn, key, segment_id, offset, size, config, now_ms)
            codes.append(0 if stored else 1)
        except MooncakedError as exc:
            codes.append(exc.code)
    return Reply([codes, reservations.grant(conn, wanted, now_ms)])


TIER_DRAM = "dram"
TIER_SSD = "ssd"


def _replica_location(conn, key, now_ms: int):
    """[segment_id, offset, size, tier] of the value, or for a value on disk only a
    coroutine giving it once the value is read into a range the connection maps."""
    version = _leased_version(conn, key, now_ms)
    daemon = conn.daemon
    if not version.replicas:
        return _disk_replica_location(conn, key, version)
    replica = daemon.local_replica(version)
    _require_mappable(conn, replica.segment_id)
    if daemon.tiering is not None:
        daemon.tiering.stats.dram_hits += 1
    return [replica.segment_id, replica.offset, version.size_bytes, TIER_DRAM]


async def _disk_replica_location(conn, key, version) -> list:
    replica = await conn.daemon.tiering.read_shared(key, version)
    return [replica.segment_id, replica.offset, version.size_bytes, TIER_SSD]


def handle_get_replica(conn, params: list, payload_length: int):
    _require_unix(conn)
    _arity(params, 1, 1, "[key]")
    location = _replica_location(conn, _key(conn, params[0]), conn.daemon.now_ms())
    if type(location) is list:
        return Reply(location)
    return _awaited_reply(location)


async def _awaited_reply(location) -> Reply:
    return Reply(await location)


def handle_batch_get_replica(conn, params: list, payload_length: int):
    _require_unix(conn)
    _arity(params, 1, 1, "[keys]")
    now_ms = conn.daemon.now_ms()
    locations = _per_key(lambda key: _replica_location(conn, key, now_ms),
                         _keys(conn, params[0]))
    if not any(asyncio.iscoroutine(location) for location in locations):
        return Reply(locations)
    return _disk_batch_locations(locations)


async def _disk_batch_locations(locations: list) -> Reply:
    """Read the values on disk only of a batch_get_replica, one after the other (each into
    a range of its own); one that cannot be read answers its error code."""
    results = []
    for location in locations:
        if asyncio.iscoroutine(location):
            try:
                location = await location
            except MooncakedError as exc:
                location = int(exc.code)
        results.append(location)
    return Reply(results)


# -- administration -----------------------------------------------------------------------------

def handle_status(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply(conn.daemon.status())


def handle_segments(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply(conn.daemon.segment_report())


def _namespace_filter(conn, value: Any) -> str | None:
    if value is None:
        return conn.namespace
    if type(value) is not str:
        raise _invalid("namespace must be a str")
    return None if value == ALL_NAMESPACES else value


def handle_objects_list(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 4, "[prefix?, regex?, namespace?, limit?]")
    prefix = _optional(params, 0, "")
    regex = _optional(params, 1, None)
    if type(prefix) is not str or (regex is not None and type(regex) is not str):
        raise _invalid("prefix and regex must be str")
    try:
        pattern = re.compile(regex) if regex is not None else None
    except re.error as exc:
        raise _invalid(f"bad regular expression: {exc}") from None
    namespace = _namespace_filter(conn, _optional(params, 2, None))
    limit = _int(_optional(params, 3, DEFAULT_LIST_LIMIT), "limit", 1)
    daemon = conn.daemon
    found = []
    for key, entry in daemon.master.state.objects.items():
        if (namespace is not None and key[0] != namespace) or key[0] == RESERVED_NAMESPACE:
            continue
        if not key[1].startswith(prefix) or (pattern and not pattern.search(key[1])):
            continue
        found.append(daemon.describe_object(key, entry))
        if len(found) >= limit:
            break
    return Reply(found)


def handle_object_stat(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 1, 2, "[key, namespace?]")
    if type(params[0]) is not str:
        raise _invalid("key must be a str")
    namespace = _optional(params, 1, conn.namespace)
    if type(namespace) is not str or namespace == ALL_NAMESPACES:
        raise _invalid("namespace must name one namespace")
    key = (namespace, params[0])
    entry = conn.daemon.master.state.objects.get(key)
    if entry is None or namespace == RESERVED_NAMESPACE:
        raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
    return Reply(conn.daemon.describe_object(key, entry))


def handle_cluster_status(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply(None)  # not a cluster member; cluster nodes answer (daemon/cluster_handlers.py)


def quota_params(params: list) -> tuple[str, int | None, int | None]:
    """[namespace, max_bytes?, max_objects?] of quota_set, checked."""
    _arity(params, 1, 3, "[namespace, max_bytes?, max_objects?]")
    namespace = params[0]
    if type(namespace) is not str or not (
            namespace == QUOTA_DEFAULT or NAMESPACE_PATTERN.fullmatch(namespace)):
        raise _invalid(f"namespace must be 1-255 characters of [A-Za-z0-9._:/-] or "
                       f"{QUOTA_DEFAULT!r} (the default)")
    limits = []
    for index, name in ((1, "max_bytes"), (2, "max_objects")):
        value = _optional(params, index, None)
        limits.append(None if value is None else _int(value, name))
    return namespace, limits[0], limits[1]


def handle_quota_set(conn, params: list, payload_length: int) -> Reply:
    namespace, max_bytes, max_objects = quota_params(params)
    conn.daemon.master.set_quota(namespace, max_bytes, max_objects)
    return _ZERO


def handle_quota_list(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply(conn.daemon.master.quota_report())


def handle_config_show(conn, params: list, payload_length: int) -> Reply:
    _arity(params, 0, 0, "[]")
    return Reply(conn.daemon.config.as_dict())


HANDLERS = {name[len("handle_"):]: function for name, function in globals().items()
            if name.startswith("handle_")}
HANDLERS.update(transfer_segments.HANDLERS)  # te_*: the transfer engine's local clients
