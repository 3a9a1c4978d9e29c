"""Results of a run: the rows, the tables printed at the end, the targets, the JSON and the chart.

A row is one measurement: (placement, system, op, size) -> per-trial values, their median and
min-max, and the median over trials of each trial's p50/p99 latency. Systems: `mooncaked`
(BlockingClient, default loop), `mooncaked-facade` (MooncakeDistributedStore over mooncaked),
`mooncaked@asyncio` (rates on the stdlib loop), `mooncake`, `redis`, `machine`.

The chart needs matplotlib, which lives in the bench venv:
    tools/bench/.venv/bin/python tools/bench/report.py chart RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

KiB, MiB = 1024, 1024 ** 2


def human_size(n) -> str:
    if isinstance(n, str) and "x" in n:  # a batch: "128x65536"
        keys, size = n.split("x")
        return f"{keys} x {human_size(int(size))}"
    for unit, factor in (("GiB", 1024 ** 3), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


class Results:
    def __init__(self, rows: list | None = None) -> None:
        self.rows = rows or []

    def add(self, placement, system, op, size, unit, values, p50=None, p99=None, noise=None,
            n=None, note="", errors=0, cpu=None, checked=0, bad=0) -> None:
        """values: one per trial; None = a trial that failed (kept: it is counted and makes the
        row FAIL). cpu: per trial {"units", "bytes", "wall_s", "server_cpu_s",
        "client_cpu_s"}. checked / bad: values read back and checked / that did not match."""
        trials = list(values)
        if not trials:
            return
        ok = [v for v in trials if v is not None]
        failed_trials = len(trials) - len(ok)
        noise = noise or []
        p50 = [x for x in (p50 or []) if x is not None]
        p99 = [x for x in (p99 or []) if x is not None]
        row = {
            "placement": placement, "system": system, "op": op, "size": size, "unit": unit,
            "trials": trials, "trials_ok": len(ok), "failed_trials": failed_trials,
            "median": statistics.median(ok) if ok else None,
            "min": min(ok) if ok else None, "max": max(ok) if ok else None,
            "p50_us": statistics.median(p50) if p50 else None,
            "p99_us": statistics.median(p99) if p99 else None,
            "p50_us_trials": p50, "p99_us_trials": p99,
            "other_cpu_pct_trials": [z["other"] for z in noise],
            "steal_pct_trials": [z["steal"] for z in noise],
            "n": n, "failed_ops": errors, "checked": checked, "check_failed": bad,
            "note": note}
        if cpu:
            units = sum(c["units"] for c in cpu)
            wall = sum(c.get("wall_s") or 0 for c in cpu)
            srv = sum(c["server_cpu_s"] for c in cpu)
            cli = sum(c["client_cpu_s"] for c in cpu)
            nbytes = sum(c.get("bytes") or 0 for c in cpu)
            row["cpu"] = {
                "units": units, "bytes": nbytes, "wall_s": wall, "server_cpu_s": srv,
                "client_cpu_s": cli,
                "units_per_wall_s": units / wall if wall else None,
                # clock ticks are 10 ms: under one tick in all, the servers' share is "< 1 tick"
                "units_per_server_cpu_s": units / srv if srv > 0 else None,
                "units_per_client_cpu_s": units / cli if cli > 0 else None,
                "mb_per_server_cpu_s": nbytes / srv / 1e6 if srv > 0 and nbytes else None,
                "server_cpu_us_per_unit": 1e6 * srv / units if units else None}
        row["status"] = "FAIL" if (errors or bad or failed_trials) else "ok"
        self.rows.append(row)

    def get(self, placement, system, op, size=None):
        row = self.row(placement, system, op, size)
        return None if row is None else row["median"]

    def failed(self, placement, system, op, size=None) -> bool:
        row = self.row(placement, system, op, size)
        return row is not None and row["status"] == "FAIL"

    def row(self, placement, system, op, size=None):
        for r in self.rows:
            if (r["placement"], r["system"], r["op"], r["size"]) == (placement, system, op, size):
                return r
        return None


CLUSTER_OPS = ("cl_", "cross_", "failover_", "transfer_")  # op prefixes of the cluster section
REPLAY_OPS = ("replay_",)
TLS_OPS = ("tcp_",)  # the TLS section's ops


def has_main(res: Results, pl: str) -> bool:
    """Whether the placement has rows of the main sections (not only the cluster section)."""
    return any(r["placement"] == pl and r["system"] != "machine"
               and not r["op"].startswith(CLUSTER_OPS + REPLAY_OPS + TLS_OPS)
               for r in res.rows)


def has_cluster(res: Results, pl: str) -> bool:
    return any(r["placement"] == pl and r["op"].startswith(CLUSTER_OPS) for r in res.rows)


# -- text tables -----------------------------------------------------------------------------

def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown pipe table, padded so it also reads as plain text."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def memcpy_mbps(res: Results):
    gbps = res.get("-", "machine", "memcpy_numpy")
    return gbps * 1000 if gbps else None


def render_machine(res: Results, placements) -> str:
    rows = [["memcpy: numpy.copyto 256 MiB, prefaulted (unpinned)",
             fmt(res.get("-", "machine", "memcpy_numpy")), "GB/s"],
            ["memcpy: bytearray slice copy 256 MiB, prefaulted (unpinned)",
             fmt(res.get("-", "machine", "memcpy_bytearray")), "GB/s"]]
    for pl in placements:
        rows += [[f"[{pl}] TCP loopback bulk, 1 MiB chunks",
                  fmt(res.get(pl, "machine", "tcp_bulk")), "GB/s"],
                 [f"[{pl}] TCP 1-byte ping-pong", fmt(res.get(pl, "machine", "tcp_pingpong")),
                  "ops/s"],
                 [f"[{pl}] Unix socket 1-byte ping-pong",
                  fmt(res.get(pl, "machine", "unix_pingpong")), "ops/s"]]
    return "Machine limits (median of trials)\n\n" + table(["limit", "median", "unit"], rows)


SYSTEMS = [("mooncaked", "mcd"), ("mooncaked+bp", "mcd+bp"), ("mooncaked-facade", "facade"),
           ("mooncaked@asyncio", "mcd@asyncio"), ("mooncake", "MC"),
           ("mooncake-daemon", "MC daemon"), ("redis", "Redis")]
RATIOS = [("mooncake", "mcd/MC"), ("mooncake-daemon", "mcd/MC daemon"), ("redis", "mcd/Redis")]


def cell(row, key="median") -> str:
    """A row's value, marked FAIL when the row failed (failed ops, checks or trials)."""
    if row is None:
        return "-"
    if key == "median":
        value = row["median"]
    else:
        value = (row.get("cpu") or {}).get(key)
        if value is None and row.get("cpu"):
            return "<1 tick" if key == "units_per_server_cpu_s" else "-"
    text = fmt(value)
    if row["status"] == "FAIL":
        text += " FAIL"
    if row.get("failed_trials"):
        text += f" ({row['trials_ok']}/{len(row['trials'])} trials)"
    return text


