"""Handing a segment's file descriptor to the local client allowed to map it (SCM_RIGHTS).

A connection's transport writes asynchronously and cannot carry ancillary data, so the file
descriptors go over a second Unix socket, `<unix_socket>.fd` (wire/PROTOCOL.md section 5.2):
`hello` gives the client one token per segment it may map; the client connects here, sends the
token (TOKEN_BYTES raw bytes), and receives one status byte, with the descriptor attached when
the status is FD_GRANTED. A token is random, single use (taken on first presentation, granted
or not), void after `[server] fd_token_ttl_ms` or when its connection closes, and only the
process that opened the connection (its SO_PEERCRED pid) may redeem it.

The exchange runs on threads of its own (blocking accept, recv, sendmsg), one per client
exchange, each bounded by the token TTL; the token table is shared with the event loop under a
lock.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
FD_GRANTED = 0
FD_REFUSED = 1
MAX_REASON_BYTES = 255
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock) -> int:
    """The pid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(credentials)[0]


class _Token:
    __slots__ = ("connection_id", "pid", "segment_id", "expires_ns")

    def __init__(self, connection_id: int, pid: int, segment_id: int, expires_ns: int) -> None:
        self.connection_id = connection_id
        self.pid = pid
        self.segment_id = segment_id
        self.expires_ns = expires_ns


class FdHandover:
    def __init__(self, path: str, token_ttl_ms: int, segment_fd, max_exchanges: int) -> None:
        self.path = path
        self.token_ttl_ns = token_ttl_ms * 1_000_000
        self._segment_fd = segment_fd  # segment id -> its open fd, or None if it is gone
        self._tokens: dict[bytes, _Token] = {}
        self._lock = threading.Lock()
        self._exchanges = threading.BoundedSemaphore(max_exchanges)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the event loop's side --------------------------------------------------------------

    def issue(self, connection_id: int, pid: int, segment_id: int) -> bytes:
        """A new token for one segment, redeemable once by process `pid`."""
        token = os.urandom(TOKEN_BYTES)
        expires_ns = time.monotonic_ns() + self.token_ttl_ns
        with self._lock:
            self._tokens[token] = _Token(connection_id, pid, segment_id, expires_ns)
        return token

    def forget_connection(self, connection_id: int) -> None:
        """The connection closed (or said hello again): its tokens are void."""
        with self._lock:
            for token in [t for t, v in self._tokens.items() if v.connection_id == connection_id]:
                del self._tokens[token]

    def prune(self) -> None:
        """Drop expired tokens (the daemon's sweep calls this)."""
        now_ns = time.monotonic_ns()
        with self._lock:
            for token in [t for t, v in self._tokens.items() if v.expires_ns <= now_ns]:
                del self._tokens[token]

    def __len__(self) -> int:
        return len(self._tokens)

    # -- the listener -----------------------------------------------------------------------

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.exists(self.path):
                os.unlink(self.path)  # the main socket's check found no daemon alive
            listener.bind(self.path)
            os.chmod(self.path, 0o660)  # as the main socket: the daemon's user and group
            listener.listen(64)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._accept_loop, name="fd-handover",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping = True
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
            except OSError:
                pass
            listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        with self._lock:
            self._tokens.clear()

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._stopping:
            try:
                client, _ = listener.accept()
            except OSError:
                if self._stopping:
                    return
                continue
            if not self._exchanges.acquire(blocking=False):
                self._refuse_quietly(client, "too many fd exchanges at once")
                continue
            threading.Thread(target=self._exchange, args=(client,), name="fd-exchange",
                             daemon=True).start()

    def _exchange(self, client: socket.socket) -> None:
        try:
            client.settimeout(self.token_ttl_ns / 1e9)
            self._serve(client)
        except OSError as exc:
            log.debug("fd exchange failed: %s", exc)
        finally:
            client.close()
            self._exchanges.release()

    def _serve(self, client: socket.socket) -> None:
        token = _receive_exactly(client, TOKEN_BYTES)
        if token is None:
            return _refuse(client, f"expected a token of {TOKEN_BYTES} bytes")
        pid = peer_pid(client)
        with self._lock:
            entry = self._tokens.pop(token, None)  # single use, granted or not
        if entry is None:
            return _refuse(client, "unknown, used or void token")
        if time.monotonic_ns() >= entry.expires_ns:
            return _refuse(client, "the token expired")
        if pid != entry.pid:
            log.warning("fd token of connection %d presented by pid %d, not %d: refused",
                        entry.connection_id, pid, entry.pid)
            return _refuse(client, "the token belongs to another process")
        fd = self._segment_fd(entry.segment_id)
        if fd is None:
            return _refuse(client, f"segment {entry.segment_id} is gone")
        socket.send_fds(client, [bytes([FD_GRANTED])], [fd])

    @staticmethod
    def _refuse_quietly(client: socket.socket, reason: str) -> None:
        try:
            client.settimeout(0)
            _refuse(client, reason)
        except OSError:
            pass
        client.close()


def _receive_exactly(client: socket.socket, count: int) -> bytes | None:
    data = bytearray()
    while len(data) < count:
        chunk = client.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _refuse(client: socket.socket, reason: str) -> None:
    client.sendall(bytes([FD_REFUSED]) + reason.encode()[:MAX_REASON_BYTES])
