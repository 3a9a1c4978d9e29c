"""The client calls that take more than one request, written once for both clients.

An operation is a generator: it yields a `Call`, is sent the call's result (or has the call's
`MooncakedError` thrown into it), and returns the operation's result. It does no I/O itself,
so the blocking client (`BlockingClient.drive`) and the asyncio client (`Client.drive`) run the
same code and differ only in how they move a Call over their socket.

`context` is the client: its `segments` (the daemon's shared memory, mapped over the Unix
socket, else None), its `get_staging` (a cluster node's get staging area, mapped, else None), its `lease_ttl_ms`, and its `reservation_stock` (ranges the daemon reserved
for this connection's next puts, client/reservations.py; None when it offers none): with a
range in stock, a local put is one request.

Address-based calls move bytes between this process's memory and the daemon. A range list is
`[(offset_in_object, address, size), ...]`: for a put, bytes at `address` land at that offset
of the object; for a get, the object's bytes at that offset are copied to `address`, clipped
at the object's end.
"""

from __future__ import annotations

import time
from typing import Generator, Sequence

from mooncaked._native import buffer_address, copy_memory, new_bytes
from mooncaked.client import calls
from mooncaked.client.calls import Call, ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError, error_for

Operation = Generator[Call, object, object]
Range = tuple[int, int, int]

# Local values at least this large go through shared memory: one memcpy beats two through the
# socket, and below it the extra request costs more than the copy saves.
SHARED_PUT_MIN_BYTES = 64 * 1024

_INVALID = int(ErrorCode.INVALID_PARAMS)


def run_call(call: Call) -> Operation:
    """A single request as an operation."""
    return (yield call)


def _lease_expired(context, started: float) -> bool:
    return (time.monotonic() - started) * 1000 >= context.lease_ttl_ms


def _raw(address: int, size_bytes: int) -> memoryview:
    from mooncaked.client.blocking import raw_buffer  # ctypes view; no copy
    return raw_buffer(address, size_bytes)


# -- single values ----------------------------------------------------------------------------

def put(context, key: str, value, config: ReplicateConfig | None) -> Operation:
    """True stored, False the key already existed."""
    size = memoryview(value).nbytes
    if context.segments is not None and size >= SHARED_PUT_MIN_BYTES:
        return (yield from put_from(context, key, buffer_address(value), size, config))
    return (yield calls.put(key, value, config))


def _shared_location(key: str) -> Operation:
    """get_replica's [segment_id, offset, size, tier]; None when the value is on the
    daemon's disk only and it has no DRAM to read it into now (NO_AVAILABLE_HANDLE): the value
    is then read through the socket."""
    try:
        return (yield calls.simple("get_replica", key))
    except MooncakedError as exc:
        if exc.code != ErrorCode.NO_AVAILABLE_HANDLE:
            raise
        return None


def get(context, key: str) -> Operation:
    if context.segments is None:
        if context.get_staging is not None:
            return (yield from _get_staged(context, key, None, 0))
        return (yield calls.get(key))
    started = time.monotonic()
    location = yield from _shared_location(key)
    if location is None:
        return (yield calls.get(key))
    segment_id, offset, size = location[:3]
    value = new_bytes(size)  # filled by the copy before anyone sees it
    context.segments.read(segment_id, offset, buffer_address(value), size)
    _check_lease(context, started)
    return value


def _get_staged(context, key: str, address: int | None, capacity: int) -> Operation:
    """A get on a cluster node through its staging area (get_staged): the value, or with
    `address` its size once copied there. The range is this connection's until it is handed
    back with the next get_staged, so the copy needs no lease."""
    staging = context.get_staging
    (offset, size), payload = yield calls.get_staged(key, staging.take_release())
    try:
        if address is not None and size > capacity:
            raise error_for(ErrorCode.INVALID_PARAMS,
                            f"the value has {size} bytes, the buffer {capacity}")
        if offset is None:  # no room in the area: the value came through the socket
            if address is None:
                return bytes(payload or b"")
            if size:
                _raw(address, size)[:] = payload
            return size
        if address is None:
            value = new_bytes(size)  # filled by the copy before anyone sees it
            staging.read(offset, buffer_address(value), size)
            return value
        staging.read(offset, address, size)
        return size
    finally:
        if offset is not None:
            staging.to_release.append(offset)


