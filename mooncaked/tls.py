"""TLS for the TCP listener, the clients and the peer links: contexts, file checks, transports.

    context = server_context(config.tls)        # the daemon's TCP listener
    context = peer_contexts(config.tls)          # (server, client) of the peer links: mutual TLS
    context = client_context(ca_file=..., cert_file=..., key_file=...)   # a client
    context = client_context_from_env()          # $MOONCAKED_TLS_CA etc., or None

How TLS runs on both event loops. The io_uring loop (mooncaked/io/uring.py) does no TLS itself
(`create_server(ssl=...)` raises NotImplementedError), so neither loop is asked to: a TLS
connection's protocol is wrapped in `TLSProtocol`, stdlib asyncio's SSLProtocol, which runs an
`ssl.SSLObject` over two `ssl.MemoryBIO`s on top of any transport. asyncio's own
`create_server(ssl=...)` does the same, so both loops run one code path. What it costs: the
ciphertext is received into a 256 KiB buffer and copied into the incoming MemoryBIO, then
decrypted into the buffer the application protocol hands out (for a put's payload: the segment
memory itself); responses are encrypted into the outgoing MemoryBIO and written from there.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import ssl
import stat
from asyncio import sslproto
from typing import Callable

log = logging.getLogger(__name__)

# Client settings from the environment, used when a client is given no TLS context: so that a
# program that only names an address (the Mooncake facade, mooncakectl) can speak TLS.
ENV_CA = "MOONCAKED_TLS_CA"  # CA file that signed the daemon's certificate; set = TLS on
ENV_CERT = "MOONCAKED_TLS_CERT"  # client certificate (for require_client_cert)
ENV_KEY = "MOONCAKED_TLS_KEY"  # its private key
ENV_SERVER_NAME = "MOONCAKED_TLS_SERVER_NAME"  # host name to verify; default: the address's

MIN_SECRET_BYTES = 16


class TLSSetupError(Exception):
    """A TLS or cluster secret file that cannot be used; the message names the file."""


# -- file checks ------------------------------------------------------------------------------

def check_readable(what: str, path: str) -> None:
    if not path:
        raise TLSSetupError(f"{what} is not set")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TLSSetupError(f"{what} {path}: cannot read: {exc.strerror}") from None


def check_private(what: str, path: str) -> None:
    """A key or secret must be readable by its owner alone (like ssh's private keys)."""
    check_readable(what, path)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise TLSSetupError(f"{what} {path} is accessible by group or others (mode 0o{mode:o}); "
                            f"chmod 600 it")


def read_secret(path: str) -> bytes:
    """The cluster secret: the whole file, at least MIN_SECRET_BYTES, owner-only."""
    check_private("[cluster] secret_file", path)
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise TLSSetupError(f"[cluster] secret_file {path} holds {len(secret)} bytes; at least "
                            f"{MIN_SECRET_BYTES} are needed (e.g. `head -c 32 /dev/urandom | "
                            f"base64 > {path}`)")
    return secret


# -- contexts ---------------------------------------------------------------------------------

def _load_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TLSSetupError(f"[tls] cert_file {cert_file} / key_file {key_file}: not a "
                            f"certificate and its matching key: {exc.reason or exc}") from None
    except OSError as exc:
        raise TLSSetupError(f"[tls] cert_file {cert_file} / key_file {key_file}: "
                            f"{exc.strerror or exc}") from None


def _load_ca(context: ssl.SSLContext, what: str, ca_file: str) -> None:
    check_readable(what, ca_file)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TLSSetupError(f"{what} {ca_file}: no usable CA certificate: "
                            f"{exc.reason or exc}") from None


def _harden(context: ssl.SSLContext) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # No TLS 1.2 renegotiation: with it, a write could wait for the peer and keep a view of
    # segment memory queued; without it every write is encrypted at once (see TLSProtocol).
    context.options |= ssl.OP_NO_RENEGOTIATION


def check_config(tls) -> None:
    """Every file [tls] names, checked as start-up uses them (raises TLSSetupError)."""
    server_context(tls)
    if tls.ca_file:
        peer_contexts(tls)


def server_context(tls) -> ssl.SSLContext:
    """The TCP listener's context, from a [tls] section (config.TLSConfig)."""
    check_readable("[tls] cert_file", tls.cert_file)
    check_private("[tls] key_file", tls.key_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(context)
    _load_chain(context, tls.cert_file, tls.key_file)
    if tls.require_client_cert:
        _load_ca(context, "[tls] ca_file", tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def peer_contexts(tls) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts of the peer links: mutual TLS, each side presenting its node
    certificate and accepting only certificates signed by [tls] ca_file. Membership is proven
    by the CA's signature, not by a name: host names are not checked on peer links (nodes
    are addressed by IP and may move)."""
    check_readable("[tls] cert_file", tls.cert_file)
    check_private("[tls] key_file", tls.key_file)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for context in (server, client):
        _harden(context)
        _load_chain(context, tls.cert_file, tls.key_file)
        _load_ca(context, "[tls] ca_file", tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = False
    return server, client


def client_context(ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None) -> ssl.SSLContext:
    """A client's context: the daemon's certificate is verified against `ca_file` (the
    system's CAs without one) and its host name checked; `cert_file`/`key_file` are the
    client's certificate for a daemon with require_client_cert."""
    context = ssl.create_default_context(cafile=ca_file or None)
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise TLSSetupError("a client certificate needs both its cert file and key file")
        try:
            context.load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError) as exc:
            raise TLSSetupError(f"client certificate {cert_file} / key {key_file}: "
                                f"{getattr(exc, 'strerror', None) or exc}") from None
    return context


def client_context_from_env() -> ssl.SSLContext | None:
    """A client context from $MOONCAKED_TLS_CA (and _CERT, _KEY); None when it is unset."""
    ca_file = os.environ.get(ENV_CA)
    if not ca_file:
        return None
    return client_context(ca_file, os.environ.get(ENV_CERT) or None,
                          os.environ.get(ENV_KEY) or None)


def resolve_client_context(tls) -> ssl.SSLContext | None:
    """A client's `tls` argument: an SSLContext is used as it is, False means plain TCP, None
    means the environment's settings (plain when $MOONCAKED_TLS_CA is unset)."""
    if tls is None:
        return client_context_from_env()
    if tls is False:
        return None
    if not isinstance(tls, ssl.SSLContext):
        raise TypeError(f"tls must be an ssl.SSLContext, False or None, not {type(tls).__name__}")
    return tls


def server_name(host: str) -> str:
    return os.environ.get(ENV_SERVER_NAME) or host


# -- TLS over any transport -------------------------------------------------------------------

class TLSProtocol(sslproto.SSLProtocol):
    """asyncio's SSLProtocol, fit for the io_uring transport too.

    SSLProtocol closes a broken connection through the transport's private `_force_close`,
    which only asyncio's own transports have; `abort()` is the public equivalent. A closing
    side sends its close_notify and closes at once (TLS allows it; see _do_shutdown).
    """

    def _fatal_error(self, exc, message="Fatal error on transport"):
        peer = self._transport.get_extra_info("peername") if self._transport else None
        if self._transport:
            self._transport.abort()
        if isinstance(exc, ssl.SSLError):  # a refused handshake: worth a line in the log
            log.info("TLS connection with %s closed: %s: %s", peer, message, exc)
        elif isinstance(exc, OSError):  # a reset: routine, not a bug
            log.debug("TLS connection: %s: %s", message, exc)
        elif not isinstance(exc, asyncio.CancelledError):
            self._loop.call_exception_handler({"message": message, "exception": exc,
                                               "protocol": self})

    def _do_shutdown(self):
        # Send our close_notify and close, without waiting for the peer's: a client that
        # never reads would otherwise hold its connection (and a draining daemon) open until
        # the shutdown timeout.
        try:
            if not self._eof_received:
                self._sslobj.unwrap()
        except sslproto.SSLAgainErrors:
            pass
        except ssl.SSLError as exc:
            self._on_shutdown_complete(exc)
            return
        self._process_outgoing()
        self._on_shutdown_complete(None)

    def _check_shutdown_timeout(self):
        if self._state in (sslproto.SSLProtocolState.FLUSHING,
                           sslproto.SSLProtocolState.SHUTDOWN):
            self._transport.abort()


def server_factory(loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.BaseProtocol],
                   context: ssl.SSLContext, handshake_timeout_s: float
                   ) -> Callable[[], TLSProtocol]:
    """A protocol factory for `create_server`: each connection speaks TLS, and `factory()`'s
    protocol sees the plaintext once the handshake has succeeded (a failed handshake closes the
    connection before that protocol hears of it)."""
    def make() -> TLSProtocol:
        return TLSProtocol(loop, factory(), context, None, server_side=True,
                           ssl_handshake_timeout=handshake_timeout_s)
    return make


async def open_connection(loop: asyncio.AbstractEventLoop,
                          factory: Callable[[], asyncio.BaseProtocol], host: str, port: int,
                          context: ssl.SSLContext, server_hostname: str | None,
                          handshake_timeout_s: float = 60.0, **kwargs):
    """`loop.create_connection` with TLS on any loop: (TLS transport, protocol) once the
    handshake has succeeded; ssl.SSLError (an OSError) when it fails."""
    waiter = loop.create_future()
    app_protocol = factory()
    transport, _ = await loop.create_connection(
        lambda: TLSProtocol(loop, app_protocol, context, waiter, server_side=False,
                            server_hostname=server_hostname,
                            ssl_handshake_timeout=handshake_timeout_s),
        host, port, **kwargs)
    try:
        await waiter
    except BaseException:
        transport.abort()
        raise
    return app_protocol.transport, app_protocol


# -- cluster secret ---------------------------------------------------------------------------

def secret_proof(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the parts under the cluster secret; `role` (b"client" / b"server") keeps
    one side's proof from being replayed as the other's."""
    mac = hmac.new(secret, role, "sha256")
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def proofs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
