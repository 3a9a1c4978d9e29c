"""Request handlers of a cluster node: the client protocol over the Raft-replicated store.

The parameters are checked exactly as on a single node (daemon/handlers.py); what differs is
what happens next. Metadata goes to the leader (here or forwarded, cluster/service.py) and
waits for the log; value bytes go to and come from the replicas' nodes. Handlers are coroutines
(daemon/connection.py runs them in request order).

Values travel through the socket: a cluster node's hello lists no segments, so clients do not
map shared memory (a value's replicas may be on other nodes). The shared-memory calls answer
NOT_SUPPORTED. A local client may instead map the node's get staging area
(cluster/get_staging.py, hello's `get_staging`): get_staged receives a value into it.
"""

from __future__ import annotations

import asyncio
import re

from mooncaked import environment
from mooncaked.cluster.peer_transport import uninitialized_bytearray
from mooncaked.daemon import handlers as single
from mooncaked.daemon import params as params_check
from mooncaked.daemon.connection import Incoming, Reply
from mooncaked.daemon.fd_handover import peer_pid
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta.master import ReplicateConfig
from mooncaked.meta.state_machine import Replica
from mooncaked.raft.types import Role

_TRUE = Reply(True)
_FALSE = Reply(False)
_ZERO = Reply(0)


def _writer_id(conn) -> int:
    """A new writer id for each put attempt, unique in the cluster (node id above a counter).

    Per attempt, not per connection: an earlier attempt's PutEnd or PutRevoke that timed out
    but still reaches the log must not end the next attempt's version of the key.
    """
    service = conn.daemon.cluster
    service.put_attempts += 1
    return (service.node_id << 40) | (service.put_attempts & ((1 << 40) - 1))


def _placement(conn, config: ReplicateConfig) -> ReplicateConfig:
    """local_first: this node's segments are preferred, after any the client named."""
    daemon = conn.daemon
    if daemon.master.state.allocation_strategy != "local_first":  # the cluster's, from the log
        return config
    own = tuple(f"{daemon.node_name}/{i}" for i in range(daemon.config.segments.count))
    return ReplicateConfig(config.replica_num, config.preferred_segments + own,
                           config.soft_pin_ttl_ms, config.hard_pin)


PUT_ATTEMPTS = 3  # a put whose replica node cannot be reached is placed anew this often


async def _store_value(conn, key, value, config: ReplicateConfig,
                       upsert: bool) -> MooncakedError | None:
    """Put one value: its ranges from the leader (put_start: parts of the leader's arenas,
    cluster/arenas.py), the bytes to every replica, then put_end, which commits the whole put
    in one log command. None, or the error.

    When a replica's node cannot be reached, the put is revoked and placed again (the node
    may be gone but not yet declared down), up to PUT_ATTEMPTS times; so is a put whose
    put_end reached a leader that did not start it.
    """
    service = conn.daemon.cluster
    if service.registered_term < 0:
        await service.until_registered()
    config = _placement(conn, config)
    for attempt in range(PUT_ATTEMPTS):
        writer = _writer_id(conn)
        try:
            replicas = await service.put_start(key, len(value), config, upsert, writer)
        except MooncakedError as exc:
            return exc
        try:
            await service.write_replicas(replicas, value)
        except MooncakedError as exc:
            try:
                # Its ranges are held past any replica write still in flight.
                await service.meta("put_revoke", [list(key), writer,
                                                  2 * service.cluster_config.rpc_timeout_ms])
            except MooncakedError:
                return exc  # the put is revoked by its timeout instead
            if attempt + 1 == PUT_ATTEMPTS:
                return exc
            continue
        try:
            await service.put_end(key, writer)
        except MooncakedError as exc:
            # INVALID_WRITE: the put was not committed and no longer can be (it reached a
            # leader that did not start it, or took too long); it is placed anew.
            if exc.code != ErrorCode.INVALID_WRITE or attempt + 1 == PUT_ATTEMPTS:
                return exc
            continue
        return None


def _put(conn, params: list, payload_length: int, upsert: bool):
    params_check.arity(params, 1, 2, "[key, config?]")
    key = params_check.key(conn, params[0])
    config = params_check.replicate_config(conn, params_check.optional(params, 1, None))
    if payload_length == 0:
        raise params_check.invalid("a value must have at least 1 byte")
    value = uninitialized_bytearray(payload_length)  # the payload fills it all before use

    async def complete() -> Reply:
        error = await _store_value(conn, key, value, config, upsert)
        if error is None:
            return _TRUE
        if error.code == ErrorCode.OBJECT_ALREADY_EXISTS:
            return _FALSE
        raise error
    return Incoming([memoryview(value)], complete)


