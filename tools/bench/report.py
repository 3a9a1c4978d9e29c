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
            n=None, note="", errors=0) -> None:
        values = [v for v in values if v is not None]
        if not values:
            return
        noise = noise or []
        self.rows.append({
            "placement": placement, "system": system, "op": op, "size": size, "unit": unit,
            "trials": values, "median": statistics.median(values),
            "min": min(values), "max": max(values),
            "p50_us": statistics.median(p50) if p50 else None,
            "p99_us": statistics.median(p99) if p99 else None,
            "p50_us_trials": p50 or [], "p99_us_trials": p99 or [],
            "other_cpu_pct_trials": [z["other"] for z in noise],
            "steal_pct_trials": [z["steal"] for z in noise],
            "n": n, "failed_ops": errors, "note": note})

    def get(self, placement, system, op, size=None):
        row = self.row(placement, system, op, size)
        return None if row is None else row["median"]

    def row(self, placement, system, op, size=None):
        for r in self.rows:
            if (r["placement"], r["system"], r["op"], r["size"]) == (placement, system, op, size):
                return r
        return None


CLUSTER_OPS = ("cl_", "cross_", "failover_", "transfer_")  # op prefixes of the cluster section


def has_main(res: Results, pl: str) -> bool:
    """Whether the placement has rows of the main sections (not only the cluster section)."""
    return any(r["placement"] == pl and r["system"] != "machine"
               and not r["op"].startswith(CLUSTER_OPS) for r in res.rows)


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


def render_placement(res: Results, pl: str, label: str, sizes: list) -> str:
    g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
    mem = memcpy_mbps(res)
    out = [f"## Placement `{pl}`: {label}"]

    rows = []
    for size in sizes:
        row = [human_size(size)]
        for op, rop in (("put", "put"), ("get", "get")):
            a, f, m, r = g("mooncaked", op, size), g("mooncaked-facade", op, size), \
                g("mooncake", op, size), g("redis", rop, size)
            row += [fmt(a), fmt(f), fmt(m), fmt(r), ratio(a, m), ratio(a, r)]
        rows.append(row)
    out.append("put / get of bytes, MB/s (one client, one op in flight; Redis = SET / GET)\n\n"
               + table(["size", "mcd put", "facade put", "MC put", "Redis SET", "mcd/MC",
                        "mcd/Redis", "mcd get", "facade get", "MC get", "Redis GET", "mcd/MC",
                        "mcd/Redis"], rows))

    rows = []
    for size in sizes:
        row = [human_size(size)]
        for op in ("put_from", "get_into"):
            a, f, m = g("mooncaked", op, size), g("mooncaked-facade", op, size), \
                g("mooncake", op, size)
            row += [fmt(a), fmt(f), fmt(m), ratio(a, m), ratio(f, m),
                    f"{100 * a / mem:.0f}%" if a and mem else "-"]
        rows.append(row)
    out.append("put_from / get_into, MB/s (mooncaked: shared memory over the Unix socket; "
               "Mooncake: registered buffer, local memcpy; % memcpy: of numpy.copyto of 256 MiB, "
               "which is DRAM-bound, so a 16 MiB copy whose source stays in cache can exceed "
               "100 %)\n\n"
               + table(["size", "mcd put_from", "facade", "MC", "mcd/MC", "facade/MC",
                        "mcd % memcpy", "mcd get_into", "facade", "MC", "mcd/MC", "facade/MC",
                        "mcd % memcpy"], rows))

    fresh = [(name, g(system, "put_from_fresh_client", 16 * MiB), g(system, "populate_mapping"))
             for name, system in (("BlockingClient", "mooncaked"), ("facade", "mooncaked-facade"))]
    out[-1] += ("\n\nmooncaked rows above run after the client populated its mapping of the "
                "segment (as Mooncake's worker first fills its own segment). A fresh client's "
                "first put_from of 16 MiB: " + "; ".join(
                    f"{name} {fmt(cold)} MB/s (populating its whole mapping: {fmt(pop)} GB/s)"
                    for name, cold, pop in fresh) + ". Fresh segments: mooncaked "
                + (f"prefaulted at start-up, READY after {fmt(g('mooncaked', 'startup'))} s"
                   if g("mooncaked", "startup") is not None else
                   f"cold fill {fmt(g('mooncaked', 'cold_fill'))} MB/s")
                + f"; Mooncake's cold fill {fmt(g('mooncake', 'cold_fill'))} MB/s.")

    rows = []
    for r in res.rows:
        if r["placement"] == pl and r["system"] == "mooncaked" and r["op"].startswith("batch_") \
                and r["unit"] == "MB/s":
            a, f, m = r["median"], g("mooncaked-facade", r["op"], r["size"]), \
                g("mooncake", r["op"], r["size"])
            rows.append([f"{r['op']} {human_size(r['size'])}", fmt(a), fmt(f), fmt(m),
                         ratio(a, m), ratio(f, m)])
    out.append("Batches, MB/s (latency per batch)\n\n"
               + table(["batch", "mooncaked", "facade", "Mooncake", "mcd/MC", "facade/MC"], rows))

    rows = []
    for op, name in (("exists_1p", "exists, 1 client"), ("exists_2p", "exists, 2 clients"),
                     ("put_1p", "put 4 KiB, 1 client"), ("put_2p", "put 4 KiB, 2 clients"),
                     ("batch_exists_1p", "batched exists x128, 1 client (keys/s)")):
        a, s, m, r = g("mooncaked", op), g("mooncaked@asyncio", op), g("mooncake", op), \
            g("redis", op)
        rows.append([name, fmt(a), fmt(s), ratio(a, s), fmt(m), fmt(r), ratio(a, m), ratio(a, r)])
    single, batched = g("mooncaked", "exists_1p"), g("mooncaked", "batch_exists_1p")
    out.append("Small ops, aggregate ops/s over a fixed window (Redis batched = pipeline of 128 "
               "EXISTS)\n\n"
               + table(["op", "mcd", "mcd@asyncio", "loop/asyncio", "MC", "Redis", "mcd/MC",
                        "mcd/Redis"], rows)
               + f"\n\nmooncaked batched exists: {ratio(batched, single)} the single-call rate "
                 "in keys/s")
    return "\n\n".join(out)


