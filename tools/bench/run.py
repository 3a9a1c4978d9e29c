#!/usr/bin/env python3
"""mooncaked side by side with Mooncake Store and Redis, and the machine's limits, in one run.

    python tools/bench/run.py            # full run: 3 trials per measurement
    python tools/bench/run.py --quick    # 1 trial, small counts (smoke test)
    python tools/bench/run.py --only cluster   # just the cluster section
    python tools/bench/run.py --only replay    # just the trace replay
    python tools/bench/run.py --only tls       # just the cost of TLS
    python tools/bench/run.py --only ssd       # just the SSD tier

Run it from the repo root with the project's Python (the one that imports mooncaked). It sets
itself up (bootstrap.py: redis-server and libibverbs1 from Debian, a venv in tools/bench/.venv
with Mooncake's PyPI wheel, redis-py + hiredis, numpy, matplotlib), then for each CPU placement
(`split`: servers on CPU0, clients on CPU1; `same`: everything on CPU0):

    machine     TCP loopback bulk, 1-byte TCP and Unix-socket ping-pong (memcpy once, unpinned;
                a short probe runs in every run, so every result records its machine)
    stores      (--only mooncaked / mooncake / redis pick its systems) all servers side by
                side: mooncaked (busy polling off; under `split` also a busy-polling daemon,
                rows mooncaked+bp), mooncake_master + Mooncake in-process and Mooncake's own
                store process mooncake_client (setup_dummy clients), redis-server over its Unix
                socket; single-client trials (workers.py single) and small-op rate trials
                alternate between the systems; then the asyncio daemon joins the rates
    cluster     a 3-node and a 1-node mooncaked cluster (fsync = "batch"), a plain daemon and a
                mooncake_master: put 4 KiB ops/s, cross-node get of 1 MiB / 16 MiB against
                Mooncake's cross-client TCP get, leader failover (kill -9) and transfer-leader
                (cluster.py)
    replay      the FAST'25 conversation trace against each store (replay.py), first placement
    tls         put / get 4 KiB and 1 MiB and connect over TCP, plain vs TLS, ops/s and server
                CPU per op, as ratios (tls_cost.py)
    ssd         the SSD tier against fio on the same file system: offload write throughput,
                SSD-hit get_into, DRAM hits with and without the tier, DRAM-hit p99 while
                offloading, and the trace replay with DRAM held small (ssd.py)

Every value carries its key's index and a per-trial nonce and is read back and checked outside
the timed loops; every row records the servers' CPU (/proc/PID/stat) beside its wall-clock
rate; a row with a failed op, check or trial is FAIL.

Every trial runs in fresh worker processes; medians and min-max over trials are reported, with
each trial's p50/p99 (median over trials). Every server and worker is stopped by PID at the end,
also on Ctrl-C. Tables go to stdout; Markdown, JSON (every per-trial number, environment,
command line, commits) and a PNG chart to --out (default tools/bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bootstrap  # noqa: E402
import cluster  # noqa: E402
import report  # noqa: E402
from common import GiB, KiB, MiB  # noqa: E402
import replay  # noqa: E402
import ssd  # noqa: E402
import tls_cost  # noqa: E402
from common import proc_cpu_s  # noqa: E402
from procs import MOONCAKED_SRC, PROCS, Noise, Worker, placements, run_one  # noqa: E402
from servers import (LOG_LEVEL, MOONCAKE_MEMCPY_LINE, MOONCAKE_MEMCPY_ON, apart,  # noqa: E402
                     daemon_knows, mooncake_transfer_mode, start_mooncake_client,
                     start_mooncake_master, start_mooncaked, start_redis)

REPO = os.path.dirname(os.path.dirname(HERE))
# Mooncake's client advertises this address for its transfer-engine RPC instead of the first
# network interface's (its listening sockets still bind the wildcard address; see README).
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
SECTIONS = ("machine", "mooncaked", "mooncake", "redis", "cluster", "replay", "tls", "ssd")


class Config:
    """Counts per trial; --quick shrinks them."""

    def __init__(self, quick: bool, trials: int) -> None:
        self.quick = quick
        self.trials = 1 if quick else trials
        self.sizes = [(4 * KiB, 2000), (64 * KiB, 1000), (MiB, 200), (16 * MiB, 24)]
        self.batches = [(64 * KiB, 128, 10), (MiB, 64, 5)]  # (value size, keys, batches)
        self.rate_s = 1.0
        self.pingpong_s = 1.0
        self.sock_bytes = GiB
        self.memcpy_bytes, self.memcpy_reps = 256 * MiB, 4
        self.mooncaked_segment = 3 * GiB  # one trial stores ~1.7 GiB (leases included)
        self.mooncaked_rates_segment = GiB  # the asyncio daemon (rates only)
        self.mooncake_segment, self.mooncake_buffer = 2 * GiB, 256 * MiB
        self.mooncake_mem_pool = 512 * MiB  # setup_dummy's shared pool: the worker's buffers
        self.mooncake_rate_segment, self.mooncake_rate_buffer = 128 * MiB, 64 * MiB
        self.batch_exists_keys = 128
        self.cold_ops = 8  # put_from 16 MiB into a fresh mooncaked client's mapping
        if quick:
            self.sizes = [(s, max(8, n // 10)) for s, n in self.sizes]
            self.batches = [(s, k, 2) for s, k, _ in self.batches]
            self.rate_s = self.pingpong_s = 0.3
            self.sock_bytes = 256 * MiB
            self.memcpy_reps = 1
            self.mooncaked_segment = 2 * GiB
            self.cold_ops = 4
        cluster.config_defaults(self)  # the cluster section's counts
        replay.config_defaults(self)  # the replay section's
        tls_cost.config_defaults(self)  # the TLS section's
        ssd.config_defaults(self)  # the SSD tier's

    def as_dict(self) -> dict:
        return dict(vars(self))


class Bench:
    def __init__(self, cfg: Config, venv_python: str, workdir: str) -> None:
        self.cfg = cfg
        self.py = sys.executable  # the project's Python: mooncaked and its clients
        self.vpy = venv_python    # the bench venv: Mooncake, Redis, numpy
        self.workdir = workdir
        self.results = report.Results()
        self.info: dict = {"servers": {}, "loops": {}, "loop_reasons": {}, "errors": []}
        self.t0 = time.monotonic()
        self.venv_env = dict(os.environ, **MOONCAKE_ENV)

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {message}", flush=True)

    def logfile(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    # -- generic trial helpers -----------------------------------------------------------

    def trials(self, fn):
        """Run fn() once per trial inside a Noise window; returns (results, noise)."""
        results, noise = [], []
        for _ in range(self.cfg.trials):
            with Noise(noise):
                results.append(fn())
        return results, noise

    def rate(self, python: str, args: dict, nproc: int, cpus, noise: list, env=None):
        """nproc rate workers released together; aggregate successful units/s over the joint
        window; the servers' CPU (args["server_pids"]) from GO to the last RESULT; then each
        worker checks every key it wrote (VERIFIED)."""
        workers = [Worker(python, "rate", dict(args, tag=f"{args['tag']}-c{i}"),
                          self.logfile(f"rate-{args['system']}"), cpus, env)
                   for i in range(nproc)]
        pids = args.get("server_pids") or []
        try:
            for w in workers:
                w.expect("READY", 120)
            with Noise(noise):
                s0 = proc_cpu_s(pids)
                for w in workers:
                    w.send("GO")
                out = [w.expect("RESULT", 120) for w in workers]
                server_cpu = proc_cpu_s(pids) - s0
            for w in workers:
                w.send("DONE")
            verified = [w.expect("VERIFIED", 300) for w in workers]
        finally:
            for w in workers:
                w.finish(30)
        span = max(r["t_end"] for r in out) - min(r["t_start"] for r in out)
        return {"rate": sum(r["n"] for r in out) / span, "span_s": span,
                "p50_us": statistics.median(r["p50_us"] for r in out),
                "p99_us": max(r["p99_us"] for r in out),
                "n": sum(r["n"] for r in out), "errors": sum(r["errors"] for r in out),
                "server_cpu_s": server_cpu,
                "client_cpu_s": sum(r.get("client_cpu_s", 0) for r in out),
                "checked": sum(v["checked"] for v in verified),
                "bad": sum(v["bad"] for v in verified)}

    def rates(self, pl, targets: list[tuple]) -> None:
        """exists and put 4 KiB with 1 and 2 client processes, batched exists with 1.
        targets: (label, system, python, base args, env); their trials alternate (A B C A B C),
        so that drift in the machine's load hits all alike."""
        plan = [("exists", 1), ("exists", 2), ("put", 1), ("put", 2), ("batch_exists", 1)]
        for mode, nproc in plan:
            acc = {t[0]: {"values": [], "p50": [], "p99": [], "n": [], "noise": [], "errors": 0,
                          "cpu": [], "checked": 0, "bad": 0} for t in targets}
            for t in range(self.cfg.trials):
                for label, system, python, base, env in targets:
                    a = acc[label]
                    args = dict(base, system=system, mode=mode, duration_s=self.cfg.rate_s,
                                batch=self.cfg.batch_exists_keys,
                                tag=f"{pl.name}-{label}-{mode}{nproc}-{t}-{os.getpid()}")
                    try:
                        r = self.rate(python, args, nproc, pl.clients, a["noise"], env)
                    except RuntimeError as exc:  # a worker that died: a failed trial
                        self.info["errors"].append(f"{label} {mode} x{nproc} [{pl.name}] "
                                                   f"trial {t}: {exc}")
                        a["values"].append(None)
                        continue
                    a["values"].append(r["rate"]); a["p50"].append(r["p50_us"])
                    a["p99"].append(r["p99_us"]); a["n"].append(r["n"])
                    a["errors"] += r["errors"]; a["checked"] += r["checked"]
                    a["bad"] += r["bad"]
                    a["cpu"].append({"units": r["n"], "bytes": 0, "wall_s": r["span_s"],
                                     "server_cpu_s": r["server_cpu_s"],
                                     "client_cpu_s": r["client_cpu_s"]})
            op = f"{mode}_{nproc}p"
            unit = "keys/s" if mode == "batch_exists" else "ops/s"
            note = (f"{self.cfg.batch_exists_keys} keys per call; p50/p99 per call"
                    if mode == "batch_exists" else "")
            if len(targets) > 1:
                note = (note + "; trials alternate with " + ", ".join(
                    t[0] for t in targets)).lstrip("; ")
            for label, a in acc.items():
                self.results.add(pl.name, label, op, None, unit, a["values"], a["p50"],
                                 a["p99"], a["noise"],
                                 n=int(statistics.median(a["n"])) if a["n"] else None,
                                 note=note, errors=a["errors"], cpu=a["cpu"],
                                 checked=a["checked"], bad=a["bad"])

    def singles(self, pl, targets: list[tuple]) -> None:
        """put/get, put_from/get_into, batches: one single-client worker per trial and system,
        the systems alternating (A B C A B C ...); targets: (label, python, base args, env).
        Before each round, the memcpy reference of the 16 MiB rows (same size, count and
        buffer reuse)."""
        cfg = self.cfg
        outs = {t[0]: [] for t in targets}
        noises = {t[0]: [] for t in targets}
        like, like_noise = [], []
        big = [(s, n) for s, n in cfg.sizes if s == 16 * MiB]
        for trial in range(cfg.trials):
            if big:
                with Noise(like_noise):
                    like.append(run_one(self.vpy, "memcpy_like",
                                        {"size": big[0][0], "ops": big[0][1]},
                                        self.logfile("machine"), pl.clients))
            for label, python, base, env in targets:
                args = dict(base, system=label, sizes=cfg.sizes, batches=cfg.batches,
                            cold_ops=cfg.cold_ops,
                            tag=f"{pl.name}-{label}-{trial}-{os.getpid()}")
                try:
                    with Noise(noises[label]):
                        outs[label].append(run_one(python, "single", args,
                                                   self.logfile(f"single-{label}"),
                                                   pl.clients, env, timeout_s=900))
                except RuntimeError as exc:
                    self.info["errors"].append(f"{label} single [{pl.name}] trial {trial}: "
                                               f"{exc}")
                    outs[label].append(None)
            self.log(f"[{pl.name}] single client, round {trial + 1}/{cfg.trials} done")
        if like:
            for op, key in (("memcpy_put_like", "put_like"), ("memcpy_get_like", "get_like")):
                self.results.add(pl.name, "machine", op, 16 * MiB, "MB/s",
                                 [o[key]["mbps"] for o in like], noise=like_noise,
                                 n=big[0][1],
                                 note="libc memcpy on the client CPU: " + (
                                     "one source -> a distinct destination per op in a "
                                     "prefaulted arena (as put_from 16 MiB)" if key == "put_like"
                                     else "a distinct source per op -> one destination (as "
                                          "get_into 16 MiB)"))
        for label, _, _, _ in targets:
            self.single_rows(pl, label, outs[label], noises[label])

    def single_rows(self, pl, system: str, out: list, noise: list) -> None:
        cfg = self.cfg
        failed_trials = sum(1 for o in out if o is None)
        ok = [o for o in out if o is not None]
        pad = [None] * failed_trials  # failed trials stay in each row's count

        def add(op, size, unit, xs, n, note="", checked=0, bad=0):
            self.results.add(pl.name, system, op, size, unit,
                             [x["mbps"] for x in xs] + pad, [x["p50_us"] for x in xs],
                             [x["p99_us"] for x in xs], noise, n=n, note=note,
                             errors=sum(x["errors"] for x in xs), checked=checked, bad=bad,
                             cpu=[{"units": x["ops"], "wall_s": x["total_s"], "bytes": x["ops"] * (
                                 size if isinstance(size, int) else
                                 int(size.split("x")[0]) * int(size.split("x")[1])),
                                 "server_cpu_s": x["server_cpu_s"],
                                 "client_cpu_s": x["client_cpu_s"]} for x in xs])
        if not ok:
            self.results.add(pl.name, system, "put", cfg.sizes[0][0], "MB/s", pad,
                             note="every trial failed")
            return
        if system.startswith("mooncaked"):
            evicted = sum(o["evictions"] for o in ok)
            note = f"{evicted} objects EVICTED during the trials" if evicted else ""
            self.info["drain_wait_s"] = self.info.get("drain_wait_s", 0) + sum(
                o["drain_wait_s"] for o in ok)
            xs = [o["mapping"]["put_from_cold"] for o in ok]
            self.results.add(pl.name, system, "put_from_fresh_client", 16 * MiB, "MB/s",
                             [x["mbps"] for x in xs], [x["p50_us"] for x in xs],
                             [x["p99_us"] for x in xs], noise, n=cfg.cold_ops,
                             note="into a fresh client's mapping (page-table faults); every "
                                  "other mooncaked row runs after MADV_POPULATE_WRITE")
            if ok[0]["mapping"]["populate_gbps"] is not None:
                self.results.add(pl.name, system, "populate_mapping", None, "GB/s",
                                 [o["mapping"]["populate_gbps"] for o in ok], noise=noise,
                                 n=f"{ok[0]['mapping']['populate_bytes'] // MiB} MiB",
                                 note="madvise(MADV_POPULATE_WRITE) of the client's mapping")
        else:
            note = ""
            if system == "mooncake":
                self.results.add(pl.name, system, "cold_fill", None, "MB/s",
                                 [o["cold_fill"]["mbps"] for o in ok], noise=noise,
                                 n=f"{ok[0]['cold_fill']['bytes'] // MiB} MiB",
                                 note="first touch of a fresh client segment (put_from 16 MiB)")
        for section, ops in (("bytes", ("put", "get")), ("zero_copy", ("put_from", "get_into"))):
            for size, nops in cfg.sizes:
                if str(size) not in ok[0][section]:
                    continue
                rows = [o[section][str(size)] for o in ok]
                for op in ops:  # the read-back check belongs to the get row
                    add(op, size, "MB/s", [r[op] for r in rows], nops, note,
                        checked=sum(r["checked"] for r in rows),
                        bad=sum(r["bad"] for r in rows))
        for size, nkeys, nbatches in cfg.batches:
            name = f"{nkeys}x{size}"
            if name not in ok[0]["batch"]:
                continue
            rows = [o["batch"][name] for o in ok]
            for op in ("batch_put_from", "batch_get_into"):
                add(op, name, "MB/s", [r[op] for r in rows], f"{nbatches} batches",
                    ("p50/p99 per batch; failed = failed keys " + note).strip(),
                    checked=sum(r["checked"] for r in rows), bad=sum(r["bad"] for r in rows))

    # -- sections ------------------------------------------------------------------------

    def section_memcpy(self) -> None:
        out, noise = self.trials(lambda: run_one(
            self.vpy, "memcpy", {"bytes": self.cfg.memcpy_bytes, "reps": self.cfg.memcpy_reps},
            self.logfile("machine")))
        size = report.human_size(self.cfg.memcpy_bytes)
        self.results.add("-", "machine", "memcpy_numpy", None, "GB/s",
                         [o["numpy_copyto_gbps"] for o in out], noise=noise,
                         note=f"numpy.copyto {size} into a prefaulted buffer, single thread")
        self.results.add("-", "machine", "memcpy_bytearray", None, "GB/s",
                         [o["bytearray_slice_gbps"] for o in out], noise=noise,
                         note=f"bytearray[:] = bytearray, {size}, prefaulted, single thread")
        self.log("machine: memcpy done")

    def section_ipc(self, pl) -> None:
        path = os.path.join(self.workdir, "pingpong.sock")
        for op, server_role, client_role, family in (
                ("tcp_bulk", "sock_recv", "sock_send", "tcp"),
                ("tcp_pingpong", "pingpong_srv", "pingpong_cli", "tcp"),
                ("unix_pingpong", "pingpong_srv", "pingpong_cli", "unix")):
            values, p50, p99, noise = [], [], [], []
            for _ in range(self.cfg.trials):
                if os.path.exists(path):
                    os.unlink(path)
                args = {"family": family, "total": self.cfg.sock_bytes, "path": path,
                        "duration_s": self.cfg.pingpong_s}
                server = Worker(self.vpy, server_role, args, self.logfile("machine"),
                                pl.servers)
                try:
                    address = server.expect("READY", 30)["address"]
                    with Noise(noise):
                        client = run_one(self.vpy, client_role, dict(args, address=address),
                                         self.logfile("machine"), pl.clients)
                        got = server.expect("RESULT", 120)
                finally:
                    server.finish()
                if op == "tcp_bulk":
                    values.append(got["gbps"])
                else:
                    values.append(client["ops_s"])
                    p50.append(client["p50_us"])
                    p99.append(client["p99_us"])
            unit = "GB/s" if op == "tcp_bulk" else "ops/s"
            note = {"tcp_bulk": f"sendall/recv_into 1 MiB chunks, "
                                f"{report.human_size(self.cfg.sock_bytes)}",
                    "tcp_pingpong": "1-byte round trips, TCP_NODELAY",
                    "unix_pingpong": "1-byte round trips"}[op]
            self.results.add(pl.name, "machine", op, None, unit, values, p50, p99, noise,
                             note=note)
        self.log(f"[{pl.name}] machine: sockets done")

    def start_mooncaked(self, pl, loop: str | None, segment_bytes: int, label: str,
                        busy_poll: bool = False):
        """Start a daemon, fill its segment once unless it prefaulted it; returns (server,
        client args, prefill result)."""
        workdir = os.path.join(self.workdir, f"{label}-{pl.name}".replace("@", "-")
                               .replace("+", "-"))
        server = start_mooncaked(self.py, workdir, pl, segment_bytes, loop, self.logfile(label),
                                 busy_poll=busy_poll)
        self.info["servers"][f"{label} [{pl.name}]"] = server.command
        self.info.setdefault("busy_poll_us", {})[f"{label} [{pl.name}]"] = \
            server.connect["busy_poll_us"]
        try:
            base = {"address": server.connect["address"], "local_buffer_bytes": 256 * MiB,
                    "server_pids": [server.process.pid]}
            ready = run_one(self.py, "prefill", base, self.logfile(label), pl.clients)
        except BaseException:
            self.stop_mooncaked(server)
            raise
        running = ready["status"].get("loop", "?")
        self.info["loops"][f"{label} [{pl.name}]"] = running
        self.info["loop_reasons"][f"{label} [{pl.name}]"] = ready["status"].get("loop_reason", "")
        fill = ready["cold_fill"]
        self.log(f"[{pl.name}] {label}: pid {server.process.pid}, loop {running!r}, "
                 f"busy_poll_us {server.connect['busy_poll_us']}, "
                 f"{report.human_size(segment_bytes)} segment, READY after "
                 f"{server.connect['startup_s']:.1f} s"
                 + (" (prefaulted)" if ready["prefaulted"] else
                    f", cold fill {fill['mbps']:.0f} MB/s"))
        if label == "mooncaked":
            if ready["prefaulted"]:
                self.results.add(pl.name, "mooncaked", "startup", None, "s",
                                 [server.connect["startup_s"]],
                                 note=f"start to READY=1, prefaulting a "
                                      f"{report.human_size(segment_bytes)} segment; once")
            else:
                self.results.add(pl.name, "mooncaked", "cold_fill", None, "MB/s", [fill["mbps"]],
                                 n=f"{fill['bytes'] // MiB} MiB",
                                 note="first touch of the daemon's fresh segment (put of "
                                      "16 MiB over the socket); once")
        return server, base, ready

    @staticmethod
    def stop_mooncaked(server) -> None:
        server.stop()
        shutil.rmtree(server.connect["shm_dir"], ignore_errors=True)

    def start_mooncake(self, pl, label: str):
        """mooncake_master, and Mooncake's own store process (mooncake_client) for the
        `mooncake-daemon` rows; returns (master, client or None, in-process args, daemon args)."""
        cfg = self.cfg
        master = start_mooncake_master(self.vpy, pl, self.logfile(f"mooncake_master-{label}"))
        self.info["servers"][f"mooncake_master ({label}) [{pl.name}]"] = master.command
        base = dict(master.connect, segment_bytes=cfg.mooncake_segment,
                    local_buffer_bytes=cfg.mooncake_buffer, server_pids=[master.process.pid])
        daemon = daemon_base = None
        try:
            daemon = start_mooncake_client(self.vpy, pl, master, cfg.mooncake_segment,
                                           self.logfile(f"mooncake_client-{label}"),
                                           self.venv_env)
            self.info["servers"][f"mooncake_client ({label}) [{pl.name}]"] = daemon.command
            daemon_base = dict(master.connect, client_addr=daemon.connect["client_addr"],
                               segment_bytes=cfg.mooncake_segment,
                               local_buffer_bytes=cfg.mooncake_buffer,
                               mem_pool_bytes=cfg.mooncake_mem_pool,
                               server_pids=[master.process.pid, daemon.process.pid])
            fill = run_one(self.vpy, "prefill", dict(daemon_base, system="mooncake-daemon"),
                           self.logfile("single-mooncake-daemon"), pl.clients, self.venv_env)
            self.results.add(pl.name, "mooncake-daemon", "cold_fill", None, "MB/s",
                             [fill["cold_fill"]["mbps"]],
                             n=f"{fill['cold_fill']['bytes'] // MiB} MiB",
                             note="first touch of mooncake_client's segment (put_from 16 MiB "
                                  "through setup_dummy); once")
        except Exception as exc:  # noqa: BLE001 (recorded; the in-process rows still run)
            self.info["errors"].append(f"mooncake-daemon [{pl.name}]: {type(exc).__name__}: "
                                       f"{exc}; see {self.logfile(f'mooncake_client-{label}')}")
            if daemon is not None:
                daemon.stop()
            daemon = daemon_base = None
        return master, daemon, base, daemon_base

    def check_mooncake_logs(self, pl) -> None:
        """Whether Mooncake's processes said their local transfers use memcpy (not TCP
        loopback); recorded per placement, and a warning when they did not."""
        logs = [os.path.join(self.workdir, f) for f in os.listdir(self.workdir)
                if "mooncake" in f and f.endswith(".log")]
        seen = mooncake_transfer_mode(logs)
        self.info.setdefault("mooncake_transfer_mode", {})[pl.name] = seen
        if not seen:
            self.info["errors"].append(f"mooncake [{pl.name}]: no transfer-mode line "
                                       f"({MOONCAKE_MEMCPY_LINE!r}) in its logs")
        elif any(k != MOONCAKE_MEMCPY_ON for k in seen):
            self.info["errors"].append(f"mooncake [{pl.name}]: local memcpy NOT used by every "
                                       f"process: {seen}")

    def section_stores(self, pl, systems: set) -> None:
        """mooncaked, Mooncake (in-process and as a client of mooncake_client) and Redis side
        by side: every server started once for the placement, then the single-client trials
        and the rate trials alternate between the systems."""
        cfg = self.cfg
        servers, daemons = [], []
        singles, rates = [], []
        try:
            if "mooncaked" in systems:
                server, base, _ = self.start_mooncaked(pl, None, cfg.mooncaked_segment,
                                                       "mooncaked")
                daemons.append(server)
                singles += [("mooncaked", self.py, base, None),
                            ("mooncaked-facade", self.py, base, None)]
                rates.append(("mooncaked", "mooncaked", self.py, base, None))
                if apart(pl):
                    server, bp_base, _ = self.start_mooncaked(
                        pl, None, cfg.mooncaked_segment, "mooncaked+bp", busy_poll=True)
                    daemons.append(server)
                    singles.insert(1, ("mooncaked+bp", self.py, bp_base, None))
                    rates.append(("mooncaked+bp", "mooncaked+bp", self.py, bp_base, None))
            if "mooncake" in systems:
                master, daemon, base, daemon_base = self.start_mooncake(pl, "stores")
                servers += [x for x in (daemon, master) if x is not None]
                singles.append(("mooncake", self.vpy, base, self.venv_env))
                rates.append(("mooncake", "mooncake", self.vpy,
                              dict(base, segment_bytes=cfg.mooncake_rate_segment,
                                   local_buffer_bytes=cfg.mooncake_rate_buffer), self.venv_env))
                if daemon_base is not None:
                    singles.append(("mooncake-daemon", self.vpy, daemon_base, self.venv_env))
                    rates.append(("mooncake-daemon", "mooncake-daemon", self.vpy,
                                  dict(daemon_base, mem_pool_bytes=cfg.mooncake_rate_buffer,
                                       local_buffer_bytes=cfg.mooncake_rate_buffer),
                                  self.venv_env))
            if "redis" in systems:
                workdir = os.path.join(self.workdir, f"redis-{pl.name}")
                os.makedirs(workdir, exist_ok=True)
                redis = start_redis(workdir, pl)
                servers.append(redis)
                self.info["servers"][f"redis-server [{pl.name}]"] = redis.command
                base = {"unix_socket": redis.connect["unix_socket"],
                        "server_pids": [redis.process.pid]}
                singles.append(("redis", self.vpy, base, None))
                rates.append(("redis", "redis", self.vpy, base, None))
            self.singles(pl, singles)
            self.log(f"[{pl.name}] single client done: {', '.join(t[0] for t in singles)}")
            if "mooncaked" in systems:  # the stdlib loop, for the loop targets (rates only)
                server, base, _ = self.start_mooncaked(pl, "asyncio",
                                                       cfg.mooncaked_rates_segment,
                                                       "mooncaked@asyncio")
                daemons.append(server)
                rates.insert(2 if apart(pl) else 1,
                             ("mooncaked@asyncio", "mooncaked", self.py, base, None))
            self.rates(pl, rates)
            self.log(f"[{pl.name}] rates done: {', '.join(t[0] for t in rates)}")
        finally:
            for server in daemons:
                self.stop_mooncaked(server)
            for server in servers:
                server.stop()
            if "mooncake" in systems:
                self.check_mooncake_logs(pl)

    def section_replay(self, pl, systems: set) -> None:
        replay.ReplaySection(self).run(pl, systems)

    def section_cluster(self, pl, with_mooncake: bool) -> None:
        if not cluster.supported(MOONCAKED_SRC[0]):
            self.log(f"[{pl.name}] cluster: skipped, the daemon in {MOONCAKED_SRC[0]} has no "
                     "[cluster] section")
            self.info["errors"].append(f"cluster [{pl.name}]: skipped (no [cluster] in the "
                                       "daemon's mooncaked.toml)")
            return
        cluster.ClusterSection(self).run(pl, with_mooncake)

    def section_tls(self, pl) -> None:
        if not daemon_knows(MOONCAKED_SRC[0], "require_client_cert"):
            self.log(f"[{pl.name}] tls: skipped, the daemon in {MOONCAKED_SRC[0]} has no [tls]")
            self.info["errors"].append(f"tls [{pl.name}]: skipped (no [tls] in the daemon's "
                                       "mooncaked.toml)")
            return
        tls_cost.TLSSection(self).run(pl)

    def section_ssd(self, pl, with_replay: bool) -> None:
        ssd.SsdSection(self).run(pl, with_replay)

    def run(self, placement_list, systems, sections) -> None:
        plan = [("memcpy", None, self.section_memcpy)]  # every run records its machine
        stores = systems & sections & {"mooncaked", "mooncake", "redis"}
        for i, pl in enumerate(placement_list):
            if "machine" in sections or i == 0:
                plan.append(("machine", pl, self.section_ipc))
            if stores:
                plan.append(("stores", pl, lambda p, s=stores: self.section_stores(p, s)))
            if "mooncaked" in systems and "cluster" in sections:
                with_mooncake = "mooncake" in systems
                plan.append(("cluster", pl,
                             lambda p, m=with_mooncake: self.section_cluster(p, m)))
            if "mooncaked" in systems and "tls" in sections:
                plan.append(("tls", pl, self.section_tls))
            if "mooncaked" in systems and "ssd" in sections:  # its replay: first placement
                plan.append(("ssd", pl, lambda p, r=(i == 0): self.section_ssd(p, r)))
        if "replay" in sections and placement_list:  # under the first placement only
            plan.append(("replay", placement_list[0],
                         lambda p: self.section_replay(p, systems)))
        for name, pl, fn in plan:
            try:
                fn() if pl is None else fn(pl)
            except Exception as exc:  # one broken server does not lose the whole run
                where = name if pl is None else f"{name} [{pl.name}]"
                self.log(f"{where}: FAILED:\n{traceback.format_exc()}")
                self.info["errors"].append(f"{where}: {type(exc).__name__}: {exc}")