def handle_put(conn, params: list, payload_length: int):
    return _put(conn, params, payload_length, upsert=False)


def handle_upsert(conn, params: list, payload_length: int):
    return _put(conn, params, payload_length, upsert=True)


def handle_batch_put(conn, params: list, payload_length: int):
    params_check.arity(params, 2, 3, "[keys, sizes, config?]")
    keys = params_check.keys(conn, params[0])
    sizes = params_check.sizes(params[1], len(keys))
    config = params_check.replicate_config(conn, params_check.optional(params, 2, None))
    if sum(sizes) != payload_length:
        raise params_check.invalid(f"sizes add up to {sum(sizes)} but the payload has "
                              f"{payload_length} bytes")
    if len(set(keys)) != len(keys):
        raise params_check.invalid("a batch must not repeat a key")
    value = bytearray(payload_length)
    view = memoryview(value)

    async def complete() -> Reply:
        starts, offset = [], 0
        for size in sizes:
            starts.append(offset)
            offset += size
        errors = await asyncio.gather(*(
            _store_value(conn, key, view[start:start + size], config, False)
            for key, start, size in zip(keys, starts, sizes)))
        return Reply([0 if error is None else 1 if error.code == ErrorCode.OBJECT_ALREADY_EXISTS
                      else error.code for error in errors])
    return Incoming([view], complete)


async def _read(conn, keys) -> list:
    return await conn.daemon.cluster.meta("read", [[list(key) for key in keys]])


def _check_lease(conn, started: float) -> None:
    """Bytes read after the read lease ended may be another object's by now (the leader frees
    and reuses a range once no lease covers it): they are not returned."""
    if environment.monotonic() - started >= conn.daemon.config.store.lease_ttl_ms / 1000:
        raise MooncakedError(ErrorCode.TRANSFER_FAIL,
                             "reading the replica took longer than the read lease")


async def _value_of(conn, version):
    size, locations = version
    replicas = [Replica(segment_id, offset, 0) for segment_id, offset in locations]
    return await conn.daemon.cluster.read_replica_bytes(replicas, size)


def handle_get(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 1, "[key]")
    key = params_check.key(conn, params[0])

    async def run() -> Reply:
        started = environment.monotonic()  # the lease starts later, when the leader grants it
        (version,) = await _read(conn, [key])
        if version is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        value = await _value_of(conn, version)
        _check_lease(conn, started)
        return Reply(version[0], [value])
    return run()


def handle_hello(conn, params: list, payload_length: int) -> Reply:
    """hello as on a single node; a local client also gets the get staging area to map, on the
    terms a single node shares its segments on: share_with_local_clients, and with
    authentication on, a principal that may read every namespace (the area holds the bytes of
    every connection's gets)."""
    reply = single.handle_hello(conn, params, payload_length)
    daemon = conn.daemon
    staging = daemon.get_staging
    if staging is None or conn.transport_kind != "unix" \
            or not daemon.config.segments.share_with_local_clients \
            or (daemon.auth is not None and not daemon.auth.may_read_every_namespace(conn)):
        return reply
    if not conn.peer_pid:
        conn.peer_pid = peer_pid(conn.transport.get_extra_info("socket"))
    from mooncaked.cluster.get_staging import STAGING_SEGMENT_ID
    staging.admit(conn.connection_id)
    reply.result["get_staging"] = {
        "size_bytes": staging.size_bytes, "prefaulted": daemon.config.segments.prefault,
        "fd_socket": daemon.fd_handover.path,
        "fd_token": daemon.fd_handover.issue(conn.connection_id, conn.peer_pid,
                                             STAGING_SEGMENT_ID)}
    return reply


def _staging_of(conn):
    staging = conn.daemon.get_staging
    if staging is None or not staging.admitted(conn.connection_id):
        raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                             "this connection was not offered a get staging area (hello's "
                             "get_staging): use get")
    return staging


def handle_get_staged(conn, params: list, payload_length: int):
    """[offset, size]: the value is at `offset` of the staging area, a range this connection
    holds until it releases it; [nil, size] and the value as payload when the area has no
    room for it. `release` (ranges of earlier answers) is handed back first."""
    staging = _staging_of(conn)
    params_check.arity(params, 1, 2, "[key, release?]")
    staging.release(conn.connection_id, params_check.optional(params, 1, []))
    key = params_check.key(conn, params[0])

    async def run() -> Reply:
        started = environment.monotonic()  # the lease starts later, when the leader grants it
        (version,) = await _read(conn, [key])
        if version is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        size, locations = version
        taken = staging.take(conn.connection_id, size) if size else None
        if taken is None:
            value = await _value_of(conn, version) if size else b""
            _check_lease(conn, started)
            return Reply([None, size], [value])
        offset, target = taken
        try:
            await _read_into(conn, locations, size, target)
            _check_lease(conn, started)
        except BaseException:
            staging.give_back(conn.connection_id, offset)
            raise
        staging.stats["staged_gets"] += 1
        staging.stats["staged_bytes"] += size
        return Reply([offset, size])
    return run()