def systems_table(res: Results, pl: str, lines: list, key: str = "median") -> str:
    """lines: (label, op, size). One column per system that has rows here; mooncaked's
    (busy polling off) ratios to Mooncake, Mooncake's daemon mode and Redis."""
    present = [(s, name) for s, name in SYSTEMS
               if any(res.row(pl, s, op, size) for _, op, size in lines)]
    ratios = [(s, name) for s, name in RATIOS if any(s == p for p, _ in present)]
    rows = []
    for label, op, size in lines:
        row = [label] + [cell(res.row(pl, s, op, size), key) for s, _ in present]
        a = res.row(pl, "mooncaked", op, size)
        for s, _ in ratios:
            b = res.row(pl, s, op, size)
            if key == "median":
                row.append(ratio(a and a["median"], b and b["median"]))
            else:
                row.append(ratio((a or {}).get("cpu", {}).get(key),
                                 (b or {}).get("cpu", {}).get(key)))
        rows.append(row)
    return table(["row"] + [name for _, name in present] + [name for _, name in ratios], rows)


def render_placement(res: Results, pl: str, label: str, sizes: list, info: dict) -> str:
    g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
    out = [f"## Placement `{pl}`: {label}"]
    bp = info.get("busy_poll_us", {})
    out.append("Rows: `mcd` = mooncaked (BlockingClient, default loop) with busy polling OFF "
               "(busy_poll_us = 0), the row every target uses; `mcd+bp` = the same client "
               "against a daemon with busy_poll_us = "
               f"{bp.get(f'mooncaked+bp [{pl}]', '-')} (only where the servers have a CPU the "
               "clients do not use); `facade` = mooncaked's MooncakeDistributedStore; `MC` = "
               "Mooncake in-process (its own segment, local memcpy); `MC daemon` = Mooncake's "
               "client of its `mooncake_client` store process (setup_dummy, shared memory "
               "pool); `Redis` = redis-py + hiredis over the Unix socket. Mooncake, Redis and "
               "the asyncio daemon never busy-poll. `FAIL` = failed ops, failed read-back "
               "checks or failed trials in that row, whatever its speed.")
    byte_lines = [(human_size(size), op, size) for op in ("put", "get") for size in sizes]
    byte_lines = [(f"{op} {lbl}", op, size) for lbl, op, size in byte_lines]
    out.append("put / get of bytes, MB/s (one client, one op in flight; Redis = SET / GET)\n\n"
               + systems_table(res, pl, byte_lines))
    zc_lines = [(f"{op} {human_size(size)}", op, size) for op in ("put_from", "get_into")
                for size in sizes]
    out.append("put_from / get_into, MB/s (mooncaked: shared memory over the Unix socket; "
               "Mooncake in-process: registered buffer, local memcpy; MC daemon: a buffer from "
               "its shared memory pool)\n\n" + systems_table(res, pl, zc_lines))
    like = [(op, g("machine", f"memcpy_{kind}_like", 16 * MiB), g("mooncaked", op, 16 * MiB))
            for op, kind in (("put_from", "put"), ("get_into", "get"))]
    out[-1] += ("\n\nThe same copies as plain memcpy (16 MiB, same count, same buffer reuse, "
                "client CPU): " + "; ".join(
                    f"{op}: memcpy {fmt(m)} MB/s, mooncaked {fmt(a)} MB/s = "
                    + (f"{100 * a / m:.0f}%" if a and m else "-") for op, m, a in like) + ".")
    fresh = [(name, g(system, "put_from_fresh_client", 16 * MiB), g(system, "populate_mapping"))
             for name, system in (("BlockingClient", "mooncaked"), ("facade", "mooncaked-facade"))]
    out[-1] += ("\n\nmooncaked rows run after the client populated its mapping of the "
                "segment (as Mooncake's worker first fills its own segment). A fresh client's "
                "first put_from of 16 MiB: " + "; ".join(
                    f"{name} {fmt(cold)} MB/s (populating its whole mapping: {fmt(pop)} GB/s)"
                    for name, cold, pop in fresh) + ". Fresh segments: mooncaked "
                + (f"prefaulted at start-up, READY after {fmt(g('mooncaked', 'startup'))} s"
                   if g("mooncaked", "startup") is not None else
                   f"cold fill {fmt(g('mooncaked', 'cold_fill'))} MB/s")
                + f"; Mooncake's cold fill {fmt(g('mooncake', 'cold_fill'))} MB/s in-process, "
                  f"{fmt(g('mooncake-daemon', 'cold_fill'))} MB/s into mooncake_client.")
    batch_sizes = sorted({r["size"] for r in res.rows if r["placement"] == pl
                          and r["op"] == "batch_put_from"}, key=str)
    batch_lines = [(f"{op} {human_size(size)}", op, size)
                   for op in ("batch_put_from", "batch_get_into") for size in batch_sizes]
    out.append("Batches, MB/s (latency per batch)\n\n" + systems_table(res, pl, batch_lines))
    rate_lines = [(name, op, None) for op, name in (
        ("exists_1p", "exists, 1 client"), ("exists_2p", "exists, 2 clients"),
        ("put_1p", "put 4 KiB, 1 client"), ("put_2p", "put 4 KiB, 2 clients"),
        ("batch_exists_1p", "batched exists x128, 1 client (keys/s)"))]
    single, batched = g("mooncaked", "exists_1p"), g("mooncaked", "batch_exists_1p")
    out.append("Small ops, aggregate successful ops/s over a fixed window (Mooncake's batched "
               "exists = batch_is_exist, Redis' = a pipeline of 128 EXISTS, of the same "
               "keys)\n\n" + systems_table(res, pl, rate_lines)
               + f"\n\nmooncaked batched exists: {ratio(batched, single)} its own single-call "
                 "rate in keys/s (information; the target compares with Mooncake).")
    cpu_lines = byte_lines + zc_lines + batch_lines + rate_lines
    out.append("Server CPU: operations per second of the servers' CPU time (utime + stime of "
               "every server process from /proc/PID/stat before and after each row: mooncaked; "
               "mooncake_master, plus mooncake_client in daemon mode; redis-server). Mooncake "
               "in-process copies in the client process, so its servers' share is small: read "
               "it beside the client CPU table below. Compare with the ops per wall-second "
               "above.\n\n" + systems_table(res, pl, cpu_lines, "units_per_server_cpu_s")
               + "\n\nClient CPU: operations per second of the client process's CPU time "
                 "(inside the timed calls; rates: the whole window)\n\n"
               + systems_table(res, pl, cpu_lines, "units_per_client_cpu_s"))
    return "\n\n".join(out)


