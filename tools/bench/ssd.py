"""The ssd section (run.py --only ssd): mooncaked's SSD tier against the device's own limits.

    fio        O_DIRECT through io_uring on the tier's file system: sequential write of records
               the size the offloader writes (a 1 MiB value and its header block) at the tier's
               queue depth, and sequential 1 MiB reads at depth 1 (what one get_into waits for)
    offload    a daemon with a small DRAM segment and the tier: 1 MiB put_from values, more
               than DRAM holds; offload write throughput = bytes the tier wrote / the time from
               the first put to the last write (status() tiers.ssd.write_bytes, polled)
    ssd hits   get_into 1 MiB of values held on SSD only (promotion off), one in flight
    dram hits  get 4 KiB and get_into 1 MiB of values in DRAM, a daemon with the tier and one
               without, trials alternating
    p99        get 4 KiB of hot DRAM values: p99 over a window with the daemon idle and over a
               window while it offloads (a writer filled DRAM just before; the writer has
               stopped, so the clients' CPU is the reader's alone)
    replay     the trace replay (replay.py) with DRAM held small: mooncaked with the tier,
               mooncaked without it, and Mooncake with its SSD offload when the wheel runs it
               (`--enable_offload` master, `enable_ssd_offload` clients); hit rate by tokens
               against the ideal

Targets: offload >= 80 % of fio's write; SSD-hit get_into 1 MiB >= 80 % of fio's read at depth
1; DRAM-hit rows with the tier >= 95 % of without; DRAM-hit p99 while offloading <= 1.1x idle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import report
from common import GiB, MiB
from procs import MOONCAKED_SRC, Noise, Worker, run_one
from replay import ReplaySection
from servers import daemon_knows, start_mooncaked

HEADER_BLOCK = 4096  # the tier's record header (README "SSD tier")


def config_defaults(cfg) -> None:
    cfg.ssd_dir = "/var/tmp"
    cfg.ssd_dram_bytes = 512 * MiB if cfg.quick else GiB
    cfg.ssd_capacity_bytes = 4 * GiB
    cfg.ssd_offload_count = 1024 if cfg.quick else 2048  # 1 MiB values
    cfg.ssd_reads = 100 if cfg.quick else 300
    cfg.ssd_queue_depth = 32
    cfg.ssd_hot_window_s = 2.0
    cfg.ssd_replay_requests = 60 if cfg.quick else 200
    cfg.ssd_replay_dram_fraction = 0.1  # DRAM = this share of the replay's distinct blocks


def add_arguments(ap) -> None:
    ap.add_argument("--ssd-dir", default=None, metavar="DIR",
                    help="directory for the SSD tier and fio's file (default /var/tmp; "
                         "a tmpfs measures memory, not a disk)")


def apply_arguments(cfg, args) -> None:
    if args.ssd_dir:
        cfg.ssd_dir = os.path.abspath(args.ssd_dir)


def filesystem(path: str) -> str:
    out = subprocess.run(["df", "--output=fstype,source", path], capture_output=True,
                         text=True).stdout.split("\n")
    return " ".join(out[1].split()) if len(out) > 1 else "unknown"


def fio(directory: str, rw: str, block: int, depth: int, size: int, cpus) -> dict:
    """One fio job, O_DIRECT, io_uring; returns MB/s and the latency percentiles (µs)."""
    path = os.path.join(directory, f"fio-probe-{os.getpid()}.dat")
    argv = ["fio", "--name=probe", f"--filename={path}", f"--size={size}", "--direct=1",
            f"--rw={rw}", f"--bs={block}", f"--iodepth={depth}", "--ioengine=io_uring",
            "--output-format=json"]
    if cpus:
        argv.insert(0, ",".join(str(c) for c in sorted(cpus)))
        argv[:0] = ["taskset", "-c"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"fio failed: {done.stderr.strip()[-300:]}")
    job = json.loads(done.stdout)["jobs"][0]["write" if rw == "write" else "read"]
    pct = job["clat_ns"].get("percentile", {})
    return {"mbps": job["bw_bytes"] / 1e6, "iops": job["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3,
            "command": " ".join(argv)}


class SsdSection:
    def __init__(self, bench) -> None:
        self.b = bench
        self.cfg = bench.cfg
        self.res = bench.results
        self.info = bench.info.setdefault("ssd", {})

    def tier_sections(self, directory: str, capacity: int, promote: bool = True) -> dict:
        return {"ssd": {"enabled": True, "directory": directory, "capacity_bytes": capacity,
                        "queue_depth": self.cfg.ssd_queue_depth, "promote": promote}}

    def run(self, pl, with_replay: bool) -> None:
        cfg, b = self.cfg, self.b
        if not daemon_knows(MOONCAKED_SRC[0], "offload_watermark_ratio"):
            raise RuntimeError(f"the daemon in {MOONCAKED_SRC[0]} has no [ssd] tier")
        if shutil.which("fio") is None:
            raise RuntimeError("fio is not installed (bootstrap installs it: Debian's fio)")
        base = os.path.join(cfg.ssd_dir, f"mooncaked-bench-ssd-{os.getpid()}")
        os.makedirs(base, exist_ok=True)
        self.info.update({"directory": cfg.ssd_dir, "filesystem": filesystem(cfg.ssd_dir),
                          "placement": pl.name, "dram_bytes": cfg.ssd_dram_bytes,
                          "capacity_bytes": cfg.ssd_capacity_bytes,
                          "queue_depth": cfg.ssd_queue_depth})
        try:
            self.device(pl, base)
            self.trials(pl, base)
            if with_replay:
                self.replay(pl, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    # -- the device ---------------------------------------------------------------------------

    def device(self, pl, base: str) -> None:
        cfg, b = self.cfg, self.b
        record = MiB + HEADER_BLOCK
        write = fio(base, "write", record, cfg.ssd_queue_depth, 2 * GiB, pl.servers)
        read = fio(base, "read", MiB, 1, GiB, pl.servers)
        for name in os.listdir(base):
            os.unlink(os.path.join(base, name))
        self.info["fio"] = {"write": write, "read": read}
        b.log(f"[{pl.name}] ssd: fio on {self.info['filesystem']}: write "
              f"{write['mbps']:.0f} MB/s ({record} B records, depth {cfg.ssd_queue_depth}), "
              f"read {read['mbps']:.0f} MB/s (1 MiB, depth 1)")
        self.res.add(pl.name, "fio", "ssd_write", record, "MB/s", [write["mbps"]],
                     note=f"O_DIRECT, io_uring, depth {cfg.ssd_queue_depth}")
        self.res.add(pl.name, "fio", "ssd_read", MiB, "MB/s", [read["mbps"]], [read["p50_us"]],
                     [read["p99_us"]], note="O_DIRECT, io_uring, depth 1")

    # -- mooncaked with and without the tier ---------------------------------------------------

    def daemon(self, pl, base: str, label: str, tier: bool, promote: bool = True):
        cfg, b = self.cfg, self.b
        extra = None
        if tier:
            directory = os.path.join(base, label)
            os.makedirs(directory, exist_ok=True)
            extra = self.tier_sections(directory, cfg.ssd_capacity_bytes, promote)
        server = start_mooncaked(b.py, os.path.join(b.workdir, f"ssd-{label}-{pl.name}"), pl,
                                 cfg.ssd_dram_bytes, None,
                                 b.logfile(f"ssd-{label}-{pl.name}"), extra_sections=extra)
        b.info["servers"][f"ssd {label} [{pl.name}]"] = server.command
        return server

    @staticmethod
    def stop(server) -> None:
        server.stop()
        shutil.rmtree(server.connect["shm_dir"], ignore_errors=True)

    def trials(self, pl, base: str) -> None:
        cfg, b = self.cfg, self.b
        acc = {k: [] for k in ("offload", "dram-tier", "dram-plain", "hot")}
        noise = {k: [] for k in acc}
        for trial in range(cfg.trials):
            for kind in ("dram-tier", "dram-plain", "offload", "hot"):
                try:
                    with Noise(noise[kind]):
                        acc[kind].append(getattr(self, "trial_" + kind.split("-")[0])(
                            pl, base, kind, trial))
                except Exception as exc:  # noqa: BLE001 (a failed trial, kept and shown)
                    b.info["errors"].append(f"ssd {kind} [{pl.name}] trial {trial}: "
                                            f"{type(exc).__name__}: {exc}")
                    acc[kind].append(None)
        self.rows(pl, acc, noise)

    def trial_dram(self, pl, base: str, kind: str, trial: int) -> dict:
        server = self.daemon(pl, base, f"{kind}-{trial}", tier=kind == "dram-tier")
        try:
            args = {"address": server.connect["address"], "tag": f"dram-{trial}",
                    "small_keys": 512, "small_gets": 2000 if not self.cfg.quick else 500,
                    "big_keys": 64, "big_gets": 200 if not self.cfg.quick else 50,
                    "server_pids": [server.process.pid]}
            return run_one(self.b.py, "ssd_dram", args, self.b.logfile("ssd-dram"),
                           pl.clients)
        finally:
            self.stop(server)

    def trial_offload(self, pl, base: str, kind: str, trial: int) -> dict:
        cfg = self.cfg
        server = self.daemon(pl, base, f"offload-{trial}", tier=True, promote=False)
        try:
            args = {"address": server.connect["address"], "tag": f"off-{trial}", "size": MiB,
                    "count": cfg.ssd_offload_count, "reads": cfg.ssd_reads,
                    "server_pids": [server.process.pid]}
            w = Worker(self.b.py, "ssd_offload", args, self.b.logfile("ssd-offload"),
                       pl.clients)
            try:
                w.expect("READY", 120)
                return w.expect("RESULT", 900)
            finally:
                w.finish()
        finally:
            self.stop(server)

    def trial_hot(self, pl, base: str, kind: str, trial: int) -> dict:
        cfg, b = self.cfg, self.b
        server = self.daemon(pl, base, f"hot-{trial}", tier=True)
        try:
            reader = Worker(b.py, "ssd_hot", {"address": server.connect["address"],
                                              "tag": f"hot-{trial}", "hot": 256,
                                              "window_s": cfg.ssd_hot_window_s},
                            b.logfile("ssd-hot"), pl.clients)
            try:
                reader.expect("READY", 120)
                reader.send("GO")
                reader.expect("MID", 120)
                # Fill DRAM past the offload watermark, then let the reader measure while the
                # daemon writes it out (the writer has exited by then).
                filled = run_one(b.py, "ssd_offload", {
                    "address": server.connect["address"], "tag": f"hotfill-{trial}",
                    "size": MiB, "count": int(cfg.ssd_dram_bytes * 0.85) // MiB, "reads": 0,
                    "drain_timeout_s": 0, "verify": False}, b.logfile("ssd-hot-fill"), pl.clients,
                    timeout_s=600)
                reader.send("GO")
                out = reader.expect("RESULT", 120)
            finally:
                reader.finish()
            out["fill"] = {"put_s": filled["put_s"]}
            return out
        finally:
            self.stop(server)

    def rows(self, pl, acc: dict, noise: dict) -> None:
        res, fio_info = self.res, self.info["fio"]
        for kind, system in (("dram-tier", "mooncaked+ssd"), ("dram-plain", "mooncaked")):
            outs = acc[kind]
            ok = [o for o in outs if o is not None]
            pad = [None] * (len(outs) - len(ok))
            for size, op, unit in ((4096, "get", "ops/s"), (MiB, "get_into", "MB/s")):
                rows = [o[str(size)] for o in ok]
                res.add(pl.name, system, f"ssd_dram_{op}", size, unit,
                        [r["ops_s"] if size == 4096 else r["mbps"] for r in rows] + pad,
                        [r["p50_us"] for r in rows], [r["p99_us"] for r in rows],
                        noise=noise[kind], n=rows[0]["n"] if rows else None,
                        errors=sum(r["errors"] for r in rows),
                        checked=sum(r["n"] for r in rows), bad=sum(r["bad"] for r in rows),
                        note="values in DRAM" + (", SSD tier enabled" if "tier" in kind
                                                 else ", no SSD tier"))
        outs = acc["offload"]
        ok = [o for o in outs if o is not None]
        pad = [None] * (len(outs) - len(ok))
        failed = sum(o["put_failed"] for o in ok)
        bad = sum(o["verify"]["bad"] for o in ok)
        res.add(pl.name, "mooncaked+ssd", "ssd_offload", MiB, "MB/s",
                [o["offload_mbps"] for o in ok] + pad, noise=noise["offload"],
                n=self.cfg.ssd_offload_count, errors=failed,
                checked=sum(o["verify"]["stored"] - o["verify"]["missing"] for o in ok),
                bad=bad,
                note=f"bytes written to SSD / first put -> last write; fio write "
                     f"{fio_info['write']['mbps']:.0f} MB/s; values gone by the read-back "
                     f"(evicted before their disk copy was written): "
                     + ", ".join(str(o["verify"]["missing"]) for o in ok))
        hits = [o["ssd_hit"] for o in ok]
        res.add(pl.name, "mooncaked+ssd", "ssd_hit_get_into", MiB, "MB/s",
                [h["mbps"] for h in hits] + pad, [h["p50_us"] for h in hits],
                [h["p99_us"] for h in hits], noise=noise["offload"],
                n=min((h["n"] for h in hits), default=None),
                errors=sum(h["errors"] for h in hits), checked=sum(h["n"] for h in hits),
                bad=sum(h["bad"] for h in hits),
                cpu=[{"units": h["n"], "bytes": h["n"] * MiB, "wall_s": h["total_s"],
                      "server_cpu_s": h["server_cpu_s"], "client_cpu_s": h["client_cpu_s"]}
                     for h in hits],
                note=f"values on SSD only, promotion off; fio read (1 MiB, depth 1) "
                     f"{fio_info['read']['mbps']:.0f} MB/s")
        outs = acc["hot"]
        ok = [o for o in outs if o is not None]
        pad = [None] * (len(outs) - len(ok))
        for window in ("idle", "offloading"):
            res.add(pl.name, "mooncaked+ssd", f"ssd_hot_p99_{window}", 4096, "µs",
                    [o[window]["p99_us"] for o in ok] + pad, [o[window]["p50_us"] for o in ok],
                    [o[window]["p99_us"] for o in ok], noise=noise["hot"],
                    errors=sum(o["errors"] for o in ok), bad=sum(o["bad"] for o in ok),
                    checked=sum(o[window]["n"] for o in ok),
                    note=f"get 4 KiB of 256 hot values, {self.cfg.ssd_hot_window_s} s window"
                         + "; bytes the tier wrote during the window: " + ", ".join(
                             report.human_size(o[window]["ssd_written_bytes"]) for o in ok))

    # -- the trace with DRAM held small --------------------------------------------------------

    def replay(self, pl, base: str) -> None:
        cfg, b = self.cfg, self.b
        section = ReplaySection(b)
        saved = cfg.replay_requests
        cfg.replay_requests = cfg.ssd_replay_requests
        try:
            section.run_small_dram(pl, base, cfg.ssd_replay_dram_fraction,
                                   self.tier_sections)
        finally:
            cfg.replay_requests = saved