async def _read_into(conn, locations: list, size: int, target: memoryview) -> None:
    """The nearest replica's bytes into `target`; the next replica if one fails (each attempt
    ends before the next starts: nothing of a failed one lands later)."""
    service = conn.daemon.cluster
    replicas = [Replica(segment_id, offset, 0) for segment_id, offset in locations]
    last_error = None
    for replica in service.nearest_first(replicas):
        try:
            await service.read_one_replica(replica, size, target)
            return
        except MooncakedError as exc:
            last_error = exc
    raise MooncakedError(ErrorCode.TRANSFER_FAIL,
                         f"no replica could be read: {last_error.message if last_error else ''}")


def handle_release_staged(conn, params: list, payload_length: int) -> Reply:
    """Hand back staged ranges without reading another value."""
    staging = _staging_of(conn)
    params_check.arity(params, 1, 1, "[release]")
    staging.release(conn.connection_id, params[0])
    return _ZERO


def handle_exists(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 1, "[key]")
    key = params_check.key(conn, params[0])

    async def run() -> Reply:
        (version,) = await _read(conn, [key])
        return _FALSE if version is None else _TRUE
    return run()


def handle_get_size(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 1, "[key]")
    key = params_check.key(conn, params[0])

    async def run() -> Reply:
        (version,) = await _read(conn, [key])
        if version is None:
            raise MooncakedError(ErrorCode.OBJECT_NOT_FOUND, "no such object")
        return Reply(version[0])
    return run()


def handle_batch_get(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 1, "[keys]")
    keys = params_check.keys(conn, params[0])

    async def run() -> Reply:
        started = environment.monotonic()
        versions = await _read(conn, keys)
        present = [v for v in versions if v is not None]
        values = await asyncio.gather(*(_value_of(conn, v) for v in present))
        _check_lease(conn, started)
        results = [int(ErrorCode.OBJECT_NOT_FOUND) if v is None else v[0] for v in versions]
        return Reply(results, list(values))
    return run()


def handle_batch_exists(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 1, "[keys]")
    keys = params_check.keys(conn, params[0])

    async def run() -> Reply:
        return Reply([0 if v is None else 1 for v in await _read(conn, keys)])
    return run()


def handle_remove(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 2, "[key, force?]")
    key = params_check.key(conn, params[0])
    force = params_check.as_bool(params_check.optional(params, 1, False), "force")

    async def run() -> Reply:
        await conn.daemon.cluster.meta("remove", [list(key), force])
        return _ZERO
    return run()


def handle_batch_remove(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 2, "[keys, force?]")
    keys = params_check.keys(conn, params[0])
    force = params_check.as_bool(params_check.optional(params, 1, False), "force")

    async def one(key) -> int:
        try:
            await conn.daemon.cluster.meta("remove", [list(key), force])
            return 0
        except MooncakedError as exc:
            return exc.code

    async def run() -> Reply:
        return Reply(list(await asyncio.gather(*(one(key) for key in keys))))
    return run()


def _remove_matching(conn, pattern: str | None, force: bool):
    async def run() -> Reply:
        return Reply(await conn.daemon.cluster.meta("remove_matching",
                                                    [conn.namespace, pattern, force]))
    return run()


def handle_remove_by_regex(conn, params: list, payload_length: int):
    params_check.arity(params, 1, 2, "[pattern, force?]")
    if type(params[0]) is not str:
        raise params_check.invalid("pattern must be a str")
    try:
        re.compile(params[0])
    except re.error as exc:
        raise params_check.invalid(f"bad regular expression: {exc}") from None
    return _remove_matching(conn, params[0],
                            params_check.as_bool(params_check.optional(params, 1, False), "force"))


def handle_remove_all(conn, params: list, payload_length: int):
    params_check.arity(params, 0, 1, "[force?]")
    return _remove_matching(conn, None,
                            params_check.as_bool(params_check.optional(params, 0, False), "force"))