def render_replay(res: Results, info: dict) -> str:
    r = info.get("replay") or {}
    if not r:
        return ""
    pl = r["placement"]
    best = r["ideal"]
    rows = []
    for system, name in SYSTEMS:
        req = res.row(pl, system, "replay_requests")
        if req is None:
            continue
        blocks, gb = res.row(pl, system, "replay_blocks"), res.row(pl, system, "replay_gbps")
        hb, ht = res.row(pl, system, "replay_hit_blocks"), res.row(pl, system, "replay_hit_tokens")
        c = req.get("cpu") or {}
        rows.append([name, cell(req), fmt(blocks and blocks["median"]), fmt(gb and gb["median"]),
                     fmt(req["p50_us"] and req["p50_us"] / 1e3),
                     fmt(req["p99_us"] and req["p99_us"] / 1e3),
                     fmt(hb and hb["median"]), fmt(ht and ht["median"]),
                     fmt(c.get("server_cpu_us_per_unit") and c["server_cpu_us_per_unit"] / 1e3),
                     str(req["failed_ops"]), f"{req['checked']}/{req['check_failed']}",
                     ratio(res.get(pl, "mooncaked", "replay_requests"), req["median"])])
    cap = human_size(r["capacity_bytes"])
    return (f"## Trace replay, placement `{pl}`\n\n"
            f"{r['shape']}. The first {r['requests']} requests of {r['trace']} in trace order: "
            f"{best['blocks']} blocks ({best['unique_blocks']} distinct), {best['tokens']} "
            f"tokens. Per request: batch-exists its blocks, one batched get of the leading "
            f"hits, one batched put of the blocks that did not exist (batches split at "
            f"{human_size(r['max_batch_bytes'])}). Capacity {cap} per store"
            + (" (unlimited: every distinct block fits at 80 %)" if r["unlimited"] else
               " (limited: each store's eviction decides)")
            + f"; every store fresh per trial; trials alternate between the systems. Ideal hit "
              f"rate (every block ever stored still there): {100 * best['hit_rate_blocks']:.2f} % "
              f"of blocks, {100 * best['hit_rate_tokens']:.2f} % of tokens. Throughput over the "
              "sum of the requests' timed store calls; medians over trials.\n\n"
            + table(["system", "requests/s", "blocks/s", "GB/s", "p50 ms", "p99 ms",
                     "hit % blocks", "hit % tokens", "server CPU ms/request", "failed ops",
                     "checked/bad", "mcd / this"], rows))


def spread(row) -> str:
    return "-" if row is None or row["median"] is None else f"{fmt(row['min'])}-{fmt(row['max'])}"


def render_tls(res: Results, pl: str, label: str) -> str:
    """The TLS section of one placement: TLS / plain and auth / plain ratios of ops/s and
    server CPU per op."""
    rows = []
    sizes = sorted({r["size"] for r in res.rows if r["placement"] == pl
                    and r["op"] in ("tcp_put", "tcp_get")})
    lines = [(f"{op[4:]} {human_size(size)}", op, size) for op in ("tcp_put", "tcp_get")
             for size in sizes] + [("connect + handshake/auth + hello", "tcp_connect", None)]

    def ratio(a, b) -> str:
        return fmt(a / b) + "x" if a and b else "-"
    for name, op, size in lines:
        plain, tls, auth = (res.row(pl, system, op, size)
                            for system in ("mcd-tcp", "mcd-tcp+tls", "mcd-tcp+auth"))
        speed = [(r or {}).get("median") for r in (plain, tls, auth)]
        cpu = [((r or {}).get("cpu") or {}).get("server_cpu_us_per_unit")
               for r in (plain, tls, auth)]
        rows.append([name, cell(plain), cell(tls), cell(auth), ratio(speed[1], speed[0]),
                     ratio(speed[2], speed[0]), fmt(cpu[0]), fmt(cpu[1]), fmt(cpu[2]),
                     ratio(cpu[1], cpu[0]), ratio(cpu[2], cpu[0])])
    return (f"## TLS and authentication on TCP, placement `{pl}`: {label}\n\nOne client over "
            "TCP, one op in flight, against a plain daemon, one with [tls] enabled and one "
            "with [auth] (same loop, trials alternating); ops/s (connect: connections/s) and "
            "the daemon's CPU µs per op (summed over trials; 10 ms ticks).\n\n" + table(
                ["op", "plain ops/s", "TLS ops/s", "auth ops/s", "TLS/plain", "auth/plain",
                 "plain server µs/op", "TLS server µs/op", "auth server µs/op",
                 "TLS/plain CPU", "auth/plain CPU"], rows))


