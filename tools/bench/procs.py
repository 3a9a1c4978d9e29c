"""Processes the benchmark starts: CPU placements, the registry that stops them all by PID,
worker processes that speak the READY/RESULT line protocol, free ports, and the "other CPU"
noise accounting of each trial.

Every child is started in its own session (so a Ctrl-C in the terminal reaches only the
orchestrator, which then stops the children by PID in order) with PR_SET_PDEATHSIG=SIGTERM (so
a child does not outlive an orchestrator that was killed outright), and pinned with
sched_setaffinity when the placement says so.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MOONCAKED_SRC = [REPO]  # the checkout mooncaked is imported from (run.py --src sets it)
WORKERS = os.path.join(HERE, "workers.py")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Placement:
    name: str
    servers: frozenset  # CPUs of the servers (empty = unpinned)
    clients: frozenset  # CPUs of the client workers
    label: str

    @staticmethod
    def taskset(cpus) -> str:
        return f"taskset -c {','.join(map(str, sorted(cpus)))} " if cpus else ""


def placements(spec: str) -> list[Placement]:
    other = 1 if (os.cpu_count() or 1) > 1 else 0
    known = {
        "split": Placement("split", frozenset({0}), frozenset({other}),
                           "servers on CPU0, clients on CPU1 (every request crosses vCPUs; "
                           "both clients of the 2-process tests share CPU1)"),
        "same": Placement("same", frozenset({0}), frozenset({0}),
                          "everything on CPU0 (same-vCPU hand-off, no parallelism)"),
        "none": Placement("none", frozenset(), frozenset(), "unpinned (bimodal on this VM)"),
    }
    names = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown placement {unknown[0]!r}; choose from {', '.join(known)}")
    return [known[n] for n in names]


def _child_setup(cpus) -> None:
    """Runs in the child between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if cpus:
        os.sched_setaffinity(0, cpus)


class Procs:
    """Every process this run starts, stopped by PID (SIGTERM, then SIGKILL after a grace)."""

    def __init__(self) -> None:
        self.live: list[tuple[subprocess.Popen, str]] = []

    def popen(self, name: str, argv: list[str], cpus=frozenset(), **kw) -> subprocess.Popen:
        cpuset = set(cpus)
        p = subprocess.Popen(argv, preexec_fn=lambda: _child_setup(cpuset),
                             start_new_session=True, **kw)
        self.live.append((p, name))
        return p

    def stop(self, p: subprocess.Popen, grace_s: float = 10.0) -> None:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        for stream in (p.stdin, p.stdout):
            if stream:
                try:
                    stream.close()
                except OSError:
                    pass
        self.live = [(q, n) for q, n in self.live if q is not p]

    def kill(self, p: subprocess.Popen) -> float:
        """SIGKILL by PID (a crash, for failover measurements); returns the time.monotonic()
        just before the signal. The process is reaped and forgotten."""
        t = time.monotonic()
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
        self.stop(p)  # closes its pipes, drops it from the registry
        return t

    def stop_all(self) -> None:
        for p, _ in reversed(list(self.live)):
            self.stop(p)

    def pids(self) -> list[int]:
        return [p.pid for p, _ in self.live]


PROCS = Procs()


class Worker:
    """A workers.py process: reads its stdout lines on a thread, answers expect()."""

    def __init__(self, python: str, role: str, args: dict, log_path: str, cpus=frozenset(),
                 env: dict | None = None) -> None:
        self.role = role
        self.log = open(log_path, "ab")
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = MOONCAKED_SRC[0]  # mooncaked from the checkout under test
        self.p = PROCS.popen(role, [python, WORKERS, role, json.dumps(args)], cpus=cpus,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                             text=True, bufsize=1, cwd=HERE, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            for line in self.p.stdout:
                self.lines.put(line.rstrip("\n"))
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def expect(self, tag: str, timeout_s: float = 300):
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"worker {self.role}: no {tag} within {timeout_s} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"worker {self.role} exited with {self.p.wait()} before "
                                   f"{tag}; see {self.log.name}")
            if line == tag or line.startswith(tag + " "):
                rest = line[len(tag):].strip()
                return json.loads(rest) if rest else None

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def finish(self, timeout_s: float = 60) -> None:
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        PROCS.stop(self.p)
        self.log.close()


def run_one(python: str, role: str, args: dict, log_path: str, cpus=frozenset(),
            env: dict | None = None, timeout_s: float = 300):
    """Start a worker, return its RESULT."""
    w = Worker(python, role, args, log_path, cpus, env)
    try:
        return w.expect("RESULT", timeout_s)
    finally:
        w.finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_tcp(port: int, p: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{p.args[0]} exited with {p.returncode} before opening {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} did not open within {timeout_s} s")


# -- noise: CPU used by processes other than this run's, while a trial ran ------------------

_HZ = os.sysconf("SC_CLK_TCK")
_NCPU = os.cpu_count() or 1


def _machine_cpu() -> tuple[float, float]:
    """(busy seconds, steal seconds) of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / _HZ, v[7] / _HZ


def _own_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live children."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for pid in PROCS.pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _HZ
        except (OSError, ValueError, IndexError):
            pass
    return total


class Noise:
    """`with Noise(sink):` appends {"other": %, "steal": %} of the whole machine (100 % = all
    vCPUs) used by others while the block ran. With quiet_wait_s > 0 it first waits (at most
    that long) until others use under 20 %."""

    quiet_wait_s = 0.0

    def __init__(self, sink: list) -> None:
        self.sink = sink

    def _wait_quiet(self) -> None:
        started = time.monotonic()
        while time.monotonic() - started < self.quiet_wait_s:
            b0, m0 = _machine_cpu()[0], _own_cpu()
            time.sleep(0.5)
            b1, m1 = _machine_cpu()[0], _own_cpu()
            if 100 * max(0.0, (b1 - b0) - (m1 - m0)) / (0.5 * _NCPU) < 20:
                return

    def __enter__(self) -> "Noise":
        if self.quiet_wait_s > 0:
            self._wait_quiet()
        self.t0 = time.monotonic()
        self.busy0, self.steal0 = _machine_cpu()
        self.own0 = _own_cpu()
        return self

    def __exit__(self, *exc) -> bool:
        wall = max(1e-6, time.monotonic() - self.t0)
        busy, steal = _machine_cpu()
        other = max(0.0, (busy - self.busy0) - (_own_cpu() - self.own0))
        self.sink.append({"other": round(100 * other / (wall * _NCPU), 1),
                          "steal": round(100 * (steal - self.steal0) / (wall * _NCPU), 1)})
        return False
