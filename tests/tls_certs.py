"""Test certificates, made with the `openssl` command line: a CA, and certificates it signs.

    certs = make_pki(directory)   # certs.ca, certs.server_cert/key (127.0.0.1, localhost),
                                  # certs.client_cert/key, certs.other_ca (trusts nothing of ours)
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_cert: str  # signed by other_ca: a stranger's certificate
    other_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(directory: str, name: str) -> tuple[str, str]:
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_cert(directory: str, name: str, ca: tuple[str, str],
              alt_names: str = "IP:127.0.0.1,DNS:localhost") -> tuple[str, str]:
    """A certificate for both server and client use, signed by `ca`; its key mode 0600."""
    cert, key = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
    request = os.path.join(directory, f"{name}.csr")
    extensions = os.path.join(directory, f"{name}.ext")
    with open(extensions, "w") as f:
        f.write(f"subjectAltName={alt_names}\nextendedKeyUsage=serverAuth,clientAuth\n"
                "basicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", request, "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", extensions)
    os.chmod(key, 0o600)
    return cert, key


def make_pki(directory: str) -> Pki:
    ca = make_ca(directory, "ca")
    server = make_cert(directory, "server", ca)
    client = make_cert(directory, "client", ca, "DNS:client")
    other_ca = make_ca(directory, "other-ca")
    other = make_cert(directory, "other", other_ca)
    return Pki(ca[0], *server, *client, other_ca[0], *other)