def render_cluster(res: Results, pl: str, label: str, info: dict) -> str:
    """The cluster section of one placement: put rates, cross-node get, failover."""
    g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
    c = info.get("cluster", {})
    settings = c.get("settings", {})
    fsync_rate = res.row(pl, "machine", "fdatasync_4k")
    out = [f"## Cluster, placement `{pl}`: {label}; the three daemons share the server CPUs",
           f"Raft logs: fsync = \"{settings.get('fsync', '?')}\" in the work directory on "
           f"{c.get('raft_data_fs', '?')} (not tmpfs); this file system's 4 KiB append + "
           f"fdatasync, one after the other, measured before each trial of the put rates: "
           f"{fmt(fsync_rate and fsync_rate['median'])} ops/s ({spread(fsync_rate)}; p50 "
           f"{fmt(fsync_rate and fsync_rate['p50_us'])} µs): the put rates of the clusters "
           f"follow it. Raft timing: tick_ms "
           f"{settings.get('tick_ms')}, election_ticks {settings.get('election_ticks')}, "
           f"node_ttl_ms {settings.get('node_ttl_ms')}; replica placement "
           f"{settings.get('allocation_strategy')}. busy_poll_us: "
           + ", ".join(f"{k} {v}" for k, v in c.get("busy_poll_us", {}).get(pl, {}).items())
           + (" (equal for every mooncaked daemon of the section; the three nodes share their "
              "CPUs, so none polls)"
              if len(set(c.get("busy_poll_us", {}).get(pl, {}).values())) <= 1 else
              " (NOT EQUAL: the rows are not comparable)")
           + ". Loops of the 3 nodes "
           "(status()['loop']): "
           + ", ".join(f"node{k} {v!r}" for k, v in
                       c.get("loops", {}).get(f"3-node [{pl}]", {}).items())]
    mc1, mc8 = g("mooncake", "cl_put_1p"), g("mooncake", "cl_put_8p")
    rows = []
    for system, name in (("mcd-3node-leader", "3-node cluster, client on the leader"),
                         ("mcd-3node-follower", "3-node cluster, client on a follower"),
                         ("mcd-1node", "1-node cluster (cluster on, one member)"),
                         ("mcd-plain", "plain daemon (cluster off)"),
                         ("mooncake", "Mooncake master (no replication)")):
        one, many = res.row(pl, system, "cl_put_1p"), res.row(pl, system, "cl_put_8p")
        v1, v8 = one and one["median"], many and many["median"]
        is_3 = system.startswith("mcd-3node")
        rows.append([name, fmt(v1), spread(one), fmt(one and one["p50_us"]), fmt(v8),
                     spread(many), fmt(many and many["p50_us"]), ratio(v1, mc1),
                     ratio(v8, mc8),
                     ratio(v1, g("mcd-1node", "cl_put_1p")) if is_3 else "-",
                     ratio(v8, g("mcd-1node", "cl_put_8p")) if is_3 else "-"])
    out.append("put 4 KiB, aggregate ops/s over a fixed window (fresh keys; mooncaked clients "
               "over TCP, each process its own connection; medians, min-max over trials)\n\n"
               + table(["system", "1 client", "min-max", "p50 µs", "8 clients", "min-max",
                        "p50 µs", "1c / MC 1c", "8c / MC 8c", "1c / 1-node", "8c / 1-node"],
                       rows))
    rows = []
    mcb = g("mooncake", "cl_batch_put_1p")
    for system, name in (("mcd-3node-leader", "3-node cluster, client on the leader: batch_put"),
                         ("mcd-3node-follower",
                          "3-node cluster, client on a follower: batch_put"),
                         ("mooncake", "Mooncake master: batch_put_from")):
        r = res.row(pl, system, "cl_batch_put_1p")
        if r is not None:
            rows.append([name, fmt(r["median"]), spread(r), fmt(r["p50_us"]),
                         fmt(r["p99_us"]), ratio(r["median"], mcb)])
    if rows:
        out.append("batch put of 32 x 4 KiB fresh keys per call, 1 client, keys/s (medians, "
                   "min-max over trials; p50/p99 per call)\n\n"
                   + table(["system", "keys/s", "min-max", "p50 µs", "p99 µs", "/ MC"], rows))
    placement = c.get("cross_placement", {}).get(pl, {})
    rows = []
    sizes = sorted({r["size"] for r in res.rows if r["placement"] == pl
                    and r["op"] == "cross_get"})
    for size in sizes:
        row = [human_size(size)]
        for system in ("mcd-3node-via-follower", "mcd-3node-via-leader",
                       "mcd-3node-via-follower-tcp", "mooncake"):
            r = res.row(pl, system, "cross_get", size)
            row += [fmt(r and r["median"] / 1000), spread(r) if r is None else
                    f"{fmt(r['min'] / 1000)}-{fmt(r['max'] / 1000)}",
                    fmt(r and r["median"] * 1e6 / size)]
        m = g("mooncake", "cross_get", size)
        row += [ratio(g("mcd-3node-via-follower", "cross_get", size), m),
                ratio(g("mcd-3node-via-leader", "cross_get", size), m),
                ratio(g("mcd-3node-via-follower-tcp", "cross_get", size), m)]
        rows.append(row)
    puts = "; ".join(
        f"{human_size(size)}: mooncaked {fmt(g('mcd-3node', 'cross_put', size))} MB/s, "
        f"Mooncake A (own segment) {fmt(g('mooncake', 'cross_put', size))} MB/s"
        for size in sizes)
    staging = c.get("cross_staging", {}).get(pl, {})
    out.append("Cross-node get, GB/s and ops/s (one client, one op in flight; mooncaked: the "
               f"replica on follower {placement.get('holder', '?')}'s segment "
               f"(preferred_segments), the client on the Unix socket of follower "
               f"{placement.get('client_node', '?')} or of the leader "
               f"{placement.get('leader', '?')}: node -> the node's get staging area, which "
               "the client maps, one memcpy in the client (get staging offered: "
               + ", ".join(f"{k} {v}" for k, v in staging.items() if not k.startswith("mooncake"))
               + "); `tcp`: the same follower over TCP, node -> node -> client socket; replicas "
               f"verified on the holder: {placement.get('replicas_on_holder', '?')}. Mooncake: "
               "client A holds the data in its own segment, client B (no segment) gets it over "
               "Mooncake's TCP transport)\n\n"
               + table(["size", "via follower GB/s", "min-max", "ops/s", "via leader GB/s",
                        "min-max", "ops/s", "via follower tcp GB/s", "min-max", "ops/s",
                        "MC cross GB/s", "min-max", "ops/s",
                        "follower / MC", "leader / MC", "follower tcp / MC"], rows)
               + f"\n\nThe puts that placed the objects (once, timed): {puts}.")
    rows = []
    for op, name in (("failover_new_leader", "kill -9 leader -> new leader in cluster_status"),
                     ("failover_first_put", "kill -9 leader -> first successful put (follower)"),
                     ("failover_put_gap", "kill -9 leader: longest gap between puts"),
                     ("failover_restart", "restart of the killed node -> settled again"),
                     ("transfer_return", "transfer-leader: call -> answer"),
                     ("transfer_new_leader", "transfer-leader: call -> target is leader"),
                     ("transfer_first_put", "transfer-leader: call -> first successful put"),
                     ("transfer_put_gap", "transfer-leader: longest gap between puts")):
        r = res.row(pl, "mcd-3node", op)
        if r is not None:
            rows.append([name, fmt(r["median"]), spread(r),
                         f"{r.get('trials_ok', len(r['trials']))}/{len(r['trials'])}",
                         "FAIL" if r.get("failed_trials") else "ok"])
    failover = c.get("failover", {}).get(pl, {})
    if rows:
        out.append("Leader failover and handover, ms (a client puts 4 KiB in a loop through a "
                   "follower; medians, min-max over trials)\n\n"
                   + table(["measurement", "median ms", "min-max", "trials ok/run", "status"],
                           rows)
                   + f"\n\nFailed puts during these trials: {failover.get('failed_puts', 0)}; "
                     f"error codes after the event: {failover.get('put_errors_seen') or '-'}.")
    return "\n\n".join(out)


