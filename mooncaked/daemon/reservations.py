"""Reservations: segment ranges granted to a local connection ahead of its puts.

A local client (Unix socket, shared memory) that holds a reserved range of the right size
copies a value into it and commits it under a key in one request (`put_commit`), whose answer
also refills its stock: one round trip per put instead of two (put_start, put_end).

In the state machine a reservation is an unfinished put (PutStart) under a key of
RESERVED_NAMESPACE, which no client can name, written by the connection: invisible, not
evictable, counted as used (and against the quota of the connection's namespace, so that
reserving cannot get around it), and revoked by the release sweep after
`put_start_release_timeout_ms` like any unfinished put. PutCommit moves it to the real key.
This table maps each granted range to its reservation and bounds what one connection holds
(`[server] max_reserved_bytes_per_connection`, by the ranges' sizes, as the client counts
them).
"""

from __future__ import annotations

import itertools
import logging

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import commands
from mooncaked.meta.master import ReplicateConfig

log = logging.getLogger(__name__)

_ONE_REPLICA = ReplicateConfig()


class Reservation:
    __slots__ = ("connection_id", "reserved_key", "size_bytes")

    def __init__(self, connection_id: int, reserved_key, size_bytes: int) -> None:
        self.connection_id = connection_id
        self.reserved_key = reserved_key
        self.size_bytes = size_bytes


class Reservations:
    def __init__(self, master, max_bytes_per_connection: int) -> None:
        self.master = master
        self.max_bytes_per_connection = max_bytes_per_connection
        # Every range granted and not yet committed or freed, by (segment_id, offset).
        self.by_range: dict[tuple[int, int], Reservation] = {}
        self._names = itertools.count(1)

    def __len__(self) -> int:
        return len(self.by_range)

    def reserved_bytes(self) -> int:
        return sum(r.size_bytes for r in self.by_range.values())

    def grant(self, conn, wanted: list[tuple[int, int]], now_ms: int) -> list[list[int]]:
        """Reserve up to `count` ranges of each `size`, within the connection's bound and the
        free space (a reservation may evict, like the put it stands for). Returns the ranges
        granted as [segment_id, offset, size]; fewer than asked when a bound or space ends."""
        granted = []
        master = self.master
        for size_bytes, count in wanted:
            for _ in range(count):
                if conn.reserved_bytes + size_bytes > self.max_bytes_per_connection:
                    break
                # Reserved bytes count against the connection's namespace's quota, and lie
                # in the pool of that namespace, which the connection maps.
                key = (commands.RESERVED_NAMESPACE, commands.reservation_name(
                    conn.namespace, conn.connection_id, next(self._names)))
                try:
                    replicas = master.put_start(key, size_bytes, _ONE_REPLICA, False,
                                                conn.connection_id, now_ms,
                                                owner_namespace=conn.namespace)
                except MooncakedError:
                    break  # no space (after eviction), the object table is full, or quota
                replica = replicas[0]
                where = (replica.segment_id, replica.offset)
                self.by_range[where] = Reservation(conn.connection_id, key, size_bytes)
                conn.reservations.add(where)
                conn.reserved_bytes += size_bytes
                granted.append([replica.segment_id, replica.offset, size_bytes])
        return granted

    def owned(self, conn, segment_id: int, offset: int, size_bytes: int) -> Reservation:
        """The connection's reservation at a range, checked against the value's size."""
        reservation = self.by_range.get((segment_id, offset))
        if reservation is None:
            raise MooncakedError(ErrorCode.INVALID_WRITE,
                                 f"no reservation at segment {segment_id} offset {offset}")
        if reservation.connection_id != conn.connection_id:
            raise MooncakedError(ErrorCode.ILLEGAL_CLIENT,
                                 "the range is reserved by another connection")
        if reservation.size_bytes != size_bytes:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"the reserved range has {reservation.size_bytes} bytes, "
                                 f"the value {size_bytes}")
        return reservation

    def commit(self, conn, key, segment_id: int, offset: int, size_bytes: int,
               config: ReplicateConfig, now_ms: int) -> bool:
        """Store the connection's reserved range as `key`: True stored, False the key existed
        (the range stays reserved). Raises for a range the connection does not hold."""
        reservation = self.owned(conn, segment_id, offset, size_bytes)
        try:
            self.master.put_commit(reservation.reserved_key, key, size_bytes, config,
                                   conn.connection_id, now_ms)
        except MooncakedError as exc:
            if exc.code == ErrorCode.OBJECT_ALREADY_EXISTS:
                return False
            if exc.code in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.INVALID_WRITE):
                self._forget(conn, (segment_id, offset))  # released meanwhile (timeout)
                raise MooncakedError(ErrorCode.INVALID_WRITE,
                                     "the reservation was released") from None
            raise
        self._forget(conn, (segment_id, offset))  # now the object's replica
        return True

    def release(self, conn, ranges: list[tuple[int, int]]) -> None:
        """Free reservations the connection gives back; ranges it does not hold are ignored."""
        for where in ranges:
            reservation = self.by_range.get(where)
            if reservation is None or reservation.connection_id != conn.connection_id:
                continue
            self._revoke(conn, where, reservation)

    def release_all(self, conn) -> None:
        """The connection closed: free everything it holds."""
        for where in list(conn.reservations):
            reservation = self.by_range.get(where)
            if reservation is not None:
                self._revoke(conn, where, reservation)
        conn.reservations.clear()
        conn.reserved_bytes = 0

    def forget_released(self, connections) -> None:
        """Drop the reservations the release sweep revoked (past the release timeout)."""
        objects = self.master.state.objects
        by_id = {conn.connection_id: conn for conn in connections}
        for where, reservation in list(self.by_range.items()):
            entry = objects.get(reservation.reserved_key)
            if entry is None or entry.pending is None:
                conn = by_id.get(reservation.connection_id)
                if conn is not None:
                    self._forget(conn, where)
                else:
                    del self.by_range[where]

    def _revoke(self, conn, where, reservation: Reservation) -> None:
        try:
            self.master.put_revoke(reservation.reserved_key, conn.connection_id)
        except MooncakedError as exc:  # already released by the sweep
            log.debug("releasing %r: %s", reservation.reserved_key, exc)
        self._forget(conn, where)

    def _forget(self, conn, where) -> None:
        reservation = self.by_range.pop(where, None)
        if reservation is not None and where in conn.reservations:
            conn.reservations.discard(where)
            conn.reserved_bytes -= reservation.size_bytes
