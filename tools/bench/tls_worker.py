"""Worker role of the TLS section (tls_cost.py), dispatched by workers.py:

    tcp_ops   one BlockingClient over TCP, plain or TLS (`ca_file` set: the daemon's
              certificate verified against it) or authenticated (`principal` set, with
              `secret`): connect + hello `connects` times, then for
              each (size, n): n puts of fresh keys, then n gets of them, one op in flight,
              each op timed; the daemon's CPU time around each loop; every value read back is
              checked (outside the timed calls)

Runs under the project's Python.
"""

from __future__ import annotations

import time

from common import CpuWindow, check_value, emit, latency_summary, new_nonce, pattern, stamped

pc = time.perf_counter_ns


def role_tcp_ops(a: dict) -> None:
    from mooncaked import tls
    from mooncaked.client.blocking import BlockingClient
    context = tls.client_context(a["ca_file"]) if a["ca_file"] else False
    credentials = {"principal": a["principal"], "secret": a["secret"]} if a["principal"] \
        else {}

    def connect():
        return BlockingClient.connect(a["address"], namespace="bench", tls=context,
                                      map_segments=False, **credentials)
    connect().close()  # the first connection derives the principal's keys (once a process)
    out = {}
    ns, errors = [], 0
    with CpuWindow(a["server_pids"]) as window:
        for _ in range(a["connects"]):
            start = pc()
            try:
                connect().close()
            except Exception:
                errors += 1
            ns.append(pc() - start)
    out["tcp_connect"] = dict(latency_summary(ns, 0), errors=errors, **window.as_dict())
    client = connect()
    out["loop"] = client.status().get("loop", "?")
    client.put(f"{a['tag']}-warm", b"w" * 4096)  # first request, outside the timings
    client.get(f"{a['tag']}-warm")
    nonce = new_nonce()
    for size, n in a["sizes"]:
        base = pattern(size, size)
        keys = [f"{a['tag']}-{size}-{i}" for i in range(n)]
        values = [stamped(base, size, i, nonce) for i in range(n)]
        ns, errors = [], 0
        with CpuWindow(a["server_pids"]) as window:
            for key, value in zip(keys, values):
                start = pc()
                try:
                    stored = client.put(key, value)
                except Exception:
                    stored = False
                ns.append(pc() - start)
                errors += stored is not True
        out[f"tcp_put_{size}"] = dict(latency_summary(ns, size), errors=errors,
                                      **window.as_dict())
        ns, errors, got = [], 0, []
        with CpuWindow(a["server_pids"]) as window:
            for key in keys:
                start = pc()
                try:
                    value = client.get(key)
                except Exception:
                    value = None
                ns.append(pc() - start)
                got.append(value)
        bad = sum(not check_value(value, base, size, i, nonce) for i, value in enumerate(got))
        errors = sum(value is None for value in got)
        out[f"tcp_get_{size}"] = dict(latency_summary(ns, size), errors=errors, checked=n,
                                      bad=bad, **window.as_dict())
    client.close()
    emit("RESULT", out)


ROLES = {"tcp_ops": role_tcp_ops}