def targets(res: Results, placements: list[str], loops: dict, info: dict | None = None) \
        -> list[dict]:
    """The issue's targets, per placement: measured ratio vs threshold. mooncaked's rows are
    the ones with busy polling off. A target whose rows failed (failed ops, checks or trials)
    is FAIL whatever its ratio."""
    out = []

    def add(pl, name, value, threshold, basis, verdict=None, rows=()):
        failed = [f"{r['system']} {r['op']}" for r in rows if r is not None
                  and r["status"] == "FAIL"]
        status = "-" if value is None else ("PASS" if value >= threshold else "FAIL")
        if failed:
            status, basis = "FAIL", f"{basis}; FAILED ROWS: {', '.join(failed)}"
        out.append({"placement": pl, "target": name, "ratio": value, "threshold": threshold,
                    "basis": basis, "status": verdict or status})

    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    for pl in placements:
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        row = lambda system, op, size=None: res.row(pl, system, op, size)  # noqa: E731
        if not has_main(res, pl):
            continue
        refs = [(s, name) for s, name in (("mooncake", "Mooncake"),
                                          ("mooncake-daemon", "Mooncake daemon mode"))
                if any(r["placement"] == pl and r["system"] == s for r in res.rows)]
        for ref, ref_name in refs:
            for size, threshold in ((MiB, 1.5), (16 * MiB, 1.0)):
                for op in ("put_from", "get_into"):
                    add(pl, f"{op} {human_size(size)} >= {threshold}x {ref_name}",
                        div(g("mooncaked", op, size), g(ref, op, size)), threshold,
                        f"{fmt(g('mooncaked', op, size))} / {fmt(g(ref, op, size))} MB/s",
                        rows=(row("mooncaked", op, size), row(ref, op, size)))
        for op, kind in (("put_from", "put"), ("get_into", "get")):
            a, m = g("mooncaked", op, 16 * MiB), g("machine", f"memcpy_{kind}_like", 16 * MiB)
            add(pl, f"{op} 16 MiB >= 60% of memcpy (same size, count and buffer reuse)",
                div(a, m), 0.6, f"{fmt(a)} / {fmt(m)} MB/s",
                rows=(row("mooncaked", op, 16 * MiB),))
        for ref, ref_name in refs:
            for size in (64 * KiB, MiB):
                for op in ("put", "get"):
                    add(pl, f"{op} {human_size(size)} >= 1.0x {ref_name}",
                        div(g("mooncaked", op, size), g(ref, op, size)), 1.0,
                        f"{fmt(g('mooncaked', op, size))} / {fmt(g(ref, op, size))} MB/s",
                        rows=(row("mooncaked", op, size), row(ref, op, size)))
            for op, name in (("exists_1p", "exists"), ("put_1p", "put 4 KiB")):
                add(pl, f"{name} ops/s, 1 client >= 1.5x {ref_name}",
                    div(g("mooncaked", op), g(ref, op)), 1.5,
                    f"{fmt(g('mooncaked', op))} / {fmt(g(ref, op))} ops/s",
                    rows=(row("mooncaked", op), row(ref, op)))
            add(pl, f"batched exists x128 (keys/s) >= 1.5x {ref_name}'s batch_is_exist of the "
                    "same keys",
                div(g("mooncaked", "batch_exists_1p"), g(ref, "batch_exists_1p")), 1.5,
                f"{fmt(g('mooncaked', 'batch_exists_1p'))} / "
                f"{fmt(g(ref, 'batch_exists_1p'))} keys/s",
                rows=(row("mooncaked", "batch_exists_1p"), row(ref, "batch_exists_1p")))
        default_loop = loops.get(f"mooncaked [{pl}]")
        asyncio_loop = loops.get(f"mooncaked@asyncio [{pl}]")
        same = default_loop is not None and default_loop == asyncio_loop
        for op, name in (("exists_1p", "exists, 1 client"), ("exists_2p", "exists, 2 clients"),
                         ("put_1p", "put 4 KiB, 1 client"), ("put_2p", "put 4 KiB, 2 clients")):
            add(pl, f"our loop >= 1.3x asyncio (both busy polling off): {name}",
                div(g("mooncaked", op), g("mooncaked@asyncio", op)), 1.3,
                f"loop {default_loop!r} vs {asyncio_loop!r}",
                verdict=f"SAME LOOP ({default_loop})" if same else None,
                rows=(row("mooncaked", op), row("mooncaked@asyncio", op)))
    replay = (info or {}).get("replay") or {}
    if replay:
        pl = replay["placement"]
        row = lambda system, op: res.row(pl, system, op)  # noqa: E731
        a, m = res.get(pl, "mooncaked", "replay_requests"), res.get(pl, "mooncake",
                                                                       "replay_requests")
        add(pl, "trace replay requests/s >= 1.5x Mooncake", div(a, m), 1.5,
            f"{fmt(a)} / {fmt(m)} requests/s",
            rows=(row("mooncaked", "replay_requests"), row("mooncake", "replay_requests")))
        if replay.get("unlimited"):
            for key, op in (("hit_rate_blocks", "replay_hit_blocks"),
                            ("hit_rate_tokens", "replay_hit_tokens")):
                got = res.get(pl, "mooncaked", op)
                want = 100 * replay["ideal"][key]
                equal = got is not None and abs(got - want) < 1e-9
                add(pl, f"trace replay hit rate ({op.rsplit('_', 1)[1]}) = the ideal, "
                        "capacity unlimited", None if got is None else (1.0 if equal else 0.0),
                    1.0, f"{fmt(got)} % vs ideal {fmt(want)} %",
                    rows=(row("mooncaked", op),))
    for pl in placements:  # the cluster section's targets
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        row = lambda system, op, size=None: res.row(pl, system, op, size)  # noqa: E731
        if not has_cluster(res, pl):
            continue
        for system, where in (("mcd-3node-follower", "a follower"),
                              ("mcd-3node-leader", "the leader")):
            for op, clients, needed in (("cl_put_1p", "1 client", 0.3),
                                        ("cl_put_8p", "8 clients", 1.0)):
                add(pl, f"cluster put 4 KiB ops/s, {clients} on {where}, 3 nodes, "
                        f"fsync=batch >= {needed:g}x Mooncake's master with {clients}",
                    div(g(system, op), g("mooncake", op)), needed,
                    f"{fmt(g(system, op))} / {fmt(g('mooncake', op))} ops/s",
                    rows=(row(system, op), row("mooncake", op)))
            op = "cl_batch_put_1p"
            add(pl, f"cluster batch_put 32 x 4 KiB keys/s, 1 client on {where}, 3 nodes "
                    ">= 1.0x Mooncake's batch_put_from of the same keys",
                div(g(system, op), g("mooncake", op)), 1.0,
                f"{fmt(g(system, op))} / {fmt(g('mooncake', op))} keys/s",
                rows=(row(system, op), row("mooncake", op)))
        add(pl, "1-node cluster put 4 KiB ops/s, 1 client >= 0.5x the plain daemon",
            div(g("mcd-1node", "cl_put_1p"), g("mcd-plain", "cl_put_1p")), 0.5,
            f"{fmt(g('mcd-1node', 'cl_put_1p'))} / {fmt(g('mcd-plain', 'cl_put_1p'))} ops/s",
            rows=(row("mcd-1node", "cl_put_1p"), row("mcd-plain", "cl_put_1p")))
        for size in (MiB, 16 * MiB):
            for system, where in (("mcd-3node-via-follower", "follower"),
                                  ("mcd-3node-via-leader", "leader")):
                a, m = g(system, "cross_get", size), g("mooncake", "cross_get", size)
                add(pl, f"cross-node get {human_size(size)} (local client on the {where}) "
                        f">= 2.0x Mooncake cross-client TCP get", div(a, m), 2.0,
                    f"{fmt(a)} / {fmt(m)} MB/s",
                    rows=(row(system, "cross_get", size), row("mooncake", "cross_get", size)))
    for pl in placements:  # the SSD tier's (ssd.py)
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        row = lambda system, op, size=None: res.row(pl, system, op, size)  # noqa: E731
        if row("mooncaked+ssd", "ssd_offload", MiB) is None:
            continue
        record = MiB + 4096
        a, f = g("mooncaked+ssd", "ssd_offload", MiB), g("fio", "ssd_write", record)
        add(pl, "SSD offload write >= 80% of fio's sequential write (same records and depth)",
            div(a, f), 0.8, f"{fmt(a)} / {fmt(f)} MB/s",
            rows=(row("mooncaked+ssd", "ssd_offload", MiB), row("fio", "ssd_write", record)))
        a, f = g("mooncaked+ssd", "ssd_hit_get_into", MiB), g("fio", "ssd_read", MiB)
        add(pl, "SSD-hit get_into 1 MiB >= 80% of fio's read at depth 1", div(a, f), 0.8,
            f"{fmt(a)} / {fmt(f)} MB/s",
            rows=(row("mooncaked+ssd", "ssd_hit_get_into", MiB), row("fio", "ssd_read", MiB)))
        for op, size, name in (("ssd_dram_get", 4096, "get 4 KiB"),
                               ("ssd_dram_get_into", MiB, "get_into 1 MiB")):
            a, p = g("mooncaked+ssd", op, size), g("mooncaked", op, size)
            add(pl, f"DRAM-hit {name} with the SSD tier >= 95% of without", div(a, p), 0.95,
                f"{fmt(a)} / {fmt(p)}",
                rows=(row("mooncaked+ssd", op, size), row("mooncaked", op, size)))
        busy = g("mooncaked+ssd", "ssd_hot_p99_offloading", 4096)
        idle = g("mooncaked+ssd", "ssd_hot_p99_idle", 4096)
        add(pl, "DRAM-hit get 4 KiB p99 while offloading <= 1.1x idle (ratio idle / offloading "
                ">= 0.91)", div(idle, busy), 1 / 1.1, f"p99 {fmt(busy)} µs offloading vs "
                f"{fmt(idle)} µs idle",
            rows=(row("mooncaked+ssd", "ssd_hot_p99_offloading", 4096),
                  row("mooncaked+ssd", "ssd_hot_p99_idle", 4096)))
    ssd_replay = ((info or {}).get("ssd") or {}).get("replay") or {}
    if ssd_replay.get("systems"):
        pl = ssd_replay.get("placement") or placements[0]
        with_tier = res.get(pl, "mooncaked+ssd", "replay_small_hit_tokens")
        without = res.get(pl, "mooncaked", "replay_small_hit_tokens")
        best = 100 * ssd_replay["ideal"]["hit_rate_tokens"]
        add(pl, "trace replay, DRAM small: hit rate (tokens) with the SSD tier = the ideal",
            None if with_tier is None else (1.0 if abs(with_tier - best) < 1e-9 else
                                            with_tier / best if best else 0.0), 1.0,
            f"{fmt(with_tier)} % with the tier, {fmt(without)} % DRAM alone, ideal "
            f"{fmt(best)} %", rows=(res.row(pl, "mooncaked+ssd", "replay_small_hit_tokens"),))
    return out