def spread(row) -> str:
    return "-" if row is None else f"{fmt(row['min'])}-{fmt(row['max'])}"


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
           + " (the three nodes share their CPUs, so they do not poll). Loops of the 3 nodes "
           "(status()['loop']): "
           + ", ".join(f"node{k} {v!r}" for k, v in
                       c.get("loops", {}).get(f"3-node [{pl}]", {}).items())]
    mc1 = g("mooncake", "cl_put_1p")
    rows = []
    for system, name in (("mcd-3node-leader", "3-node cluster, client on the leader"),
                         ("mcd-3node-follower", "3-node cluster, client on a follower"),
                         ("mcd-1node", "1-node cluster (cluster on, one member)"),
                         ("mcd-plain", "plain daemon (cluster off)"),
                         ("mooncake", "Mooncake master (no replication), 1 client")):
        one, four = res.row(pl, system, "cl_put_1p"), res.row(pl, system, "cl_put_4p")
        v1, v4 = one and one["median"], four and four["median"]
        is_3 = system.startswith("mcd-3node")
        rows.append([name, fmt(v1), spread(one), fmt(one and one["p50_us"]), fmt(v4),
                     spread(four), fmt(four and four["p50_us"]), ratio(v1, mc1),
                     ratio(v4, mc1) if system != "mooncake" else "-",
                     ratio(v1, g("mcd-1node", "cl_put_1p")) if is_3 else "-",
                     ratio(v4, g("mcd-1node", "cl_put_4p")) if is_3 else "-"])
    out.append("put 4 KiB, aggregate ops/s over a fixed window (fresh keys; mooncaked clients "
               "over TCP, each process its own connection; medians, min-max over trials)\n\n"
               + table(["system", "1 client", "min-max", "p50 µs", "4 clients", "min-max",
                        "p50 µs", "1c / MC", "4c / MC 1c", "1c / 1-node", "4c / 1-node"], rows))
    placement = c.get("cross_placement", {}).get(pl, {})
    rows = []
    sizes = sorted({r["size"] for r in res.rows if r["placement"] == pl
                    and r["op"] == "cross_get"})
    for size in sizes:
        row = [human_size(size)]
        for system in ("mcd-3node-via-follower", "mcd-3node-via-leader", "mooncake"):
            r = res.row(pl, system, "cross_get", size)
            row += [fmt(r and r["median"] / 1000), spread(r) if r is None else
                    f"{fmt(r['min'] / 1000)}-{fmt(r['max'] / 1000)}",
                    fmt(r and r["median"] * 1e6 / size)]
        m = g("mooncake", "cross_get", size)
        row += [ratio(g("mcd-3node-via-follower", "cross_get", size), m),
                ratio(g("mcd-3node-via-leader", "cross_get", size), m)]
        rows.append(row)
    puts = "; ".join(
        f"{human_size(size)}: mooncaked {fmt(g('mcd-3node', 'cross_put', size))} MB/s, "
        f"Mooncake A (own segment) {fmt(g('mooncake', 'cross_put', size))} MB/s"
        for size in sizes)
    out.append("Cross-node get, GB/s and ops/s (one client, one op in flight; mooncaked: the "
               f"replica on follower {placement.get('holder', '?')}'s segment "
               f"(preferred_segments), the client connected to follower "
               f"{placement.get('client_node', '?')} or to the leader "
               f"{placement.get('leader', '?')}: node -> node -> client over TCP; replicas "
               f"verified on the holder: {placement.get('replicas_on_holder', '?')}. Mooncake: "
               "client A holds the data in its own segment, client B (no segment) gets it over "
               "Mooncake's TCP transport)\n\n"
               + table(["size", "via follower GB/s", "min-max", "ops/s", "via leader GB/s",
                        "min-max", "ops/s", "MC cross GB/s", "min-max", "ops/s",
                        "follower / MC", "leader / MC"], rows)
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
            rows.append([name, fmt(r["median"]), spread(r), str(len(r["trials"]))])
    failover = c.get("failover", {}).get(pl, {})
    if rows:
        out.append("Leader failover and handover, ms (a client puts 4 KiB in a loop through a "
                   "follower; medians, min-max over trials)\n\n"
                   + table(["measurement", "median ms", "min-max", "trials"], rows)
                   + f"\n\nFailed puts during these trials: {failover.get('failed_puts', 0)}; "
                     f"error codes after the event: {failover.get('put_errors_seen') or '-'}.")
    return "\n\n".join(out)


def targets(res: Results, placements: list[str], loops: dict) -> list[dict]:
    """The issue's targets, per placement: measured ratio vs threshold."""
    out = []
    mem = memcpy_mbps(res)

    def add(pl, name, value, threshold, basis, verdict=None):
        status = "-" if value is None else ("PASS" if value >= threshold else "FAIL")
        out.append({"placement": pl, "target": name, "ratio": value, "threshold": threshold,
                    "basis": basis, "status": verdict or status})

    div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    for pl in placements:
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        if not has_main(res, pl):
            continue
        for size, threshold in ((MiB, 1.5), (16 * MiB, 1.0)):
            for op in ("put_from", "get_into"):
                add(pl, f"{op} {human_size(size)} >= {threshold}x Mooncake",
                    div(g("mooncaked", op, size), g("mooncake", op, size)), threshold,
                    f"{fmt(g('mooncaked', op, size))} / {fmt(g('mooncake', op, size))} MB/s")
        for op in ("put_from", "get_into"):
            a = g("mooncaked", op, 16 * MiB)
            add(pl, f"{op} 16 MiB >= 60% of memcpy", div(a, mem), 0.6,
                f"{fmt(a)} / {fmt(mem)} MB/s")
        for size in (64 * KiB, MiB):
            for op in ("put", "get"):
                add(pl, f"{op} {human_size(size)} >= 1.0x Mooncake",
                    div(g("mooncaked", op, size), g("mooncake", op, size)), 1.0,
                    f"{fmt(g('mooncaked', op, size))} / {fmt(g('mooncake', op, size))} MB/s")
        for op, name in (("exists_1p", "exists"), ("put_1p", "put 4 KiB")):
            add(pl, f"{name} ops/s, 1 client >= 1.5x Mooncake",
                div(g("mooncaked", op), g("mooncake", op)), 1.5,
                f"{fmt(g('mooncaked', op))} / {fmt(g('mooncake', op))} ops/s")
        add(pl, "batched exists x128 >= 10x single-call rate (keys/s)",
            div(g("mooncaked", "batch_exists_1p"), g("mooncaked", "exists_1p")), 10.0,
            f"{fmt(g('mooncaked', 'batch_exists_1p'))} keys/s / "
            f"{fmt(g('mooncaked', 'exists_1p'))} ops/s")
        default_loop = loops.get(f"mooncaked [{pl}]")
        asyncio_loop = loops.get(f"mooncaked@asyncio [{pl}]")
        same = default_loop is not None and default_loop == asyncio_loop
        for op, name in (("exists_1p", "exists, 1 client"), ("exists_2p", "exists, 2 clients"),
                         ("put_1p", "put 4 KiB, 1 client"), ("put_2p", "put 4 KiB, 2 clients")):
            add(pl, f"our loop >= 1.3x asyncio: {name}",
                div(g("mooncaked", op), g("mooncaked@asyncio", op)), 1.3,
                f"loop {default_loop!r} vs {asyncio_loop!r}",
                verdict=f"SAME LOOP ({default_loop})" if same else None)
    for pl in placements:  # the cluster section's targets
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        if not has_cluster(res, pl):
            continue
        for system, where in (("mcd-3node-follower", "a follower"),
                              ("mcd-3node-leader", "the leader")):
            add(pl, f"cluster put 4 KiB ops/s, 1 client on {where}, 3 nodes, "
                    f"fsync=batch >= 1.0x Mooncake",
                div(g(system, "cl_put_1p"), g("mooncake", "cl_put_1p")), 1.0,
                f"{fmt(g(system, 'cl_put_1p'))} / {fmt(g('mooncake', 'cl_put_1p'))} ops/s")
        for size in (MiB, 16 * MiB):
            for system, where in (("mcd-3node-via-follower", "follower"),
                                  ("mcd-3node-via-leader", "leader")):
                a, m = g(system, "cross_get", size), g("mooncake", "cross_get", size)
                add(pl, f"cross-node get {human_size(size)} (client on the {where}) "
                        f">= 2.0x Mooncake cross-client TCP get", div(a, m), 2.0,
                    f"{fmt(a)} / {fmt(m)} MB/s")
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
        spread = (r["max"] - r["min"]) / 2 / r["median"] * 100 if r["median"] else 0
        noise = "-"
        if r["other_cpu_pct_trials"]:
            noise = f"{max(r['other_cpu_pct_trials']):.0f}/{max(r['steal_pct_trials']):.0f}"
        size = "" if r["size"] is None else human_size(r["size"])
        body.append([f"{r['placement']} {r['system']} {r['op']} {size}".strip(), fmt(r["median"]),
                     r["unit"], f"{fmt(r['min'])}-{fmt(r['max'])} (±{spread:.0f}%)",
                     fmt(r["p50_us"]), fmt(r["p99_us"]), str(r["n"] or "-"),
                     str(r.get("failed_ops") or "-"), noise, r["note"]])
    return ("All measurements (median over trials; spread = min-max over trials; p50/p99 = "
            "median over trials of each trial's per-op percentile; other/steal = max over "
            "trials of CPU used by other processes / hypervisor steal, % of the machine)\n\n"
            + table(["measurement", "median", "unit", "spread", "p50 µs", "p99 µs", "n/trial",
                     "failed", "other/steal %", "note"], body))


def render(res: Results, info: dict) -> str:
    placements = list(info["placements"])
    sizes = [s for s, _ in info["config"]["sizes"]]
    env = info["env"]
    head = [f"# mooncaked vs Mooncake Store vs Redis — {env['date_utc']} UTC",
            f"{info['config']['trials']} trial(s) per measurement, each in fresh processes; "
            f"every number is the median over trials. MB/s = 10^6 B/s. Single-op throughput = "
            f"bytes / sum of per-op latencies. {env['cpu']}; kernel {env['kernel']}; "
            f"Mooncake {env['mooncake']}; {env['redis_server'].split(' sha=')[0]}; redis-py "
            f"{env['redis_py']}; mooncaked from {env['mooncaked_src']} "
            f"({env['mooncaked_commit']}"
            f"{' + uncommitted changes' if env['mooncaked_tree_dirty'] else ''})."]
    if info["loops"]:
        head.append("mooncaked loops (status()['loop']): " + ", ".join(
            f"{k} = {v!r}" for k, v in info["loops"].items()))
    if info.get("loop_reasons"):
        head.append("mooncaked loop choice (status()['loop_reason']; busy poll is set where the "
                    "daemon has a CPU its clients do not use): " + "; ".join(
                        f"{k}: {v}" for k, v in info["loop_reasons"].items()))
    if info.get("drain_wait_s"):
        head.append(f"mooncaked workers waited {info['drain_wait_s']:.0f} s in all (untimed) for "
                    "the previous trial's leased values to be freed")
    if info["errors"]:
        head.append("SECTIONS THAT FAILED: " + "; ".join(info["errors"]))
    failed = {}
    for r in res.rows:
        if r.get("failed_ops"):
            failed[r["system"]] = failed.get(r["system"], 0) + r["failed_ops"]
    if failed:
        head.append("FAILED OPS (see the 'failed' column): " + ", ".join(
            f"{k} {v}" for k, v in failed.items()))
    parts = ["\n".join(head)]
    if any(r["system"] == "machine" and r["op"] != "fdatasync_4k" for r in res.rows):
        parts.append(render_machine(res, placements))
    for pl in placements:
        if has_main(res, pl):
            parts.append(render_placement(res, pl, info["placements"][pl], sizes))
    for pl in placements:
        if has_cluster(res, pl):
            parts.append(render_cluster(res, pl, info["placements"][pl], info))
    parts.append(render_targets(targets(res, placements, info["loops"])))
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
            "targets": targets(res, list(info["placements"]), info["loops"])}
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(text + "\n")
    written = [base + ".json", base + ".md"]
    if any(r["op"] in ("put", "get", "put_from", "get_into") for r in res.rows):
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
    """Throughput by value size, one line per system and op, one column per placement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(json_path) as f:
        data = json.load(f)
    res = Results(data["rows"])
    placements = list(data["info"]["placements"])
    sizes = [s for s, _ in data["info"]["config"]["sizes"]]
    lines = [("mooncaked", "put_from", "get_into", "mooncaked put_from / get_into (shm)", "C0", "-"),
             ("mooncaked-facade", "put_from", "get_into", "mooncaked facade put_from / get_into",
              "C0", ":"),
             ("mooncaked", "put", "get", "mooncaked put / get (bytes)", "C0", "--"),
             ("mooncake", "put_from", "get_into", "Mooncake put_from / get_into", "C1", "-"),
             ("mooncake", "put", "get", "Mooncake put / get", "C1", "--"),
             ("redis", "put", "get", "Redis SET / GET", "C2", "--")]
    fig, axes = plt.subplots(2, len(placements), figsize=(6 * len(placements), 9),
                             squeeze=False, sharey=True)
    mem = memcpy_mbps(res)
    for col, pl in enumerate(placements):
        for row, direction in enumerate(("write", "read")):
            ax = axes[row][col]
            for system, wop, rop, name, color, style in lines:
                op = wop if direction == "write" else rop
                ys = [res.get(pl, system, op, s) for s in sizes]
                if any(y is not None for y in ys):
                    ax.plot(sizes, ys, marker="o", color=color, linestyle=style, label=name)
            if mem:
                ax.axhline(mem, color="grey", linewidth=0.8)
                ax.text(sizes[0], mem * 1.05, "memcpy", color="grey", fontsize=8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [human_size(s) for s in sizes])
            ax.set_title(f"{direction}s, placement {pl}")
            ax.set_xlabel("value size")
            ax.set_ylabel("MB/s (median of trials)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"mooncaked vs Mooncake vs Redis, one client ({data['info']['env']['date_utc']})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "chart":
        chart(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
