"""Test fixtures: a real mooncaked process on loopback and a Unix socket in a temp directory.

`DaemonProcess` writes a config, starts `python -m mooncaked` with NOTIFY_SOCKET pointing at a
datagram socket the test owns, and waits for READY=1 (the same signal systemd waits for). It
is stopped by PID.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Test servers take ports below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
# 32768-60999 by default): a port the kernel hands out for binding to 0 can be taken by any
# outgoing connection between the pick and the daemon's bind. Each port is handed out once per
# test run, so two servers of one test never get the same one.
_PORTS_FROM = 20000
_ports_handed_out: set[int] = set()
_port_random = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    high = max(_ephemeral_low() - 1, _PORTS_FROM + 1000)
    for _ in range(10_000):
        port = _port_random.randint(_PORTS_FROM, high)
        if port in _ports_handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _ports_handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS_FROM}-{high} on {host}")


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_config(path: str, sections: dict) -> None:
    with open(path, "w") as f:
        for section, values in sections.items():
            f.write(f"[{section}]\n")
            for key, value in values.items():
                f.write(f"{key} = {toml_value(value)}\n")


class DaemonProcess:
    def __init__(self, workdir: str, **overrides: dict) -> None:
        self.workdir = workdir
        self.tcp_port = free_port()
        self.metrics_port = free_port()
        self.unix_socket = os.path.join(workdir, "mooncaked.sock")
        self.shm_dir = os.path.join(workdir, "shm")
        os.makedirs(self.shm_dir, exist_ok=True)
        sections = {
            "node": {"name": "test-node"},
            "server": {"tcp_port": self.tcp_port, "unix_socket": self.unix_socket,
                       "shutdown_grace_ms": 3000},
            "segments": {"size_bytes": 64 << 20, "shm_dir": self.shm_dir},
            "metrics": {"port": self.metrics_port},
            "log": {"level": "info"},
        }
        for section, values in overrides.items():
            sections.setdefault(section, {}).update(values)
        self.config_path = os.path.join(workdir, "mooncaked.toml")
        write_config(self.config_path, sections)
        self.log_path = os.path.join(workdir, "mooncaked.log")
        self.process: subprocess.Popen | None = None
        self.extra_args: list[str] = []  # e.g. ["--join", "127.0.0.1:PORT"]
        self.notifications: list[str] = []
        self._notify = None

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def unix_address(self) -> str:
        return f"unix:{self.unix_socket}"

    def start(self, timeout_s: float = 20.0) -> "DaemonProcess":
        notify_path = os.path.join(self.workdir, "notify.sock")
        if os.path.exists(notify_path):
            os.unlink(notify_path)
        if self._notify is not None:  # a restart
            self._notify.close()
            self._log.close()
        self.notifications = []
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(notify_path)
        env = dict(os.environ, NOTIFY_SOCKET=notify_path, PYTHONPATH=REPO)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mooncaked", "--config", self.config_path, *self.extra_args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_for_notification("READY=1", timeout_s)
        return self

    def wait_for_notification(self, field: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.read_notifications(0.1)
            if any(field in n.split("\n") for n in self.notifications):
                return
            if self.process.poll() is not None:
                self.read_notifications(0)  # what it sent just before exiting
                if any(field in n.split("\n") for n in self.notifications):
                    return
                raise RuntimeError(f"mooncaked exited with {self.process.returncode}:\n"
                                   + self.log())
        raise TimeoutError(f"no {field} from mooncaked within {timeout_s} s:\n" + self.log())

    def read_notifications(self, wait_s: float) -> None:
        """Move queued sd_notify datagrams into `notifications` (waiting up to wait_s)."""
        self._notify.settimeout(wait_s if wait_s > 0 else None)
        if wait_s <= 0:
            self._notify.setblocking(False)
        try:
            while True:
                self.notifications.append(self._notify.recv(4096).decode())
                self._notify.setblocking(False)
        except (socket.timeout, BlockingIOError):
            pass

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM by PID; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            os.kill(self.process.pid, signal.SIGCONT)  # in case a test left it stopped
        except ProcessLookupError:
            pass
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise
        finally:
            self.read_notifications(0)

    def kill(self) -> None:
        """SIGKILL by PID (a crash: nothing is flushed or cleaned up)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def close(self) -> None:
        try:
            self.terminate()
        finally:
            if self._notify is not None:
                self._notify.close()
                self._notify = None
            if getattr(self, "_log", None):
                self._log.close()


@pytest.fixture
def make_daemon():
    """Factory: make_daemon(section={key: value}, ...) starts a daemon; all stop at teardown."""
    started: list[DaemonProcess] = []
    directories: list[tempfile.TemporaryDirectory] = []

    def make(**overrides) -> DaemonProcess:
        directory = tempfile.TemporaryDirectory(prefix="mooncaked-test-")
        directories.append(directory)
        daemon = DaemonProcess(directory.name, **overrides)
        started.append(daemon)
        return daemon.start()

    yield make
    for daemon in started:
        daemon.close()
    for directory in directories:
        directory.cleanup()


@pytest.fixture
def daemon(make_daemon) -> DaemonProcess:
    return make_daemon()


@pytest.fixture
def cluster():
    """A started 3-node cluster of real daemons (tests/cluster_harness.py), closed after."""
    from cluster_harness import Cluster
    started = Cluster(3)
    try:
        yield started.start()
    finally:
        started.close()