def _check_lease(context, started: float) -> None:
    if _lease_expired(context, started):
        raise error_for(ErrorCode.LEASE_EXPIRED,
                        "the copy ended after the read lease; the bytes may be stale")


# Per-key commit codes after which the daemon no longer holds the range for this connection.
_RANGE_GONE = (0, int(ErrorCode.INVALID_WRITE), int(ErrorCode.ILLEGAL_CLIENT))


def _stock(context, config: ReplicateConfig | None):
    """The connection's stock of reserved ranges, when this put may use one: a reserved
    range is one replica, so not with replica_num > 1 or preferred segments."""
    if config is not None and (config.replica_num != 1 or config.preferred_segments):
        return None
    return context.reservation_stock


def _take_ranges(stock, sizes: Sequence[int]) -> Operation:
    """Per size a reserved range (client/reservations.py): from the stock, else reserved now
    (one request); None, with nothing taken, when they cannot all be had."""
    taken, missing = [], {}
    for size in sizes:
        range_ = stock.take(size)
        taken.append(range_)
        if range_ is None:
            missing[size] = missing.get(size, 0) + 1
    if missing:
        plan = stock.request(missing, all_or_nothing=True)
        if plan is not None:
            sent_at = time.monotonic()
            try:
                stock.add((yield calls.reserve(*plan)), sent_at)
            except BaseException:
                _put_back(stock, taken)
                raise
            taken = [range_ or stock.take(size) for range_, size in zip(taken, sizes)]
        if plan is None or None in taken:
            _put_back(stock, taken)
            return None
    return taken


def _put_back(stock, taken: list) -> None:
    for range_ in taken:
        if range_ is not None:
            stock.put_back(range_)


def _commit_ranges(stock, keys: Sequence[str], taken: list, config: ReplicateConfig | None,
                   single: bool) -> Operation:
    """Commit written ranges under their keys, asking for as many again; per key 0 stored,
    1 existed (the range goes back to stock), or a negative code. `single`: one key, by
    put_commit, whose failures are raised."""
    for range_ in taken:
        stock.committed(range_)
    refill: dict[int, int] = {}
    for range_ in taken:
        refill[range_[2]] = refill.get(range_[2], 0) + 1
    wanted, release = stock.request(refill, all_or_nothing=False)
    sent_at = time.monotonic()
    try:
        if single:
            segment_id, offset, size, _ = taken[0]
            stored, granted = yield calls.put_commit(keys[0], segment_id, offset, size, config,
                                                     wanted, release)
            codes = [0 if stored else 1]
        else:
            codes, granted = yield calls.batch_put_commit(
                keys, [list(range_[:3]) for range_ in taken], config, wanted, release)
    except MooncakedError as exc:
        if exc.code not in _RANGE_GONE:
            for range_ in taken:
                stock.restore(range_)
        raise
    except BaseException:
        for range_ in taken:
            stock.restore(range_)
        raise
    stock.add(granted, sent_at)
    for range_, code in zip(taken, codes):
        if code not in _RANGE_GONE:
            stock.restore(range_)
    return codes


def put_from(context, key: str, address: int, size_bytes: int,
             config: ReplicateConfig | None) -> Operation:
    """Store `size_bytes` at `address`; False if the key existed.

    Local and with a reserved range of this size in stock: one memcpy and one request
    (put_commit). Else two requests: a reservation and the commit, or put_start and put_end.
    """
    if context.segments is None:
        return (yield calls.put(key, _raw(address, size_bytes), config))
    stock = _stock(context, config)
    if stock is not None and size_bytes > 0:  # else put_start answers INVALID_PARAMS
        taken = yield from _take_ranges(stock, [size_bytes])
        if taken is not None:
            segment_id, offset, _, _ = taken[0]
            try:
                context.segments.write(segment_id, offset, address, size_bytes)
            except BaseException:
                _put_back(stock, taken)
                raise
            [code] = yield from _commit_ranges(stock, [key], taken, config, single=True)
            return code == 0
    try:
        segment_id, offset = yield calls.put_start(key, size_bytes, config)
    except MooncakedError as exc:
        if exc.code == ErrorCode.OBJECT_ALREADY_EXISTS:
            return False
        raise
    try:
        context.segments.write(segment_id, offset, address, size_bytes)
    except BaseException:
        yield calls.simple("put_revoke", key)
        raise
    yield calls.simple("put_end", key)
    return True


