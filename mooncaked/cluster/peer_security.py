"""How peers prove they are members: mutual TLS, a cluster secret, or both.

    security = PeerSecurity.from_config(config)   # None fields: that mechanism is off

Mutual TLS ([tls] enabled in a cluster): each side presents its node certificate and accepts
only certificates signed by [tls] ca_file (mooncaked/tls.py, peer_contexts).

Cluster secret ([cluster] secret_file): a challenge-response in the peer handshake, in which
the secret itself never travels:
  1. the accepting node sends `[2, "peer_challenge", [server_nonce]]` as soon as it accepts;
  2. the connecting node answers `peer_hello [node_id, address, client_nonce, client_proof]`,
     client_proof = HMAC-SHA256(secret, "client" | server_nonce | client_nonce | node_id |
     address), each part preceded by its length (tls.secret_proof);
  3. the accepting node checks the proof (a wrong one closes the connection before any other
     frame is read) and sends `[2, "peer_hello_ok", [server_proof]]`, server_proof =
     HMAC-SHA256(secret, "server" | client_nonce | server_nonce); the connecting node uses the
     link only once that checks too, so it never sends Raft messages or replica bytes to a
     process that does not know the secret.
Nonces are 32 random bytes, fresh per connection, so a recorded handshake cannot be replayed.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from mooncaked import tls

NONCE_BYTES = 32


@dataclass(frozen=True)
class PeerSecurity:
    server_context: ssl.SSLContext | None = None  # accepting side of mutual TLS
    client_context: ssl.SSLContext | None = None  # connecting side
    secret: bytes | None = None
    handshake_timeout_s: float = 10.0

    @classmethod
    def from_config(cls, config) -> "PeerSecurity":
        server = client = None
        if config.tls.enabled:
            server, client = tls.peer_contexts(config.tls)
        secret = tls.read_secret(config.cluster.secret_file) if config.cluster.secret_file \
            else None
        return cls(server, client, secret, config.tls.handshake_timeout_ms / 1000)

    def describe(self) -> str:
        parts = [name for name, on in (("mutual TLS", self.client_context is not None),
                                       ("cluster secret", self.secret is not None)) if on]
        return " and ".join(parts) or "none"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes, node_id: int,
                 address: str) -> bytes:
    return tls.secret_proof(secret, b"client", server_nonce, client_nonce,
                            str(node_id).encode(), address.encode())


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return tls.secret_proof(secret, b"server", client_nonce, server_nonce)
