#!/usr/bin/env python3
"""mooncaked side by side with Mooncake Store and Redis, and the machine's limits, in one run.

    python tools/bench/run.py            # full run: 3 trials per measurement
    python tools/bench/run.py --quick    # 1 trial, small counts (smoke test)
    python tools/bench/run.py --only cluster   # just the cluster section

Run it from the repo root with the project's Python (the one that imports mooncaked). It sets
itself up (bootstrap.py: redis-server and libibverbs1 from Debian, a venv in tools/bench/.venv
with Mooncake's PyPI wheel, redis-py, numpy, matplotlib), then for each CPU placement (`split`:
servers on CPU0, clients on CPU1; `same`: everything on CPU0):

    machine     TCP loopback bulk, 1-byte TCP and Unix-socket ping-pong (memcpy once, unpinned)
    mooncaked   a daemon on its default loop: per trial one BlockingClient worker and one
                MooncakeDistributedStore-facade worker (workers.py single); then two daemons
                side by side, the default loop and MOONCAKED_LOOP=asyncio, for the small-op
                rates, their trials alternating
    mooncake    mooncake_master + its HTTP metadata server; the same single worker and rates
    redis       redis-server; SET/GET per size and the same rates
    cluster     a 3-node and a 1-node mooncaked cluster (fsync = "batch"), a plain daemon and a
                mooncake_master: put 4 KiB ops/s, cross-node get of 1 MiB / 16 MiB against
                Mooncake's cross-client TCP get, leader failover (kill -9) and transfer-leader
                (cluster.py)

`--only cluster` (or any comma list of machine, mooncaked, mooncake, redis, cluster) runs just
those sections.
Every trial runs in fresh worker processes; medians and min-max over trials are reported, with
each trial's p50/p99 (median over trials). Every server and worker is stopped by PID at the end,
also on Ctrl-C. Tables go to stdout; JSON (every per-trial number + environment) and a PNG
chart to --out (default tools/bench/results/).
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
from procs import MOONCAKED_SRC, PROCS, Noise, Worker, placements, run_one  # noqa: E402
from servers import start_mooncake_master, start_mooncaked, start_redis  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
# Mooncake's client advertises this address for its transfer-engine RPC instead of the first
# network interface's (its listening sockets still bind the wildcard address; see README).
MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
SECTIONS = ("machine", "mooncaked", "mooncake", "redis", "cluster")


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
        self.mooncaked_segment = 4 * GiB  # one trial stores ~1.7 GiB
        self.mooncaked_rates_segment = GiB  # the rates daemons (default loop and asyncio)
        self.mooncake_segment, self.mooncake_buffer = 2 * GiB, 256 * MiB
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
        """nproc rate workers released together; aggregate units/s over the joint window."""
        workers = [Worker(python, "rate", dict(args, tag=f"{args['tag']}-c{i}"),
                          self.logfile(f"rate-{args['system']}"), cpus, env)
                   for i in range(nproc)]
        try:
            for w in workers:
                w.expect("READY", 120)
            with Noise(noise):
                for w in workers:
                    w.send("GO")
                out = [w.expect("RESULT", 120) for w in workers]
            for w in workers:
                w.send("DONE")
        finally:
            for w in workers:
                w.finish(30)
        span = max(r["t_end"] for r in out) - min(r["t_start"] for r in out)
        return {"rate": sum(r["n"] for r in out) / span,
                "p50_us": statistics.median(r["p50_us"] for r in out),
                "p99_us": max(r["p99_us"] for r in out),
                "n": sum(r["n"] for r in out), "errors": sum(r["errors"] for r in out)}

    def rates(self, pl, targets: list[tuple]) -> None:
        """exists and put 4 KiB with 1 and 2 client processes, batched exists with 1.
        targets: (label, system, python, base args, env); with several (the two mooncaked
        loops), their trials alternate, so that drift in the machine's load hits both alike."""
        plan = [("exists", 1), ("exists", 2), ("put", 1), ("put", 2), ("batch_exists", 1)]
        for mode, nproc in plan:
            acc = {t[0]: {"values": [], "p50": [], "p99": [], "n": [], "noise": [], "errors": 0}
                   for t in targets}
            for t in range(self.cfg.trials):
                for label, system, python, base, env in targets:
                    a = acc[label]
                    args = dict(base, system=system, mode=mode, duration_s=self.cfg.rate_s,
                                batch=self.cfg.batch_exists_keys,
                                tag=f"{pl.name}-{label}-{mode}{nproc}-{t}-{os.getpid()}")
                    r = self.rate(python, args, nproc, pl.clients, a["noise"], env)
                    a["values"].append(r["rate"]); a["p50"].append(r["p50_us"])
                    a["p99"].append(r["p99_us"]); a["n"].append(r["n"])
                    a["errors"] += r["errors"]
            op = f"{mode}_{nproc}p"
            unit = "keys/s" if mode == "batch_exists" else "ops/s"
            note = (f"{self.cfg.batch_exists_keys} keys per call; p50/p99 per call"
                    if mode == "batch_exists" else "")
            if len(targets) > 1:
                note = (note + "; trials alternate with " + ", ".join(
                    t[0] for t in targets)).lstrip("; ")
            for label, a in acc.items():
                self.results.add(pl.name, label, op, None, unit, a["values"], a["p50"],
                                 a["p99"], a["noise"], n=int(statistics.median(a["n"])),
                                 note=note, errors=a["errors"])

    def single(self, pl, python: str, base: dict, system: str, env=None) -> None:
        """put/get, put_from/get_into, batches: one single-client worker per trial."""
        cfg = self.cfg
        args = dict(base, system=system, sizes=cfg.sizes, batches=cfg.batches,
                    cold_ops=cfg.cold_ops)
        counter = iter(range(10 ** 6))
        out, noise = self.trials(lambda: run_one(
            python, "redis_single" if system == "redis" else "single",
            dict(args, tag=f"{pl.name}-{system}-{next(counter)}-{os.getpid()}"),
            self.logfile(f"single-{system}"), pl.clients, env, timeout_s=600))
        note = "" if all(o["verified"] for o in out) else "VERIFY FAILED"
        if system.startswith("mooncaked"):
            evicted = sum(o["evictions"] for o in out)
            if evicted:
                note = f"{note} {evicted} objects EVICTED during the trials".strip()
            self.info["drain_wait_s"] = self.info.get("drain_wait_s", 0) + sum(
                o["drain_wait_s"] for o in out)
            xs = [o["mapping"]["put_from_cold"] for o in out]
            self.results.add(pl.name, system, "put_from_fresh_client", 16 * MiB, "MB/s",
                             [x["mbps"] for x in xs], [x["p50_us"] for x in xs],
                             [x["p99_us"] for x in xs], noise, n=cfg.cold_ops,
                             note="into a fresh client's mapping (page-table faults); every "
                                  "other mooncaked row runs after MADV_POPULATE_WRITE")
            self.results.add(pl.name, system, "populate_mapping", None, "GB/s",
                             [o["mapping"]["populate_gbps"] for o in out], noise=noise,
                             n=f"{out[0]['mapping']['populate_bytes'] // MiB} MiB",
                             note="madvise(MADV_POPULATE_WRITE) of the client's whole mapping")
        elif system == "mooncake":
            self.results.add(pl.name, system, "cold_fill", None, "MB/s",
                             [o["cold_fill"]["mbps"] for o in out], noise=noise,
                             n=f"{out[0]['cold_fill']['bytes'] // MiB} MiB",
                             note="first touch of a fresh client segment (put_from 16 MiB)")
        for section, ops in (("bytes", ("put", "get")), ("zero_copy", ("put_from", "get_into"))):
            if section == "zero_copy" and system == "redis":
                return
            for size, nops in cfg.sizes:
                for op in ops:
                    xs = [o[section][str(size)][op] for o in out]
                    self.results.add(pl.name, system, op, size, "MB/s", [x["mbps"] for x in xs],
                                     [x["p50_us"] for x in xs], [x["p99_us"] for x in xs],
                                     noise, n=nops, note=note,
                                     errors=sum(x["errors"] for x in xs))
        for size, nkeys, nbatches in cfg.batches:
            for op in ("batch_put_from", "batch_get_into"):
                xs = [o["batch"][f"{nkeys}x{size}"][op] for o in out]
                self.results.add(pl.name, system, op, f"{nkeys}x{size}", "MB/s",
                                 [x["mbps"] for x in xs], [x["p50_us"] for x in xs],
                                 [x["p99_us"] for x in xs], noise, n=f"{nbatches} batches",
                                 note=("p50/p99 per batch " + note).strip(),
                                 errors=sum(x["errors"] for x in xs))

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

    def start_mooncaked(self, pl, loop: str | None, segment_bytes: int, label: str):
        """Start a daemon, fill its segment once unless it prefaulted it; returns (server,
        client args)."""
        workdir = os.path.join(self.workdir, f"{label}-{pl.name}".replace("@", "-"))
        server = start_mooncaked(self.py, workdir, pl, segment_bytes, loop, self.logfile(label))
        self.info["servers"][f"{label} [{pl.name}]"] = server.command
        try:
            base = {"address": server.connect["address"], "local_buffer_bytes": 256 * MiB}
            ready = run_one(self.py, "prefill", base, self.logfile(label), pl.clients)
        except BaseException:
            self.stop_mooncaked(server)
            raise
        running = ready["status"].get("loop", "?")
        self.info["loops"][f"{label} [{pl.name}]"] = running
        self.info["loop_reasons"][f"{label} [{pl.name}]"] = ready["status"].get("loop_reason", "")
        fill = ready["cold_fill"]
        self.log(f"[{pl.name}] {label}: pid {server.process.pid}, loop {running!r}, "
                 f"{report.human_size(segment_bytes)} segment, READY after "
                 f"{server.connect['startup_s']:.1f} s"
                 + (" (prefaulted)" if ready["prefaulted"] else
                    f", cold fill {fill['mbps']:.0f} MB/s"))
        return server, base, ready

    @staticmethod
    def stop_mooncaked(server) -> None:
        server.stop()
        shutil.rmtree(server.connect["shm_dir"], ignore_errors=True)

    def section_mooncaked_single(self, pl) -> None:
        """The default loop; one BlockingClient and one facade worker per trial."""
        segment = self.cfg.mooncaked_segment
        server, base, ready = self.start_mooncaked(pl, None, segment, "mooncaked")
        try:
            if ready["prefaulted"]:
                self.results.add(pl.name, "mooncaked", "startup", None, "s",
                                 [server.connect["startup_s"]],
                                 note=f"start to READY=1, prefaulting a "
                                      f"{report.human_size(segment)} segment; once")
            else:
                fill = ready["cold_fill"]
                self.results.add(pl.name, "mooncaked", "cold_fill", None, "MB/s", [fill["mbps"]],
                                 n=f"{fill['bytes'] // MiB} MiB",
                                 note="first touch of the daemon's fresh segment (put of "
                                      "16 MiB over the socket); once")
            for system in ("mooncaked", "mooncaked-facade"):
                self.single(pl, self.py, base, system)
                self.log(f"[{pl.name}] {system}: single client done")
        finally:
            self.stop_mooncaked(server)

    def section_mooncaked_rates(self, pl) -> None:
        """Small-op rates on two daemons with small segments, alive side by side: the default
        loop and MOONCAKED_LOOP=asyncio; their trials alternate."""
        servers, targets = [], []
        try:
            for loop in (None, "asyncio"):
                label = "mooncaked" if loop is None else f"mooncaked@{loop}"
                server, base, _ = self.start_mooncaked(pl, loop, self.cfg.mooncaked_rates_segment,
                                                       f"{label}-rates")
                servers.append(server)
                self.info["loops"][f"{label} [{pl.name}]"] = \
                    self.info["loops"].pop(f"{label}-rates [{pl.name}]")
                targets.append((label, "mooncaked", self.py, base, None))
            self.rates(pl, targets)
            self.log(f"[{pl.name}] mooncaked, default loop and asyncio: rates done")
        finally:
            for server in servers:
                self.stop_mooncaked(server)

    def section_mooncake(self, pl) -> None:
        master = start_mooncake_master(self.vpy, pl, self.logfile("mooncake_master"))
        self.info["servers"][f"mooncake_master [{pl.name}]"] = master.command
        try:
            base = dict(master.connect, segment_bytes=self.cfg.mooncake_segment,
                        local_buffer_bytes=self.cfg.mooncake_buffer)
            self.single(pl, self.vpy, base, "mooncake", self.venv_env)
            self.log(f"[{pl.name}] mooncake: single client done")
            rate_base = dict(base, segment_bytes=self.cfg.mooncake_rate_segment,
                             local_buffer_bytes=self.cfg.mooncake_rate_buffer)
            self.rates(pl, [("mooncake", "mooncake", self.vpy, rate_base, self.venv_env)])
            self.log(f"[{pl.name}] mooncake: rates done")
        finally:
            master.stop()

    def section_redis(self, pl) -> None:
        workdir = os.path.join(self.workdir, f"redis-{pl.name}")
        os.makedirs(workdir, exist_ok=True)
        server = start_redis(workdir, pl)
        self.info["servers"][f"redis-server [{pl.name}]"] = server.command
        try:
            base = {"port": server.connect["port"]}
            self.single(pl, self.vpy, base, "redis")
            self.log(f"[{pl.name}] redis: single client done")
            self.rates(pl, [("redis", "redis", self.vpy, base, None)])
            self.log(f"[{pl.name}] redis: rates done")
        finally:
            server.stop()

    def section_cluster(self, pl, with_mooncake: bool) -> None:
        if not cluster.supported(MOONCAKED_SRC[0]):
            self.log(f"[{pl.name}] cluster: skipped, the daemon in {MOONCAKED_SRC[0]} has no "
                     "[cluster] section")
            self.info["errors"].append(f"cluster [{pl.name}]: skipped (no [cluster] in the "
                                       "daemon's mooncaked.toml)")
            return
        cluster.ClusterSection(self).run(pl, with_mooncake)

    def run(self, placement_list, systems, sections) -> None:
        plan = [("memcpy", None, self.section_memcpy)] if "machine" in sections else []
        for pl in placement_list:
            if "machine" in sections:
                plan.append(("machine", pl, self.section_ipc))
            if "mooncaked" in systems and "mooncaked" in sections:
                plan.append(("mooncaked", pl, self.section_mooncaked_single))
                plan.append(("mooncaked rates", pl, self.section_mooncaked_rates))
            if "mooncake" in systems and "mooncake" in sections:
                plan.append(("mooncake", pl, self.section_mooncake))
            if "redis" in systems and "redis" in sections:
                plan.append(("redis", pl, self.section_redis))
            if "mooncaked" in systems and "cluster" in sections:
                with_mooncake = "mooncake" in systems
                plan.append(("cluster", pl,
                             lambda p, m=with_mooncake: self.section_cluster(p, m)))
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
        "mooncaked_commit": _sh(f"git -C {MOONCAKED_SRC[0]} rev-parse --short HEAD 2>/dev/null")
        or "not a git checkout",
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
    args = ap.parse_args()
    Noise.quiet_wait_s = args.quiet_wait
    cfg = Config(args.quick, args.trials)
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