def _sh(command: str) -> str:
    try:
        return subprocess.run(command, shell=True, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"<{exc}>"


def environment(venv_python: str) -> dict:
    q = lambda code: _sh(f"{venv_python} -c '{code}' 2>/dev/null")  # noqa: E731
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": _sh("lscpu | sed -n 's/^Model name:[ ]*//p'") + f", {os.cpu_count()} vCPU",
        "kernel": platform.release(),
        "memory": _sh("free -g | awk '/Mem:/{print $2\" GiB total, \"$7\" GiB available\"}'"),
        "python_project": f"{sys.executable} {platform.python_version()}",
        "python_venv": venv_python,
        "mooncaked_src": MOONCAKED_SRC[0],
        "mooncaked_commit": _sh(f"git -C {MOONCAKED_SRC[0]} rev-parse HEAD 2>/dev/null")
        or "not a git checkout",
        "bench_commit": _sh(f"git -C {HERE} rev-parse HEAD 2>/dev/null") or "not a git checkout",
        "bench_tree_dirty": bool(_sh(f"git -C {HERE} --no-optional-locks status --porcelain "
                                     "-- . 2>/dev/null")),
        "cpu_model": _sh("lscpu | sed -n 's/^Model name:[ ]*//p'"),
        "cpu_count": os.cpu_count(),
        "log_levels": LOG_LEVEL,
        "mooncaked_tree_dirty": bool(_sh(f"git -C {MOONCAKED_SRC[0]} --no-optional-locks status "
                                         "--porcelain -- mooncaked _native 2>/dev/null")),
        "mooncake": _sh(f"{venv_python} -m pip show {bootstrap.MOONCAKE_PACKAGE} 2>/dev/null | "
                        "sed -n 's/^Version: //p'"),
        "redis_server": _sh("redis-server --version"),
        "redis_py": q("import redis; from redis.utils import HIREDIS_AVAILABLE as h; "
                      "print(redis.__version__, \"hiredis\" if h else \"pure-Python parser\")"),
        "numpy": q("import numpy; print(numpy.__version__)"),
        "loadavg_start": open("/proc/loadavg").read().strip(),
        "mooncake_env": MOONCAKE_ENV,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 trial, small counts")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--placements", default="split,same", help="comma list: split, same, none")
    ap.add_argument("--systems", default="mooncaked,mooncake,redis")
    ap.add_argument("--only", default=",".join(SECTIONS), metavar="SECTIONS",
                    help=f"comma list of the sections to run: {', '.join(SECTIONS)} (default: "
                         "all); e.g. --only cluster")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--src", default=REPO,
                    help="checkout whose mooncaked is measured (default: this one), e.g. a "
                         "`git archive HEAD` copy while the working tree is mid-change")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each trial wait up to S s for other processes to use <20%% "
                         "of the machine (default 0; the noise column records it either way)")
    replay.add_arguments(ap)
    ssd.add_arguments(ap)
    args = ap.parse_args()
    Noise.quiet_wait_s = args.quiet_wait
    cfg = Config(args.quick, args.trials)
    replay.apply_arguments(cfg, args)
    ssd.apply_arguments(cfg, args)
    placement_list = placements(args.placements)
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    if sections - set(SECTIONS):
        raise SystemExit(f"unknown section {sorted(sections - set(SECTIONS))[0]!r}; choose "
                         f"from {', '.join(SECTIONS)}")

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_sigterm)

    started = time.monotonic()
    MOONCAKED_SRC[0] = os.path.abspath(args.src)
    venv_python = bootstrap.ensure_all(lambda m: print(f"[setup] {m}", flush=True),
                                       MOONCAKED_SRC[0])
    workdir = tempfile.mkdtemp(prefix="mooncaked-bench-")
    bench = Bench(cfg, venv_python, workdir)
    bench.log(f"work dir (logs, configs) {workdir}; {cfg.trials} trial(s) per measurement")
    info = bench.info
    info["env"] = environment(venv_python)
    info["config"] = cfg.as_dict()
    info["argv"] = " ".join([os.path.relpath(sys.executable, REPO)
                             if sys.executable.startswith(REPO) else sys.executable,
                             *sys.argv])
    info["placements"] = {pl.name: pl.label for pl in placement_list}
    info["workdir"] = workdir
    info["sections"] = sorted(sections)
    try:
        bench.run(placement_list, systems, sections)
    except KeyboardInterrupt as exc:
        print(f"interrupted{f' ({exc})' if str(exc) else ''}; stopping every process by PID",
              file=sys.stderr)
        PROCS.stop_all()
        return 130
    finally:
        PROCS.stop_all()
    info["elapsed_s"] = round(time.monotonic() - started, 1)
    text = report.render(bench.results, info)
    print()
    print(text)
    written = report.write(bench.results, info, text, args.out, venv_python)
    print("\nwrote " + ", ".join(written))
    print(f"elapsed {info['elapsed_s']} s; worker and server logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