def _no_shared_memory(conn, params: list, payload_length: int):
    raise MooncakedError(ErrorCode.NOT_SUPPORTED,
                         "shared-memory transfers are not available on a cluster node; "
                         "send the value through the socket")


# -- cluster administration (mooncakectl cluster ...) -------------------------------------------

def _node_id(value) -> int:
    if type(value) is not int or not 1 <= value <= 65535:
        raise params_check.invalid("a node id is an int in 1..65535")
    return value


def handle_cluster_status(conn, params: list, payload_length: int) -> Reply:
    params_check.arity(params, 0, 0, "[]")
    staging = conn.daemon.get_staging
    return Reply({**conn.daemon.cluster.status(),
                  "get_staging": None if staging is None else staging.status()})


def handle_cluster_add(conn, params: list, payload_length: int):
    params_check.arity(params, 2, 2, "[node_id, peer_address]")
    node_id = _node_id(params[0])
    if type(params[1]) is not str or ":" not in params[1]:
        raise params_check.invalid("peer_address is host:port")

    async def run() -> Reply:
        await conn.daemon.cluster.meta("join", [node_id, params[1]])
        return _ZERO
    return run()


def _leader_call(method: str):
    def handler(conn, params: list, payload_length: int):
        params_check.arity(params, 1, 1, "[node_id]")
        node_id = _node_id(params[0])

        async def run() -> Reply:
            return Reply(await conn.daemon.cluster.meta(method, [node_id]))
        return run()
    return handler


def handle_quota_set(conn, params: list, payload_length: int):
    namespace, max_bytes, max_objects = single.quota_params(params)

    async def run() -> Reply:
        await conn.daemon.cluster.meta("set_quota", [namespace, max_bytes, max_objects])
        return _ZERO
    return run()


def handle_cluster_settings_set(conn, params: list, payload_length: int):
    """Change the cluster's [store] settings through the log; nil keeps one."""
    params_check.arity(params, 4, 4, "[max_objects, put_start_discard_timeout_ms, "
                  "put_start_release_timeout_ms, allocation_strategy] (nil keeps a value)")

    async def run() -> Reply:
        return Reply(await conn.daemon.cluster.meta("set_store_settings", list(params)))
    return run()


handle_cluster_remove = _leader_call("remove_member")
handle_cluster_transfer_leader = _leader_call("transfer_leader")
handle_cluster_drain = _leader_call("drain")

_OVERRIDES = {name[len("handle_"):]: function for name, function in globals().items()
              if name.startswith("handle_")}
for _name in ("put_start", "put_end", "put_revoke", "batch_put_start", "batch_put_end",
              "batch_put_revoke", "get_replica", "batch_get_replica", "reserve", "put_commit",
              "batch_put_commit"):
    _OVERRIDES[_name] = _no_shared_memory



def _members_only(handler):
    """A local view of the log (objects, segments, quotas): refused on a removed node, whose
    copy of the log no longer grows (NOT_A_MEMBER)."""
    def members_only(conn, params: list, payload_length: int):
        conn.daemon.cluster.check_member()
        return handler(conn, params, payload_length)
    return members_only


for _name in ("objects_list", "object_stat", "segments", "quota_list"):
    _OVERRIDES[_name] = _members_only(single.HANDLERS[_name])


def _object_stat(conn, params: list, payload_length: int) -> Reply:
    """As on a single node; on the leader, a put in progress that the log does not know yet
    (it commits whole, cluster/arenas.py) shows as `writing` too."""
    try:
        return _members_only(single.HANDLERS["object_stat"])(conn, params, payload_length)
    except MooncakedError as exc:
        if exc.code != ErrorCode.OBJECT_NOT_FOUND:
            raise
        namespace = params_check.optional(params, 1, conn.namespace)
        master = conn.daemon.master
        puts = master.arenas.pending.get((namespace, params[0])) \
            if conn.daemon.cluster.raft.role == Role.LEADER else None
        put = next((p for p in (puts or {}).values() if p.parts is not None), None)
        if put is None:
            raise
        return Reply({"namespace": namespace, "key": params[0], "size_bytes": put.size_bytes,
                      "state": "writing",
                      "replicas": [{"segment_id": arena.segment_id, "offset": offset}
                                   for arena, offset in put.parts],
                      "lease_expires_in_ms": 0, "soft_pin_expires_in_ms": None,
                      "hard_pin": put.hard_pin,
                      "created_ms_ago": master.now_ms() - put.started_ms})


_OVERRIDES["object_stat"] = _object_stat

HANDLERS = {**single.HANDLERS, **_OVERRIDES}
PAYLOAD_METHODS = single.PAYLOAD_METHODS