def render_targets(rows: list[dict]) -> str:
    body = [[t["placement"], t["target"], "-" if t["ratio"] is None else f"{t['ratio']:.2f}",
             f"{t['threshold']:g}", t["status"], t["basis"]] for t in rows]
    text = "Targets (ratio = mooncaked / reference, medians)\n\n" + table(
        ["placement", "target", "measured", "needed", "result", "basis"], body)
    same = sorted({t["status"] for t in rows if t["status"].startswith("SAME LOOP")})
    if same:
        text += ("\n\nMOONCAKED_LOOP had no effect: the default daemon and the one started with "
                 "MOONCAKED_LOOP=asyncio report the same loop in status()['loop'] "
                 f"({', '.join(same)}); the loop targets are not judged.")
    return text


def render_all(res: Results) -> str:
    body = []
    for r in res.rows:
        med = r["median"]
        spread = (r["max"] - r["min"]) / 2 / med * 100 if med else 0
        noise = "-"
        if r["other_cpu_pct_trials"]:
            noise = f"{max(r['other_cpu_pct_trials']):.0f}/{max(r['steal_pct_trials']):.0f}"
        size = "" if r["size"] is None else human_size(r["size"])
        c = r.get("cpu") or {}
        srv = c.get("units_per_server_cpu_s")
        body.append([f"{r['placement']} {r['system']} {r['op']} {size}".strip(), fmt(med),
                     r["unit"], "-" if med is None else
                     f"{fmt(r['min'])}-{fmt(r['max'])} (±{spread:.0f}%)",
                     f"{r.get('trials_ok', len(r['trials']))}/{len(r['trials'])}",
                     fmt(r["p50_us"]), fmt(r["p99_us"]), str(r["n"] or "-"),
                     fmt(c.get("units_per_wall_s")),
                     fmt(srv) if srv is not None else ("<1 tick" if c else "-"),
                     fmt(c.get("units_per_client_cpu_s")),
                     str(r.get("failed_ops") or "-"),
                     f"{r.get('checked', 0)}/{r.get('check_failed', 0)}"
                     if r.get("checked") else "-",
                     r.get("status", "ok"), noise, r["note"]])
    return ("All measurements (median over trials of the successful trials; trials = ok/run; "
            "spread = min-max over trials; p50/p99 = median over trials of each trial's per-op "
            "percentile; ops/wall-s = operations (keys for batched exists, requests for the "
            "replay) over the summed per-op latencies or the window; ops/srv-CPU-s = the same "
            "operations over the CPU seconds of the servers (/proc/PID/stat of every server "
            "process: mooncaked; mooncake_master and mooncake_client; redis-server), '<1 tick' "
            "when they used under one 10 ms clock tick in all; ops/cli-CPU-s = over the client "
            "process's CPU seconds; failed = failed operations (keys in batches); checked/bad = "
            "values read back after the timed loops and checked byte for byte / mismatches; "
            "status FAIL = failed ops, failed checks or failed trials; other/steal = max over "
            "trials of CPU used by other processes / hypervisor steal, % of the machine)\n\n"
            + table(["measurement", "median", "unit", "spread", "trials", "p50 µs", "p99 µs",
                     "n/trial", "ops/wall-s", "ops/srv-CPU-s", "ops/cli-CPU-s", "failed",
                     "checked/bad", "status", "other/steal %", "note"], body))


