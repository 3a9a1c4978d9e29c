"""A client that many threads share: a pool of blocking connections to one daemon.

    client = ClientPool.connect("unix:/run/mooncaked/mooncaked.sock", namespace="llama-3")
    # from any number of threads:
    client.put("block:0", b"...")

Each call borrows a connection, runs its requests on it and gives it back, so concurrent calls
overlap on the wire (one connection each, up to `max_connections`; a call past that waits for
a connection to come back). Connections are opened on demand and kept. Over the Unix socket
the daemon's segments are mapped once and shared by every connection.

A lost connection is replaced on the next call: a call that only reads is sent again once on a
new connection; a call that writes answers RPC_FAIL (-900), since it may or may not have taken
effect (as Mooncake's client reports a failed RPC). An idle connection whose daemon went away
(a restart) is noticed before reuse, so a daemon restart costs no failed call when nothing was
in flight. After a restart with new segments, the new ones are mapped; the old mapping stays
until `close` (a thread may still be copying from it).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from mooncaked.client import calls, operations
from mooncaked.client.blocking import BlockingClient
from mooncaked.client.calls import Call, ReplicateConfig
from mooncaked.client.shared_memory import SharedSegments
from mooncaked.errors import ErrorCode, MooncakedError

DEFAULT_MAX_CONNECTIONS = 16


class ClientPool:
    def __init__(self, address: str, namespace: str, client_name: str,
                 timeout_s: float | None, max_connections: int, map_segments: bool) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.address = address
        self.namespace = namespace
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._map_segments = map_segments
        self._lock = threading.Condition()
        self._idle: list[BlockingClient] = []
        self._open_count = 0  # idle and borrowed connections
        self._closed = False
        self.server: dict = {}
        self.transport_kind = ""
        self.segments: SharedSegments | None = None
        self._segments_key: tuple | None = None  # (daemon pid, segment list) of the mapping
        self._old_segments: list[SharedSegments] = []
        self.reconnects = 0  # connections opened after the first, for tests and metrics

    @classmethod
    def connect(cls, address: str, namespace: str = calls.DEFAULT_NAMESPACE,
                client_name: str = "", timeout_s: float | None = 30.0,
                max_connections: int = DEFAULT_MAX_CONNECTIONS,
                map_segments: bool = True) -> "ClientPool":
        """Open the first connection now, so that a wrong address or namespace is reported
        here (OSError, ValueError or MooncakedError) rather than at the first call."""
        pool = cls(address, namespace, client_name, timeout_s, max_connections, map_segments)
        with pool._lock:
            pool._open_count = 1
        try:
            connection = pool._open()
        except BaseException:
            pool.close()
            raise
        pool._give_back(connection, broken=False)
        return pool

    def __enter__(self) -> "ClientPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def lease_ttl_ms(self) -> int:
        return self.server.get("lease_ttl_ms", 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close idle connections now and borrowed ones as they come back; unmap the segments
        once no call uses them. Safe to call twice and from several threads."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open_count -= len(idle)
            self._lock.notify_all()
        for connection in idle:
            connection.close()
        self._unmap_if_unused()

    # -- connections ------------------------------------------------------------------------

    def _open(self) -> BlockingClient:
        """A new connection (the caller has counted it in _open_count)."""
        connection = BlockingClient.connect(self.address, namespace=self.namespace,
                                            client_name=self.client_name,
                                            timeout_s=self.timeout_s, map_segments=False)
        try:
            self._share_segments(connection)
        except BaseException:
            connection.close()
            raise
        return connection

    def _share_segments(self, connection: BlockingClient) -> None:
        server = connection.server
        key = (server.get("pid"), tuple((s["id"], s["shm_path"], s["size_bytes"])
                                        for s in server.get("segments") or ()))
        with self._lock:
            first = not self.server
            self.server = server
            self.transport_kind = connection.transport_kind
            if not first:
                self.reconnects += 1
            if self._map_segments and key[1] and key != self._segments_key:
                if self.segments is not None:
                    self._old_segments.append(self.segments)
                self.segments = SharedSegments(server["segments"])
                self._segments_key = key
            connection.use_segments(self.segments if key == self._segments_key else None)

    def _borrow(self) -> BlockingClient:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        raise MooncakedError(ErrorCode.RPC_FAIL, "the client is closed")
                    if self._idle:
                        connection = self._idle.pop()
                        break
                    if self._open_count < self.max_connections:
                        self._open_count += 1
                        connection = None
                        break
                    self._lock.wait()
            if connection is None:
                try:
                    return self._open()
                except BaseException as exc:
                    self._forget_one()
                    if isinstance(exc, (OSError, ValueError)):
                        raise MooncakedError(ErrorCode.RPC_FAIL,
                                             f"cannot connect to {self.address}: {exc}") from exc
                    raise
            if not connection.peer_closed():
                return connection
            connection.close()  # the daemon went away while it was idle: open another
            self._forget_one()
            with self._lock:
                self._open_count += 1
            try:
                return self._open()
            except BaseException as exc:
                self._forget_one()
                if isinstance(exc, (OSError, ValueError)):
                    raise MooncakedError(ErrorCode.RPC_FAIL,
                                         f"cannot connect to {self.address}: {exc}") from exc
                raise

    def _forget_one(self) -> None:
        with self._lock:
            self._open_count -= 1
            self._lock.notify()
        self._unmap_if_unused()

    def _give_back(self, connection: BlockingClient, broken: bool) -> None:
        if broken or connection.closed:
            connection.close()
            self._forget_one()
            return
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                self._lock.notify()
                return
        connection.close()
        self._forget_one()

    def _unmap_if_unused(self) -> None:
        with self._lock:
            if not self._closed or self._open_count > 0:
                return
            mappings = self._old_segments + ([self.segments] if self.segments else [])
            self._old_segments, self.segments, self._segments_key = [], None, None
        for mapping in mappings:
            mapping.close()

    def _execute(self, work: Callable[[BlockingClient], object], reads_only: bool):
        """Run `work` on a borrowed connection. When the connection is lost, a read is sent
        again once on a new connection; a write answers RPC_FAIL (outcome unknown)."""
        for attempt in (1, 2):
            connection = self._borrow()
            try:
                result = work(connection)
            except MooncakedError as exc:
                lost = connection.closed
                self._give_back(connection, broken=lost)
                if lost and reads_only and attempt == 1 and not self._closed:
                    continue
                if lost and exc.code != ErrorCode.RPC_FAIL:
                    raise MooncakedError(ErrorCode.RPC_FAIL,
                                         f"connection lost: {exc}") from exc
                raise
            except BaseException:
                self._give_back(connection, broken=True)
                raise
            self._give_back(connection, broken=False)
            return result
        raise AssertionError("unreachable")

    def _run(self, call: Call, reads_only: bool = False):
        return self._execute(lambda connection: connection._run(call), reads_only)

    def _drive(self, make: Callable[[BlockingClient], operations.Operation], reads_only: bool):
        return self._execute(lambda connection: connection.drive(make(connection)), reads_only)

    def call(self, method: str, *params):
        """Any method of wire/PROTOCOL.md without a payload (administration)."""
        return self._run(calls.simple(method, *params))

    # -- values through the socket (or shared memory when local) ----------------------------

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> bool:
        return self._drive(lambda c: operations.put(c, key, value, config), False)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> None:
        self._run(calls.upsert(key, value, config))

    def get(self, key: str) -> bytes:
        return self._drive(lambda c: operations.get(c, key), True)

    def get_into(self, key: str, buffer) -> int:
        return self._run(calls.get(key, into=buffer), True)

    def exists(self, key: str) -> bool:
        return self._run(calls.exists(key), True)

    def get_size(self, key: str) -> int:
        return self._run(calls.get_size(key), True)

    def remove(self, key: str, force: bool = False) -> None:
        self._run(calls.remove(key, force))

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._run(calls.remove_by_regex(pattern, force))

    def remove_all(self, force: bool = False) -> int:
        return self._run(calls.remove_all(force))

    def batch_put(self, keys: Sequence[str], values: Sequence,
                  config: ReplicateConfig | None = None) -> list[int]:
        return self._run(calls.batch_put(keys, values, config))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._run(calls.batch_get(keys), True)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._run(calls.batch_exists(keys), True)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._run(calls.batch_remove(keys, force))

    def ping(self) -> str:
        return self._run(calls.simple("ping"), True)

    # -- values at raw addresses ------------------------------------------------------------

    def put_from(self, key: str, address: int, size_bytes: int,
                 config: ReplicateConfig | None = None) -> bool:
        return self._drive(lambda c: operations.put_from(c, key, address, size_bytes, config),
                           False)

    def get_into_address(self, key: str, address: int, size_bytes: int) -> int:
        return self._drive(lambda c: operations.get_into_address(c, key, address, size_bytes),
                           True)

    def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        return self._drive(
            lambda c: operations.batch_put_from(c, keys, addresses, sizes, config), False)

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        return self._drive(lambda c: operations.batch_get_into(c, keys, addresses, sizes), True)

    def batch_put_from_ranges(self, keys: Sequence[str], sizes: Sequence[int],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              config: ReplicateConfig | None = None) -> list[int]:
        return self._drive(lambda c: operations.batch_put_from_ranges(
            c, keys, sizes, ranges_per_key, config), False)

    def batch_get_into_ranges(self, keys: Sequence[str],
                              ranges_per_key: Sequence[Sequence[operations.Range]],
                              capacities: Sequence[int] | None = None) -> list[int]:
        return self._drive(
            lambda c: operations.batch_get_into_ranges(c, keys, ranges_per_key, capacities), True)

    # -- administration ---------------------------------------------------------------------

    def status(self) -> dict:
        return self._run(calls.simple("status"), True)

    def segment_report(self) -> list[dict]:
        return self._run(calls.simple("segments"), True)

    def objects_list(self, prefix: str = "", regex: str | None = None,
                     namespace: str | None = None, limit: int = 1000) -> list[dict]:
        return self._run(calls.simple("objects_list", prefix, regex, namespace, limit), True)

    def object_stat(self, key: str, namespace: str | None = None) -> dict:
        return self._run(calls.simple("object_stat", key, namespace), True)

    def config_show(self) -> dict:
        return self._run(calls.simple("config_show"), True)
