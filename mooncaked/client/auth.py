"""A client's credentials and its side of the handshake (wire/PROTOCOL.md section 4.1).

Credentials come from the caller, else from the environment, so that code that does not know
about authentication (the Mooncake facade, engines) authenticates too:

    MOONCAKED_PRINCIPAL    the principal's name
    MOONCAKED_SECRET       its secret, or
    MOONCAKED_SECRET_FILE  a file holding it (trailing newlines are not part of the secret)

With credentials, the client runs the challenge-response of proto/scram.py and checks the
daemon's signature: a daemon that cannot prove it holds the principal's verifier (or that does
not authenticate at all) is refused. Without, it sends a plain hello (a daemon with
authentication off, or a Unix socket peer the daemon maps by uid).
"""

from __future__ import annotations

import functools
import hmac
import os
from dataclasses import dataclass, field

from mooncaked.client import calls
from mooncaked.client.calls import Call
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import scram

PRINCIPAL_ENV = "MOONCAKED_PRINCIPAL"
SECRET_ENV = "MOONCAKED_SECRET"
SECRET_FILE_ENV = "MOONCAKED_SECRET_FILE"
CLIENT_NONCE_BYTES = 32


@dataclass(frozen=True)
class Credentials:
    principal: str
    secret: bytes = field(repr=False)


def read_secret_file(path: str) -> bytes:
    """A secret file's content without its trailing newlines; ValueError if that is empty."""
    with open(path, "rb") as f:
        secret = f.read().rstrip(b"\r\n")
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def resolve(principal: str | None = None, secret: bytes | str | None = None,
            secret_file: str | None = None, environ=None) -> Credentials | None:
    """The credentials to use: the arguments, else the environment; None for none at all.
    ValueError when only half of a pair is there."""
    environ = os.environ if environ is None else environ
    if principal is None:
        principal = environ.get(PRINCIPAL_ENV) or None
    if secret is None and secret_file is None:
        secret = environ.get(SECRET_ENV) or None
        if secret is None:
            secret_file = environ.get(SECRET_FILE_ENV) or None
    if secret is None and secret_file is not None:
        secret = read_secret_file(secret_file)
    if isinstance(secret, str):
        secret = secret.encode()
    if principal is None and secret is None:
        return None
    if principal is None:
        raise ValueError(f"a secret was given without a principal (set {PRINCIPAL_ENV} or pass "
                         "principal)")
    if not secret:
        raise ValueError(f"principal {principal!r} needs a secret: pass secret, or set "
                         f"{SECRET_ENV} or {SECRET_FILE_ENV}")
    return Credentials(principal, secret)


@functools.lru_cache(maxsize=16)
def _client_and_server_key(secret: bytes, salt: bytes, iterations: int) -> tuple[bytes, bytes]:
    # PBKDF2 is slow on purpose: a pool's connections derive the keys once.
    salted = scram.salted_secret(secret, salt, iterations)
    return scram.client_key(salted), scram.server_key(salted)


def _refused(message: str) -> MooncakedError:
    return MooncakedError(ErrorCode.AUTH_FAILED, message)


def handshake(namespace: str, client_name: str, credentials: Credentials | None):
    """The handshake as an operation (client/operations.py): yields Calls, returns hello's
    result."""
    if credentials is None:
        return (yield calls.hello(namespace, client_name))
    client_nonce = os.urandom(CLIENT_NONCE_BYTES)
    try:
        challenge = yield Call("auth_start", [credentials.principal, client_nonce])
    except MooncakedError as exc:
        if exc.code == ErrorCode.NOT_SUPPORTED:
            raise _refused("credentials were given but the daemon does not authenticate "
                           f"(it answered: {exc.message})") from None
        raise
    salt, iterations, server_nonce = _challenge(challenge)
    client_key, server_key = _client_and_server_key(credentials.secret, salt, iterations)
    message = scram.auth_message(credentials.principal, namespace, client_nonce, server_nonce,
                                 salt, iterations)
    result = yield calls.hello(namespace, client_name, principal=credentials.principal,
                              proof=scram.client_proof(client_key, message))
    signature = result.get("server_signature") if isinstance(result, dict) else None
    if type(signature) is not bytes or not hmac.compare_digest(
            signature, scram.server_signature(server_key, message)):
        raise _refused("the daemon's server_signature does not match: it does not hold this "
                       "principal's verifier (not the daemon the credentials were made for)")
    return result


def _challenge(challenge) -> tuple[bytes, int, bytes]:
    if not isinstance(challenge, dict):
        raise _refused("auth_start answered no challenge map")
    salt, iterations = challenge.get("salt"), challenge.get("iterations")
    server_nonce = challenge.get("server_nonce")
    if type(salt) is not bytes or type(server_nonce) is not bytes or not salt \
            or not server_nonce:
        raise _refused("auth_start answered a challenge without salt or server_nonce")
    if type(iterations) is not int or \
            not scram.MIN_ITERATIONS <= iterations <= scram.MAX_ITERATIONS:
        raise _refused(f"auth_start asked for {iterations!r} iterations, outside "
                       f"{scram.MIN_ITERATIONS}..{scram.MAX_ITERATIONS}")
    return salt, iterations, server_nonce
