"""The TLS section of the benchmark (run.py --only tls), per CPU placement: what TLS on the
TCP listener and authentication cost.

Three daemons side by side on the placement's server CPUs, the default event loop, TCP only:
`mcd-tcp` (plain), `mcd-tcp+tls` ([tls] enabled with a certificate of a CA made for the run
with the `openssl` command line, ECDSA P-256; the client verifies it) and `mcd-tcp+auth`
([auth] credentials_file with one principal at the default PBKDF2 iterations: every request
is checked against its role, and each connection authenticates with auth_start + hello; the
client derives its keys once per process, as a real client does). One client process per
trial (the `tcp_ops` worker, tls_worker.py), one op in flight, the daemons' trials
alternating: put and get of 4 KiB and 1 MiB (ops/s = ops / sum of per-op latencies; every
value read back and checked), and connect + TLS handshake / authentication + hello
(connections/s). Around each measurement the daemon's CPU time (utime + stime from /proc):
server CPU per op. The report shows TLS / plain and auth / plain ratios of both, from the
same run.

On both loops a TLS connection's bytes pass through stdlib ssl's MemoryBIOs (mooncaked/tls.py):
a put's payload is decrypted into the segment range, a get's value is encrypted into the
outgoing BIO, so the cost is the cipher plus one extra copy each way.
"""

from __future__ import annotations

import os
import subprocess

from common import GiB, KiB, MiB
from procs import Noise, run_one
from servers import start_mooncaked

LABELS = ("mcd-tcp", "mcd-tcp+tls", "mcd-tcp+auth")
PRINCIPAL = "bench"
OPS = ("tcp_put", "tcp_get")


def config_defaults(cfg) -> None:
    """The TLS section's counts (run.py's Config calls this)."""
    cfg.tls_sizes = [(4 * KiB, 2000), (MiB, 200)]
    cfg.tls_connects = 50
    cfg.tls_segment = GiB  # every trial's values stay stored (fresh keys): 3 x ~210 MiB
    if cfg.quick:
        cfg.tls_sizes = [(4 * KiB, 500), (MiB, 50)]
        cfg.tls_connects = 20


def make_certificates(directory: str) -> dict:
    """A CA and a server certificate for 127.0.0.1 signed by it (keys mode 0600)."""
    os.makedirs(directory, exist_ok=True)
    path = lambda name: os.path.join(directory, name)  # noqa: E731

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *curve, "-keyout", path("ca.key"), "-out", path("ca.pem"),
            "-days", "2", "-subj", "/CN=bench-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign")
    with open(path("server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    openssl("req", *curve, "-keyout", path("server.key"), "-out", path("server.csr"),
            "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", path("server.csr"), "-CA", path("ca.pem"), "-CAkey",
            path("ca.key"), "-CAcreateserial", "-out", path("server.pem"), "-days", "2",
            "-extfile", path("server.ext"))
    for key in ("ca.key", "server.key"):
        os.chmod(path(key), 0o600)
    return {"ca_file": path("ca.pem"), "cert_file": path("server.pem"),
            "key_file": path("server.key")}


def make_credentials(directory: str) -> tuple[str, str]:
    """A credentials file with one principal (admin on every namespace: the worker also
    asks `status`) and its secret."""
    from mooncaked import credentials
    secret = os.urandom(32).hex()
    path = os.path.join(directory, "credentials.toml")
    credentials.write(path, credentials.with_principal(
        credentials.Credentials(),
        credentials.new_principal(PRINCIPAL, secret.encode(), {"*": "admin"})))
    return path, secret


class TLSSection:
    def __init__(self, bench) -> None:
        self.b = bench

    def run(self, pl) -> None:
        b, cfg = self.b, self.b.cfg
        certs = make_certificates(os.path.join(b.workdir, f"tls-certs-{pl.name}"))
        tls_config = {"enabled": True, "cert_file": certs["cert_file"],
                      "key_file": certs["key_file"]}
        credentials_file, secret = make_credentials(os.path.dirname(certs["ca_file"]))
        servers = {}
        try:
            for label, extra in (("mcd-tcp", None), ("mcd-tcp+tls", {"tls": tls_config}),
                                 ("mcd-tcp+auth",
                                  {"auth": {"credentials_file": credentials_file}})):
                server = start_mooncaked(b.py, os.path.join(b.workdir, f"{label}-{pl.name}"),
                                         pl, cfg.tls_segment, None, b.logfile(label),
                                         unix_socket=False, name=label, extra_sections=extra)
                servers[label] = server
                b.info["servers"][f"{label} [{pl.name}]"] = server.command
            outs = {label: [] for label in LABELS}
            noises = {label: [] for label in LABELS}
            for trial in range(cfg.trials):
                for label in LABELS:  # alternating, so drift hits both alike
                    server = servers[label]
                    args = {"address": server.connect["tcp_address"],
                            "ca_file": certs["ca_file"] if label.endswith("+tls") else "",
                            "principal": PRINCIPAL if label.endswith("+auth") else "",
                            "secret": secret if label.endswith("+auth") else "",
                            "sizes": cfg.tls_sizes, "connects": cfg.tls_connects,
                            "server_pids": [server.process.pid],
                            "tag": f"{pl.name}-{label}-{trial}-{os.getpid()}"}
                    try:
                        with Noise(noises[label]):
                            outs[label].append(run_one(b.py, "tcp_ops", args,
                                                       b.logfile(f"tcp_ops-{label}"),
                                                       pl.clients, timeout_s=600))
                    except RuntimeError as exc:
                        b.info["errors"].append(f"{label} [{pl.name}] trial {trial}: {exc}")
                        outs[label].append(None)
                b.log(f"[{pl.name}] tls: round {trial + 1}/{cfg.trials} done")
        finally:
            for server in servers.values():
                b.stop_mooncaked(server)
        for label in LABELS:
            self.rows(pl, label, outs[label], noises[label])

    def rows(self, pl, label: str, out: list, noise: list) -> None:
        results = self.b.results
        ok = [o for o in out if o is not None]
        pad = [None] * (len(out) - len(ok))
        loops = sorted({o["loop"] for o in ok})
        note = f"over TCP, one op in flight; loop {', '.join(loops) or '?'}"
        for op in OPS:
            for size, n in self.b.cfg.tls_sizes:
                key = f"{op}_{size}"
                ms = [o[key] for o in ok]
                results.add(pl.name, label, op, size, "ops/s",
                            [m["ops_s"] for m in ms] + pad, [m["p50_us"] for m in ms],
                            [m["p99_us"] for m in ms], noise, n=n, note=note,
                            errors=sum(m["errors"] for m in ms),
                            cpu=[{"units": m["n"], "bytes": m["n"] * size, "wall_s": m["total_s"],
                                  "server_cpu_s": m["server_cpu_s"],
                                  "client_cpu_s": m["client_cpu_s"]} for m in ms],
                            checked=sum(m.get("checked", 0) for m in ms),
                            bad=sum(m.get("bad", 0) for m in ms))
        ms = [o["tcp_connect"] for o in ok]
        results.add(pl.name, label, "tcp_connect", None, "conn/s",
                    [m["ops_s"] for m in ms] + pad, [m["p50_us"] for m in ms],
                    [m["p99_us"] for m in ms], noise, n=self.b.cfg.tls_connects,
                    note="connect + TLS handshake or authentication (if any) + hello, then close",
                    errors=sum(m["errors"] for m in ms),
                    cpu=[{"units": m["n"], "bytes": 0, "wall_s": m["total_s"],
                          "server_cpu_s": m["server_cpu_s"], "client_cpu_s": m["client_cpu_s"]}
                         for m in ms])