def get_into_address(context, key: str, address: int, size_bytes: int) -> Operation:
    """Copy a value to `address` (room for `size_bytes`); the value's size."""
    if context.segments is None:
        if context.get_staging is not None:
            return (yield from _get_staged(context, key, address, size_bytes))
        return (yield calls.get(key, into=_raw(address, size_bytes)))
    started = time.monotonic()
    location = yield from _shared_location(key)
    if location is None:
        return (yield calls.get(key, into=_raw(address, size_bytes)))
    segment_id, offset, value_size = location[:3]
    if value_size > size_bytes:
        raise error_for(ErrorCode.INVALID_PARAMS,
                        f"the value has {value_size} bytes, the buffer {size_bytes}")
    context.segments.read(segment_id, offset, address, value_size)
    _check_lease(context, started)
    return value_size


# -- batches ----------------------------------------------------------------------------------

def _check_lengths(*sequences: Sequence) -> None:
    if len({len(s) for s in sequences}) > 1:
        raise error_for(ErrorCode.INVALID_PARAMS,
                        "keys and their addresses, sizes or ranges differ in length")


def batch_put_from(context, keys: Sequence[str], addresses: Sequence[int],
                   sizes: Sequence[int], config: ReplicateConfig | None) -> Operation:
    """Per key: 0 stored, 1 already existed, or a negative error code."""
    _check_lengths(keys, addresses, sizes)
    ranges = [[(0, address, size)] for address, size in zip(addresses, sizes)]
    return (yield from batch_put_from_ranges(context, keys, sizes, ranges, config))


def batch_get_into(context, keys: Sequence[str], addresses: Sequence[int],
                   sizes: Sequence[int]) -> Operation:
    """Per key: the value's size, or a negative error code (INVALID_PARAMS when the value is
    larger than its buffer; nothing is copied then)."""
    _check_lengths(keys, addresses, sizes)
    ranges = [[(0, address, size)] for address, size in zip(addresses, sizes)]
    return (yield from batch_get_into_ranges(context, keys, ranges, capacities=sizes))


def _valid_put_ranges(size: int, ranges: Sequence[Range]) -> bool:
    return size > 0 and all(offset >= 0 and length >= 0 and offset + length <= size
                            for offset, _, length in ranges)


def _contiguous(size: int, ranges: Sequence[Range]) -> bool:
    """The ranges fill the object in order, from offset 0 to its end."""
    position = 0
    for offset, _, length in ranges:
        if offset != position:
            return False
        position += length
    return position == size


def _assembled(size: int, ranges: Sequence[Range]) -> list:
    """The object's bytes as payload pieces: views of the caller's memory when the ranges fill
    it in order (no copy), else one buffer they are copied into."""
    if _contiguous(size, ranges):
        return [_raw(address, length) for _, address, length in ranges if length]
    value = bytearray(size)
    base = buffer_address(value)
    for offset, address, length in ranges:
        if length:
            copy_memory(base + offset, address, length)
    return [value]


