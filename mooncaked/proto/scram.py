"""The challenge-response of `hello` (wire/PROTOCOL.md section 4.1), SCRAM-SHA-256 style.

Both sides derive keys from the secret the same way; the daemon stores only StoredKey and
ServerKey, never the secret:

    SaltedSecret    = PBKDF2-HMAC-SHA256(secret, salt, iterations, 32 bytes)
    ClientKey       = HMAC-SHA256(SaltedSecret, "Client Key")
    StoredKey       = SHA256(ClientKey)
    ServerKey       = HMAC-SHA256(SaltedSecret, "Server Key")
    ClientSignature = HMAC-SHA256(StoredKey, AuthMessage)
    ClientProof     = ClientKey XOR ClientSignature
    ServerSignature = HMAC-SHA256(ServerKey, AuthMessage)

The daemon recovers ClientKey = ClientProof XOR ClientSignature and checks SHA256(ClientKey)
== StoredKey; the client checks ServerSignature, so it knows the daemon holds ServerKey. The
AuthMessage binds both nonces, the principal and the namespace, so a proof is good for one
handshake only. No I/O here.
"""

from __future__ import annotations

import hashlib
import hmac
import re

MECHANISM = "mooncaked-scram-sha-256-v1"
KEY_BYTES = 32
SALT_BYTES = 16  # salts the project generates; a credentials file may hold 16-64 bytes
MIN_SALT_BYTES = 16
MAX_SALT_BYTES = 64
SERVER_NONCE_BYTES = 32
MIN_CLIENT_NONCE_BYTES = 16
MAX_CLIENT_NONCE_BYTES = 64
# PBKDF2 rounds: at least RFC 7677's minimum; at most what a client accepts to compute (a
# daemon that asks for more is refused rather than let it hang the client).
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 10_000_000
DEFAULT_ITERATIONS = 600_000

# A principal's name: no comma (the AuthMessage separator), no spaces, printable ASCII.
PRINCIPAL_PATTERN = re.compile(r"[A-Za-z0-9._@:+-]{1,255}")


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def salted_secret(secret: bytes, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret, salt, iterations, KEY_BYTES)


def client_key(salted: bytes) -> bytes:
    return _hmac(salted, b"Client Key")


def server_key(salted: bytes) -> bytes:
    return _hmac(salted, b"Server Key")


def stored_key(client_key_: bytes) -> bytes:
    return hashlib.sha256(client_key_).digest()


def verifier(secret: bytes, salt: bytes, iterations: int) -> tuple[bytes, bytes]:
    """(StoredKey, ServerKey): what a credentials file holds for a secret."""
    salted = salted_secret(secret, salt, iterations)
    return stored_key(client_key(salted)), server_key(salted)


def auth_message(principal: str, namespace: str, client_nonce: bytes, server_nonce: bytes,
                 salt: bytes, iterations: int) -> bytes:
    """The bytes both signatures cover: ASCII, comma-separated, binary fields in lowercase hex."""
    return (f"{MECHANISM},p={principal},n={namespace},cn={client_nonce.hex()},"
            f"sn={server_nonce.hex()},s={salt.hex()},i={iterations}").encode()


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def client_proof(client_key_: bytes, message: bytes) -> bytes:
    return xor(client_key_, _hmac(stored_key(client_key_), message))


def proof_matches(stored: bytes, message: bytes, proof: bytes) -> bool:
    """The daemon's check: does `proof` show knowledge of the ClientKey behind `stored`?"""
    if len(proof) != KEY_BYTES or len(stored) != KEY_BYTES:
        return False
    recovered = xor(proof, _hmac(stored, message))
    return hmac.compare_digest(stored_key(recovered), stored)


def server_signature(server_key_: bytes, message: bytes) -> bytes:
    return _hmac(server_key_, message)
