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
        for r in self.rows:
            if (r["placement"], r["system"], r["op"], r["size"]) == (placement, system, op, size):
                return r["median"]
        return None


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


def targets(res: Results, placements: list[str], loops: dict) -> list[dict]:
    """The issue's targets, per placement: measured ratio vs threshold."""
    out = []
    mem = memcpy_mbps(res)

    def add(pl, name, value, threshold, basis, verdict=None):
        status = "-" if value is None else ("PASS" if value >= threshold else "FAIL")
        out.append({"placement": pl, "target": name, "ratio": value, "threshold": threshold,
                    "basis": basis, "status": verdict or status})

    for pl in placements:
        g = lambda system, op, size=None: res.get(pl, system, op, size)  # noqa: E731
        div = lambda a, b: a / b if a is not None and b else None  # noqa: E731
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
            f"{' + uncommitted changes' if env['mooncaked_tree_dirty'] else ''}).",
            "mooncaked loops (status()['loop']): " + ", ".join(
                f"{k} = {v!r}" for k, v in info["loops"].items())]
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
    parts = ["\n".join(head), render_machine(res, placements)]
    for pl in placements:
        parts.append(render_placement(res, pl, info["placements"][pl], sizes))
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
    chart = subprocess.run([venv_python, os.path.abspath(__file__), "chart", base + ".json",
                            base + ".png"], capture_output=True, text=True)
    if chart.returncode == 0:
        written.append(base + ".png")
    else:
        print(f"chart failed:\n{chart.stderr}", file=sys.stderr)
    for suffix in (".json", ".md", ".png"):  # stable names for the newest run
        if os.path.exists(base + suffix):
            latest = os.path.join(out_dir, "latest" + suffix)
            if os.path.lexists(latest):
                os.unlink(latest)
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