def machine_line(res: Results, info: dict) -> str:
    env = info["env"]
    pl0 = next(iter(info["placements"]), "-")
    return (f"Machine: {env.get('cpu_model', env['cpu'])}, {env.get('cpu_count', '?')} CPUs, "
            f"{env['memory']}; this run's memcpy {fmt(res.get('-', 'machine', 'memcpy_numpy'))} "
            f"GB/s (numpy.copyto 256 MiB), TCP loopback bulk "
            f"{fmt(res.get(pl0, 'machine', 'tcp_bulk'))} GB/s, Unix-socket ping-pong "
            f"{fmt(res.get(pl0, 'machine', 'unix_pingpong'))} ops/s (placement {pl0}).")


def render(res: Results, info: dict) -> str:
    placements = list(info["placements"])
    sizes = [s for s, _ in info["config"]["sizes"]]
    env = info["env"]
    head = [f"# mooncaked vs Mooncake Store vs Redis — {env['date_utc']} UTC",
            f"Command: `{info.get('argv', '?')}`; commit {env['mooncaked_commit']}"
            f"{' + uncommitted changes' if env['mooncaked_tree_dirty'] else ''} (mooncaked "
            f"from {env['mooncaked_src']}); bench commit {env.get('bench_commit', '?')}"
            f"{' + uncommitted changes' if env.get('bench_tree_dirty') else ''}.",
            machine_line(res, info),
            f"{info['config']['trials']} trial(s) per measurement, each in fresh processes, the "
            f"systems' trials alternating; every number is the median over trials. MB/s = 10^6 "
            f"B/s. Single-op throughput = bytes / sum of per-op latencies. Kernel "
            f"{env['kernel']}; Mooncake {env['mooncake']}; "
            f"{env['redis_server'].split(' sha=')[0]}; redis-py {env['redis_py']}.",
            "Log level of every server: " + ", ".join(
                f"{k} {v}" for k, v in (env.get("log_levels") or {}).items()) + "."]
    modes = info.get("mooncake_transfer_mode") or {}
    if modes:
        head.append("Mooncake's transfer mode, from its logs (the in-process workers' and "
                    "mooncake_client's): " + "; ".join(
                        f"[{pl}] " + (", ".join(f"{k} (x{n})" for k, n in seen.items())
                                      or "NO LINE FOUND") for pl, seen in modes.items()))
    if info.get("busy_poll_us"):
        head.append("busy_poll_us of each mooncaked daemon (targets use the 0 rows): " + ", ".join(
            f"{k} = {v}" for k, v in info["busy_poll_us"].items()))
    if info["loops"]:
        head.append("mooncaked loops (status()['loop']): " + ", ".join(
            f"{k} = {v!r}" for k, v in info["loops"].items()))
    if info.get("loop_reasons"):
        head.append("mooncaked loop choice (status()['loop_reason']): " + "; ".join(
            f"{k}: {v}" for k, v in info["loop_reasons"].items()))
    if info.get("drain_wait_s"):
        head.append(f"mooncaked workers waited {info['drain_wait_s']:.0f} s in all (untimed) for "
                    "the previous trial's leased values to be freed")
    if info["errors"]:
        head.append("ERRORS: " + "; ".join(info["errors"]))
    failed = {}
    for r in res.rows:
        if r.get("status") == "FAIL":
            failed[r["system"]] = failed.get(r["system"], 0) + 1
    if failed:
        head.append("ROWS THAT FAILED (failed ops, checks or trials; status column): " + ", ".join(
            f"{k} {v}" for k, v in failed.items()))
    parts = ["\n".join(head)]
    if any(r["system"] == "machine" and r["op"] != "fdatasync_4k" for r in res.rows):
        parts.append(render_machine(res, placements))
    for pl in placements:
        if has_main(res, pl):
            parts.append(render_placement(res, pl, info["placements"][pl], sizes, info))
    for pl in placements:
        if has_cluster(res, pl):
            parts.append(render_cluster(res, pl, info["placements"][pl], info))
    for pl in placements:
        if any(r["placement"] == pl and r["op"].startswith(TLS_OPS) for r in res.rows):
            parts.append(render_tls(res, pl, info["placements"][pl]))
    replay = render_replay(res, info)
    if replay:
        parts.append(replay)
    parts.append(render_targets(targets(res, placements, info["loops"], info)))
    parts.append(render_all(res))
    parts.append("Servers started (each stopped by PID at the end)\n\n" + "\n".join(
        f"    # {k}\n    {v}" for k, v in info["servers"].items()))
    return "\n\n".join(parts)


