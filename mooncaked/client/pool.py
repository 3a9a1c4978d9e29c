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
from typing import Callable

from mooncaked.client import auth, calls, operations
from mooncaked.client.api import BlockingCalls
from mooncaked.client.blocking import BlockingClient, parse_address
from mooncaked.client.calls import Call
from mooncaked.client.shared_memory import SharedSegments
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.tls import resolve_client_context

DEFAULT_MAX_CONNECTIONS = 16


class ClientPool(BlockingCalls):
    def __init__(self, address: str, namespace: str, client_name: str,
                 timeout_s: float | None, max_connections: int, map_segments: bool,
                 tls=None, credentials: auth.Credentials | None = None) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._credentials = credentials
        self.address = address
        self.namespace = namespace
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._map_segments = map_segments
        # Resolved once (an SSLContext, or False: plain), so every connection is alike.
        self._tls = (resolve_client_context(tls) or False) if parse_address(address)[0] == "tcp" \
            else False
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
                map_segments: bool = True, *, tls=None, principal: str | None = None,
                secret: bytes | str | None = None) -> "ClientPool":
        """Open the first connection now, so that a wrong address, namespace or credentials
        are reported here (OSError, ValueError or MooncakedError) rather than at the first
        call. `tls`, `principal` and `secret` as BlockingClient.connect takes them."""
        pool = cls(address, namespace, client_name, timeout_s, max_connections, map_segments,
                   tls, auth.resolve(principal, secret))
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
                                            timeout_s=self.timeout_s, map_segments=False,
                                            tls=self._tls, **self._credential_args())
        try:
            self._share_segments(connection)
        except BaseException:
            connection.close()
            raise
        return connection

    def _credential_args(self) -> dict:
        # Resolved once at connect: every connection of the pool is the same principal.
        if self._credentials is None:
            return {}
        return {"principal": self._credentials.principal, "secret": self._credentials.secret}

    def _share_segments(self, connection: BlockingClient) -> None:
        server = connection.server
        key = (server.get("pid"), tuple((s["id"], s.get("shm_path", ""), s["size_bytes"])
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
                self.segments = SharedSegments(server["segments"],
                                               server.get("fd_socket", ""))
                self._segments_key = key
            connection.use_segments(self.segments if key == self._segments_key else None)

    def _borrow(self) -> BlockingClient:
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
            return self._open_counted()  # connecting outside the lock
        if not connection.peer_closed():
            return connection
        # The daemon went away while it was idle: a new connection takes its place (and its
        # place in _open_count).
        connection.close()
        return self._open_counted()

    def _open_counted(self) -> BlockingClient:
        """Open a connection already counted in _open_count; uncount it if that fails."""
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

    # -- BlockingCalls (client/api.py): every call, written once ----------------------------

    def _request(self, call: Call, reads_only: bool):
        return self._run(call, reads_only)

    def _operation(self, start, reads_only: bool):
        return self._drive(start, reads_only)