def batch_put_from_ranges(context, keys: Sequence[str], sizes: Sequence[int],
                          ranges_per_key: Sequence[Sequence[Range]],
                          config: ReplicateConfig | None) -> Operation:
    """Per key: store an object of `sizes[i]` bytes assembled from `ranges_per_key[i]`.
    Per key: 0 stored, 1 already existed, or a negative error code."""
    _check_lengths(keys, sizes, ranges_per_key)
    codes = [_INVALID] * len(keys)
    valid = [i for i in range(len(keys)) if _valid_put_ranges(sizes[i], ranges_per_key[i])]
    if not valid:
        return codes
    if context.segments is None:
        pieces, wire_sizes = [], []
        for i in valid:
            pieces.extend(_assembled(sizes[i], ranges_per_key[i]))
            wire_sizes.append(sizes[i])
        call = Call("batch_put", [[keys[i] for i in valid], wire_sizes,
                                  calls.wire_config(config)], pieces)
        for i, code in zip(valid, (yield call)):
            codes[i] = code
        return codes
    stock = _stock(context, config)
    if stock is not None:
        taken = yield from _take_ranges(stock, [sizes[i] for i in valid])
        if taken is not None:
            try:
                for i, (segment_id, base, _, _) in zip(valid, taken):
                    for offset, address, length in ranges_per_key[i]:
                        if length:
                            context.segments.write(segment_id, base + offset, address, length)
            except BaseException:
                _put_back(stock, taken)
                raise
            committed = yield from _commit_ranges(stock, [keys[i] for i in valid], taken,
                                                  config, single=False)
            for i, code in zip(valid, committed):
                codes[i] = code
            return codes
    placements = yield calls.batch_put_start([keys[i] for i in valid],
                                             [sizes[i] for i in valid], config)
    started = []
    try:
        for i, placement in zip(valid, placements):
            if type(placement) is list:
                segment_id, base = placement
                for offset, address, length in ranges_per_key[i]:
                    if length:
                        context.segments.write(segment_id, base + offset, address, length)
                started.append(i)
                codes[i] = 0
            else:
                codes[i] = 1 if placement == ErrorCode.OBJECT_ALREADY_EXISTS else placement
    except BaseException:
        if started:
            yield calls.simple("batch_put_revoke", [keys[i] for i in started])
        raise
    if started:
        for i, code in zip(started, (yield calls.simple("batch_put_end",
                                                        [keys[i] for i in started]))):
            codes[i] = code
    return codes


def _copy_clipped(source_address: int, value_size: int, ranges: Sequence[Range]) -> None:
    for offset, address, length in ranges:
        count = min(length, value_size - offset)
        if count > 0:
            copy_memory(address, source_address + offset, count)


def batch_get_into_ranges(context, keys: Sequence[str],
                          ranges_per_key: Sequence[Sequence[Range]],
                          capacities: Sequence[int] | None = None) -> Operation:
    """Per key: copy ranges of the value to this process's memory, each clipped at the value's
    end. Per key: the value's size, or a negative error code. With `capacities`, a value larger
    than `capacities[i]` is not copied and gets INVALID_PARAMS."""
    _check_lengths(keys, ranges_per_key)
    results = [_INVALID] * len(keys)
    valid = [i for i in range(len(keys))
             if all(offset >= 0 and length >= 0 for offset, _, length in ranges_per_key[i])]
    if not valid:
        return results
    wanted = [keys[i] for i in valid]
    if context.segments is None:
        values = yield calls.batch_get(wanted, keep_codes=True)
        for i, value in zip(valid, values):
            if isinstance(value, int):
                results[i] = value
            elif capacities is not None and len(value) > capacities[i]:
                results[i] = _INVALID
            else:
                _copy_clipped(buffer_address(value), len(value), ranges_per_key[i])
                results[i] = len(value)
        return results
    started = time.monotonic()
    locations = yield calls.simple("batch_get_replica", wanted)
    for i, location in zip(valid, locations):
        if location == ErrorCode.NO_AVAILABLE_HANDLE:  # on disk, no DRAM to read it into
            try:
                value = yield calls.get(keys[i])
            except MooncakedError as exc:
                results[i] = int(exc.code)
                continue
            if capacities is not None and len(value) > capacities[i]:
                results[i] = _INVALID
            else:
                _copy_clipped(buffer_address(value), len(value), ranges_per_key[i])
                results[i] = len(value)
            continue
        if type(location) is not list:
            results[i] = location
            continue
        segment_id, offset, value_size = location[:3]  # then the tier it was read from
        if capacities is not None and value_size > capacities[i]:
            results[i] = _INVALID
            continue
        source = context.segments.address(segment_id, offset, value_size)
        _copy_clipped(source, value_size, ranges_per_key[i])
        results[i] = value_size
    if _lease_expired(context, started):
        return [int(ErrorCode.LEASE_EXPIRED) if r >= 0 else r for r in results]
    return results