# -- files -----------------------------------------------------------------------------------

def write(res: Results, info: dict, text: str, out_dir: str, venv_python: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    stamp = info["env"]["date_utc"].replace(" ", "T").replace(":", "")
    base = os.path.join(out_dir, f"bench-{stamp}")
    data = {"info": info, "rows": res.rows,
            "targets": targets(res, list(info["placements"]), info["loops"], info)}
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    written = [base + ".json", base + ".md"]
    if True:  # every run has a chart (whatever rows it has)
        chart = subprocess.run([venv_python, os.path.abspath(__file__), "chart",
                                base + ".json", base + ".png"], capture_output=True, text=True)
        if chart.returncode == 0:
            written.append(base + ".png")
        else:
            print(f"chart failed:\n{chart.stderr}", file=sys.stderr)
    for suffix in (".json", ".md", ".png"):  # stable names for the newest run
        latest = os.path.join(out_dir, "latest" + suffix)
        if os.path.lexists(latest):  # (no chart in this run: no latest.png either)
            os.unlink(latest)
        if os.path.exists(base + suffix):
            os.symlink(os.path.basename(base + suffix), latest)
    return written


def chart(json_path: str, png_path: str) -> None:
    """Throughput by value size, one line per system and op, one column per placement; a
    panel of the trace replay when the run has one; a panel of every row's status otherwise."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(json_path) as f:
        data = json.load(f)
    res = Results(data["rows"])
    placements = [pl for pl in data["info"]["placements"] if has_main(res, pl)]
    sizes = [s for s, _ in data["info"]["config"]["sizes"]]
    replay = data["info"].get("replay")
    lines = [("mooncaked", "put_from", "get_into", "mooncaked put_from / get_into (shm)", "C0", "-"),
             ("mooncaked+bp", "put_from", "get_into", "mooncaked+bp put_from / get_into",
              "C4", "-"),
             ("mooncaked-facade", "put_from", "get_into", "mooncaked facade put_from / get_into",
              "C0", ":"),
             ("mooncaked", "put", "get", "mooncaked put / get (bytes)", "C0", "--"),
             ("mooncake", "put_from", "get_into", "Mooncake put_from / get_into", "C1", "-"),
             ("mooncake", "put", "get", "Mooncake put / get", "C1", "--"),
             ("mooncake-daemon", "put_from", "get_into", "Mooncake daemon put_from / get_into",
              "C3", "-"),
             ("redis", "put", "get", "Redis SET / GET (Unix socket)", "C2", "--")]
    cols = max(1, len(placements)) + (1 if replay else 0)
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 9), squeeze=False)
    for col, pl in enumerate(placements):
        for row, direction in enumerate(("write", "read")):
            ax = axes[row][col]
            for system, wop, rop, name, color, style in lines:
                op = wop if direction == "write" else rop
                ys = [res.get(pl, system, op, s) for s in sizes]
                if any(y is not None for y in ys):
                    ax.plot(sizes, ys, marker="o", color=color, linestyle=style, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [human_size(s) for s in sizes])
            ax.set_title(f"{direction}s, placement {pl}")
            ax.set_xlabel("value size")
            ax.set_ylabel("MB/s (median of trials)")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=7, loc="lower right")
    if replay:
        pl = replay["placement"]
        names = [s for s, _ in SYSTEMS if res.row(pl, s, "replay_requests")]
        for row, (op, ylabel) in enumerate((("replay_requests", "requests/s"),
                                             ("replay_gbps", "GB/s moved"))):
            ax = axes[row][cols - 1]
            values = [res.get(pl, s, op) or 0 for s in names]
            bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
            for bar, s in zip(bars, names):
                if res.failed(pl, s, op):
                    bar.set_hatch("//")
                    ax.annotate("FAIL", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", color="red")
            ax.set_ylabel(ylabel)
            ax.set_title(f"trace replay ({replay['model']}, {replay['requests']} requests)")
            ax.tick_params(axis="x", labelsize=8)
    if not placements and not replay:
        ax = axes[0][0]
        ax.axis("off")
        axes[1][0].axis("off")
        text = "\n".join(f"{r['placement']} {r['system']} {r['op']}: {fmt(r['median'])} "
                         f"{r['unit']} {r.get('status', '')}" for r in res.rows[:40])
        ax.text(0, 1, text or "no rows", va="top", family="monospace", fontsize=7)
    fig.suptitle(f"mooncaked vs Mooncake vs Redis ({data['info']['env']['date_utc']}, "
                 f"{data['info']['env'].get('mooncaked_commit', '')[:12]})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "chart":
        chart(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
