"""Who may do what: authentication in the handshake and a role check before every handler.

With `[auth] credentials_file` set, a connection is bound to a principal by its `hello`
(wire/PROTOCOL.md section 4.1):
- over TCP or the Unix socket, by the challenge-response of proto/scram.py: `auth_start`
  [principal, client_nonce] answers the principal's salt and iterations and a server nonce;
  `hello` then carries the principal and the proof, and its result the server's signature;
- over the Unix socket, a hello without a principal is bound to the principal the credentials
  file maps the peer's uid (else its primary gid) to, read with SO_PEERCRED.
Every request after hello needs a role on a namespace (`required_role`, from METHOD_ROLES),
checked in daemon/connection.py before the handler runs. Without a credentials file, nothing
is checked (the daemon then warns at start if its TCP listener is not on loopback).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct

from mooncaked import credentials as credentials_file
from mooncaked.credentials import ADMIN, ALL_NAMESPACES, READ, ROLE_RANKS, WRITE
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import scram

log = logging.getLogger(__name__)

# Methods a connection may send before its hello succeeds.
BEFORE_HELLO = frozenset({"hello", "auth_start"})

# Which namespace a method's role is needed on.
CONNECTION = "connection"  # the namespace the connection is bound to
DAEMON = "daemon"  # the daemon as a whole: "*" (a role on every namespace)

# Every client method: None (no role), or (role, where). `where` is CONNECTION, DAEMON, or the
# index of a namespace parameter: naming another namespace than the connection's (or "*")
# needs admin on that namespace. A method missing here needs admin on "*".
METHOD_ROLES: dict[str, tuple | None] = {
    "hello": None, "auth_start": None, "ping": None,
    **{m: (READ, CONNECTION) for m in (
        "get", "exists", "get_size", "batch_get", "batch_exists", "get_replica",
        "batch_get_replica", "get_staged", "release_staged")},
    **{m: (WRITE, CONNECTION) for m in (
        "put", "upsert", "remove", "remove_by_regex", "remove_all", "batch_put",
        "batch_remove", "put_start", "put_end", "put_revoke", "batch_put_start",
        "batch_put_end", "batch_put_revoke", "reserve", "put_commit", "batch_put_commit")},
    # The transfer engine: a segment serving the client's own memory (daemon/transfer_segments).
    **{m: (WRITE, CONNECTION) for m in (
        "te_open", "te_attach", "te_register", "te_unregister", "te_submit", "te_status",
        "te_wait", "te_free", "te_buffers", "te_notify", "te_notifies", "te_probe",
        "te_close")},
    "objects_list": (READ, 2),
    "object_stat": (READ, 1),
    **{m: (ADMIN, DAEMON) for m in (
        "status", "segments", "config_show", "cluster_status", "cluster_add",
        "cluster_remove", "cluster_transfer_leader", "cluster_drain", "cluster_settings_set",
        # Quotas bound every tenant: set and read by the operator, not by a tenant's admin.
        "quota_list", "quota_set")},
}

_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


_ADMIN_ON_ALL = (ADMIN, DAEMON)


def required_role(method: str, params: list, namespace: str) -> tuple[str, str] | None:
    """(role, namespace) a request needs, or None."""
    entry = METHOD_ROLES.get(method, _ADMIN_ON_ALL)
    if entry is None:
        return None
    role, where = entry
    if where is CONNECTION:
        return role, namespace
    if where is DAEMON:
        return role, ALL_NAMESPACES
    if len(params) > where:
        named = params[where]
        if type(named) is str and named != namespace:
            return ADMIN, named
    return role, namespace


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address


def _failed() -> MooncakedError:
    # One answer for an unknown principal, a wrong secret and a proof without a challenge.
    return MooncakedError(ErrorCode.AUTH_FAILED, "authentication failed")


class Authenticator:
    def __init__(self, path: str, credentials: credentials_file.Credentials) -> None:
        self.path = path
        self._use(credentials)

    @classmethod
    def load(cls, path: str) -> "Authenticator":
        """Raises CredentialsError naming the file and the principal when it is not usable."""
        return cls(path, credentials_file.load(path))

    def _use(self, credentials: credentials_file.Credentials) -> None:
        self.credentials = credentials
        with_secret = [p for p in credentials.principals.values() if p.has_secret]
        # An unknown principal gets a salt and iterations that look like a real one's, and the
        # same salt each time (derived from the server keys, which only the daemon knows).
        seed = b"".join(sorted(p.server_key for p in with_secret)) or os.urandom(32)
        self._decoy_key = hashlib.sha256(b"decoy salt\0" + seed).digest()
        counts = collections.Counter(p.iterations for p in with_secret)
        self._decoy_iterations = (counts.most_common(1)[0][0] if counts
                                  else scram.DEFAULT_ITERATIONS)

    def reload(self) -> None:
        """SIGHUP: read the file again; keep the old credentials if the new file is bad.
        Connections keep their principal; its roles are looked up anew at every request."""
        try:
            credentials = credentials_file.load(self.path)
        except credentials_file.CredentialsError as exc:
            log.error("credentials not reloaded, the previous ones stay in use: %s", exc)
            return
        self._use(credentials)
        log.info("credentials reloaded from %s: %d principal(s)", self.path,
                 len(credentials.principals))

    # -- the handshake ----------------------------------------------------------------------

    def _decoy(self, principal: str) -> tuple[bytes, int]:
        salt = hmac.new(self._decoy_key, principal.encode(), hashlib.sha256).digest()
        return salt[:scram.SALT_BYTES], self._decoy_iterations

    def start(self, conn, principal: str, client_nonce: bytes) -> dict:
        """auth_start: the challenge, remembered on the connection for its hello."""
        known = self.credentials.principals.get(principal)
        if known is not None and known.has_secret:
            salt, iterations = known.salt, known.iterations
        else:
            salt, iterations = self._decoy(principal)
        server_nonce = os.urandom(scram.SERVER_NONCE_BYTES)
        conn.auth_challenge = (principal, client_nonce, server_nonce, salt, iterations)
        return {"salt": salt, "iterations": iterations, "server_nonce": server_nonce}

    def authenticate(self, conn, options: dict, namespace: str) -> dict:
        """Check hello's credentials; bind the connection's principal. The hello result's
        extra fields. Raises AUTH_FAILED (the connection is then closed) or
        PERMISSION_DENIED (no role on the namespace)."""
        challenge, conn.auth_challenge = conn.auth_challenge, None  # one hello per challenge
        name, proof = options.get("principal"), options.get("proof")
        result: dict = {}
        if name is None and proof is None:
            principal = self._peer_principal(conn)
        else:
            if type(name) is not str or type(proof) is not bytes:
                raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                     "principal must be a str and proof a bin, both or neither")
            principal, result["server_signature"] = self._check_proof(conn, challenge, name,
                                                                      proof, namespace)
        if principal.rank(namespace) == 0:
            raise MooncakedError(ErrorCode.PERMISSION_DENIED,
                                 f"principal {principal.name!r} has no role on namespace "
                                 f"{namespace!r}")
        conn.principal = principal.name
        result["principal"] = principal.name
        log.debug("connection %d: principal %s, namespace %s", conn.connection_id,
                  principal.name, namespace)
        return result

    def _check_proof(self, conn, challenge, name: str, proof: bytes,
                     namespace: str) -> tuple[credentials_file.Principal, bytes]:
        """The principal a proof is good for, and the daemon's signature; else AUTH_FAILED."""
        if challenge is None or challenge[0] != name:
            log.warning("connection %d: hello of principal %r without its auth_start",
                        conn.connection_id, name)
            raise _failed()
        _, client_nonce, server_nonce, salt, iterations = challenge
        message = scram.auth_message(name, namespace, client_nonce, server_nonce, salt,
                                     iterations)
        principal = self.credentials.principals.get(name)
        if principal is None or not principal.has_secret:
            scram.proof_matches(self._decoy_key, message, proof)  # the same work as a real check
            matched = False
        else:
            matched = scram.proof_matches(principal.stored_key, message, proof)
        if not matched:
            log.warning("connection %d (%s): authentication of principal %r failed",
                        conn.connection_id, self._peer_name(conn), name)
            raise _failed()
        return principal, scram.server_signature(principal.server_key, message)

    def _peer_principal(self, conn):
        if conn.transport_kind != "unix":
            raise MooncakedError(ErrorCode.AUTH_FAILED,
                                 "authentication required: send auth_start, then hello with "
                                 "principal and proof")
        try:
            sock = conn.transport.get_extra_info("socket")
            _, uid, gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except (OSError, AttributeError) as exc:
            log.warning("connection %d: no peer credentials: %s", conn.connection_id, exc)
            raise _failed() from None
        principal = (self.credentials.by_uid.get(uid) or self.credentials.by_gid.get(gid))
        if principal is None:
            log.warning("connection %d: uid %d gid %d maps to no principal",
                        conn.connection_id, uid, gid)
            raise MooncakedError(ErrorCode.AUTH_FAILED,
                                 f"authentication required: uid {uid} (gid {gid}) maps to no "
                                 "principal; send auth_start, then hello with principal and "
                                 "proof")
        return principal

    @staticmethod
    def _peer_name(conn) -> str:
        peer = conn.transport.get_extra_info("peername") if conn.transport else None
        return str(peer) if peer else conn.transport_kind

    # -- every request ----------------------------------------------------------------------

    def may_read_every_namespace(self, conn) -> bool:
        """Whether the connection's principal holds read (or more) on "*": mapping the shared
        segments shows the bytes of every namespace that has no pool of its own."""
        principal = self.credentials.principals.get(conn.principal)
        return principal is not None and principal.rank(ALL_NAMESPACES) >= ROLE_RANKS[READ]

    def authorize(self, conn, method: str, params: list) -> None:
        """PERMISSION_DENIED unless the connection's principal has the role `method` needs."""
        needed = required_role(method, params, conn.namespace)
        if needed is None:
            return
        role, namespace = needed
        principal = self.credentials.principals.get(conn.principal)
        rank = principal.rank(namespace) if principal is not None else 0
        if rank >= ROLE_RANKS[role]:
            return
        self._deny(conn, method, role, namespace, rank)

    @staticmethod
    def _deny(conn, method: str, role: str, namespace: str, rank: int) -> None:
        held = next((r for r, n in ROLE_RANKS.items() if n == rank), "no role")
        where = "every namespace (\"*\")" if namespace == ALL_NAMESPACES \
            else f"namespace {namespace!r}"
        raise MooncakedError(ErrorCode.PERMISSION_DENIED,
                             f"{method} needs role {role} on {where}; principal "
                             f"{conn.principal!r} has {held}")
