"""Tests of the daemon's life cycle against a real `python -m mooncaked` process.

Start-up: READY=1 (with MAINPID) is sent only once the TCP port and the Unix socket accept
connections, and STATUS= lines report the store; stale segment files of dead daemons are
removed; a second daemon on a Unix socket that a live daemon serves fails with a clear message,
leaving the first one serving and no segment files of its own behind.

SIGTERM: STOPPING=1 is sent; idle connections are closed at once; new connections are refused
while draining; a put whose bytes are in flight is finished and answered; a put stalled midway
is cut after `shutdown_grace_ms`; in every case the daemon exits 0 and removes its Unix socket
and its segment files.

Clients here speak the wire protocol over raw sockets (mooncaked/proto/framing.py) so that a
put can be left half sent. Processes are stopped by PID.

tools/cluster/start.sh: with a port of its nodes taken (the quick-start daemon holds 50051 and
9781) it refuses at once and starts nothing; when a node it started exits during start-up it
stops the others by PID and fails. These use the script's fixed ports and directory
(/tmp/mooncaked-cluster), so they are skipped where either is in use.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import REPO, DaemonProcess
from mooncaked import config as config_module
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.proto import framing
from wire_helpers import connect, read_response

MIB = 1 << 20
SOCKET_TIMEOUT_S = 30
EXIT_TIMEOUT_S = 60


# -- helpers --------------------------------------------------------------------------------

@pytest.fixture
def spawn():
    """Factory: a DaemonProcess in its own temp directory, not yet started; closed at teardown."""
    made: list[tuple[DaemonProcess, str]] = []

    def make(**overrides) -> DaemonProcess:
        workdir = tempfile.mkdtemp(prefix="mooncaked-life-")  # short: Unix socket paths
        process = DaemonProcess(workdir, **overrides)
        made.append((process, workdir))
        return process

    yield make
    for process, workdir in made:
        try:
            process.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def drain_notifications(daemon: DaemonProcess) -> list[str]:
    """Append every datagram waiting on the test's NOTIFY_SOCKET; works after the daemon exits."""
    sock = daemon._notify
    sock.setblocking(False)
    while True:
        try:
            daemon.notifications.append(sock.recv(4096).decode())
        except BlockingIOError:
            break
    return daemon.notifications


def notification_lines(daemon: DaemonProcess) -> list[str]:
    return [line for n in drain_notifications(daemon) for line in n.split("\n")]


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def segment_files(daemon: DaemonProcess) -> list[str]:
    return sorted(n for n in os.listdir(daemon.shm_dir) if n.startswith("mooncaked-"))


def call(sock: socket.socket, msgid: int, method: str, params: list):
    sock.sendall(framing.request_head(msgid, method, params))
    got, error, result, _ = read_response(sock)
    assert got == msgid
    assert error is None, error
    return result


def hello(sock: socket.socket) -> dict:
    return call(sock, 1, "hello", [{"protocol": 1, "namespace": "default",
                                    "client_name": "test-lifecycle"}])


def open_client(daemon: DaemonProcess, kind: str = "tcp") -> socket.socket:
    sock = connect(daemon, kind, SOCKET_TIMEOUT_S)
    hello(sock)
    return sock


def send_put_head(sock: socket.socket, msgid: int, key: str, size: int) -> None:
    sock.sendall(framing.request_head(msgid, "put", [key, None], size))


def value_bytes(size: int, seed: int) -> bytes:
    return bytes((seed + i) & 0xFF for i in range(256)) * (size // 256)


def closed_by_peer(sock: socket.socket) -> bool:
    """True if the daemon closed the connection (EOF or reset) with nothing more to read."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def assert_refused(daemon: DaemonProcess, kind: str) -> None:
    address = daemon.unix_address if kind == "unix" else daemon.tcp_address
    try:
        client = BlockingClient.connect(address, timeout_s=SOCKET_TIMEOUT_S, map_segments=False)
    except (ConnectionRefusedError, FileNotFoundError):
        return
    except MooncakedError as exc:
        assert exc.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.RPC_FAIL), exc
        return
    client.close()
    pytest.fail(f"a new {kind} connection was accepted while the daemon drains")


def wait_until_writing(daemon: DaemonProcess, key: str) -> None:
    """Block until the daemon has read the put's header (the object is in state "writing")."""
    with BlockingClient.connect(daemon.tcp_address, map_segments=False) as admin:
        def writing() -> bool:
            try:
                return admin.object_stat(key)["state"] == "writing"
            except MooncakedError as exc:
                assert exc.code == ErrorCode.OBJECT_NOT_FOUND, exc
                return False
        assert wait_until(writing), f"the put of {key!r} never started"


def assert_cleaned_up(daemon: DaemonProcess) -> None:
    assert not os.path.exists(daemon.unix_socket)
    assert segment_files(daemon) == []
    assert "Traceback" not in daemon.log(), daemon.log()


# -- start-up -------------------------------------------------------------------------------

def test_ready_is_sent_once_tcp_and_unix_socket_accept(daemon):
    # The fixture returned as soon as READY=1 arrived: both listeners must answer now.
    for kind in ("tcp", "unix"):
        with open_client(daemon, kind) as sock:
            assert call(sock, 2, "ping", []) == "pong"
    ready = [n.split("\n") for n in daemon.notifications if "READY=1" in n.split("\n")]
    assert len(ready) == 1
    assert f"MAINPID={daemon.process.pid}" in ready[0]


def test_status_notifications_report_the_store(daemon):
    status = [line for line in notification_lines(daemon) if line.startswith("STATUS=")]
    assert status and status[0] != "STATUS="
    with open_client(daemon) as sock:
        payload = value_bytes(4096, 7)
        send_put_head(sock, 2, "status-key", len(payload))
        sock.sendall(payload)
        _, error, result, _ = read_response(sock)
        assert error is None and result is True
        assert wait_until(lambda: any(
            line.startswith("STATUS=1 objects") for line in notification_lines(daemon)))


def test_stale_segment_files_of_dead_daemons_are_removed_at_start(spawn):
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1  # pids are below pid_max: no process has this one
    daemon = spawn()
    stale = [f"mooncaked-{dead_pid}-seg0", f"mooncaked-{dead_pid}-seg3"]
    alive = f"mooncaked-{os.getpid()}-seg0"  # this test's pid: a running process
    unrelated = "not-a-segment"
    for name in stale + [alive, unrelated]:
        with open(os.path.join(daemon.shm_dir, name), "wb") as f:
            f.write(b"x" * 4096)
    daemon.start()
    names = set(os.listdir(daemon.shm_dir))
    assert not names & set(stale)
    assert {alive, unrelated, f"mooncaked-{daemon.process.pid}-seg0"} <= names
    assert daemon.terminate() == 0
    assert set(os.listdir(daemon.shm_dir)) == {alive, unrelated}


def test_second_daemon_on_the_same_unix_socket_fails_clearly(daemon, spawn):
    second = spawn(server={"unix_socket": daemon.unix_socket})
    with pytest.raises(RuntimeError):
        second.start()
    assert second.process.returncode != 0
    assert re.search(r"another daemon listens on " + re.escape(daemon.unix_socket), second.log())
    # The first daemon keeps its socket and still serves.
    with open_client(daemon, "unix") as sock:
        assert call(sock, 2, "ping", []) == "pong"
    assert daemon.terminate() == 0


@pytest.mark.parametrize("taken", ["unix_socket", "tcp_port"])
def test_failed_start_leaves_no_segment_files(daemon, spawn, taken):
    overrides = ({"unix_socket": daemon.unix_socket} if taken == "unix_socket"
                 else {"tcp_port": daemon.tcp_port})
    second = spawn(server=overrides)
    with pytest.raises(RuntimeError):
        second.start()
    assert second.process.returncode != 0
    assert segment_files(second) == []


# -- shutdown -------------------------------------------------------------------------------

def test_sigterm_sends_stopping_exits_0_and_removes_socket_and_segments(daemon):
    assert os.path.exists(daemon.unix_socket)
    assert segment_files(daemon) == [f"mooncaked-{daemon.process.pid}-seg0"]
    assert daemon.terminate() == 0
    assert "STOPPING=1" in notification_lines(daemon)
    assert_cleaned_up(daemon)


def test_sigterm_closes_idle_connections_refuses_new_ones_and_finishes_puts(make_daemon):
    daemon = make_daemon(server={"shutdown_grace_ms": 120_000},
                         segments={"size_bytes": 128 * MIB})
    idle_tcp = open_client(daemon, "tcp")
    idle_unix = open_client(daemon, "unix")

    # A put stalled midway: header and half of its payload sent.
    stalled = open_client(daemon)
    stalled_value = value_bytes(8 * MIB, 1)
    send_put_head(stalled, 2, "stalled", len(stalled_value))
    stalled.sendall(stalled_value[:len(stalled_value) // 2])
    wait_until_writing(daemon, "stalled")

    # A put sent completely before SIGTERM, its response not read yet.
    complete = open_client(daemon)
    complete_value = value_bytes(32 * MIB, 2)
    send_put_head(complete, 2, "complete", len(complete_value))
    complete.sendall(complete_value)

    os.kill(daemon.process.pid, signal.SIGTERM)
    daemon.wait_for_notification("STOPPING=1")

    assert closed_by_peer(idle_tcp)
    assert closed_by_peer(idle_unix)
    assert_refused(daemon, "tcp")
    assert_refused(daemon, "unix")
    assert daemon.process.poll() is None  # still draining: the stalled put holds it

    msgid, error, result, _ = read_response(complete)
    assert (msgid, error, result) == (2, None, True)

    # Give a daemon that ignored its 120 s grace the time to cut the stalled put; this one
    # must still be waiting for the rest of it.
    time.sleep(1.0)
    assert daemon.process.poll() is None
    stalled.sendall(stalled_value[len(stalled_value) // 2:])
    msgid, error, result, _ = read_response(stalled)
    assert (msgid, error, result) == (2, None, True)
    assert closed_by_peer(stalled)

    # Nothing is left to drain: the daemon exits well before its 120 s grace.
    assert daemon.process.wait(EXIT_TIMEOUT_S) == 0
    assert_cleaned_up(daemon)
    for sock in (idle_tcp, idle_unix, stalled, complete):
        sock.close()


def test_put_stalled_past_the_grace_is_cut_and_the_daemon_exits_0(make_daemon):
    daemon = make_daemon(server={"shutdown_grace_ms": 500})
    stalled = open_client(daemon)
    value = value_bytes(8 * MIB, 3)
    send_put_head(stalled, 2, "stalled", len(value))
    stalled.sendall(value[:len(value) // 2])
    wait_until_writing(daemon, "stalled")

    os.kill(daemon.process.pid, signal.SIGTERM)
    try:
        assert daemon.process.wait(EXIT_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon did not exit after its shutdown grace:\n" + daemon.log())
    assert closed_by_peer(stalled)
    assert "STOPPING=1" in notification_lines(daemon)
    assert_cleaned_up(daemon)
    stalled.close()


# -- tools/cluster/start.sh -----------------------------------------------------------------

CLUSTER_DIR = "/tmp/mooncaked-cluster"
START_SH = os.path.join(REPO, "tools", "cluster", "start.sh")


def cluster_ports() -> list[tuple[str, int]]:
    """(host, port) of every listener of the three nodes, from their configs."""
    found = []
    for i in (1, 2, 3):
        c = config_module.load(os.path.join(REPO, "tools", "cluster", f"node{i}.toml"))
        found += [(c.server.tcp_host, c.server.tcp_port),
                  (c.cluster.peer_host, c.cluster.peer_port), (c.metrics.host, c.metrics.port)]
    return found


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@pytest.fixture
def cluster_scratch():
    """The script's directory and ports, unused; the directory is removed afterwards."""
    if os.path.exists(CLUSTER_DIR):
        pytest.skip(f"{CLUSTER_DIR} exists (a cluster of someone else's)")
    if not all(port_free(host, port) for host, port in cluster_ports()):
        pytest.skip("a port of tools/cluster/node*.toml is in use")
    yield
    shutil.rmtree(CLUSTER_DIR, ignore_errors=True)


def run_start_sh() -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run(["bash", START_SH], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)


def started_pids(stdout: str) -> dict[int, int]:
    """{node: pid} from start.sh's `nodeN: pid P, ...` lines."""
    return {int(m.group(1)): int(m.group(2))
            for m in re.finditer(r"^node(\d): pid (\d+),", stdout, re.MULTILINE)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cluster_start_refuses_taken_ports_and_starts_nothing(cluster_scratch):
    # What the quick-start daemon (mooncaked.toml) holds: node 1's client and metrics ports.
    with socket.socket() as client, socket.socket() as metrics:
        client.bind(("127.0.0.1", 50051))
        client.listen()
        metrics.bind(("127.0.0.1", 9781))
        metrics.listen()
        done = run_start_sh()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "127.0.0.1:50051 (node1's client port)" in done.stderr
    assert "127.0.0.1:9781 (node1's metrics port)" in done.stderr
    assert "nothing started" in done.stderr
    assert started_pids(done.stdout) == {}
    assert not os.path.exists(CLUSTER_DIR)  # refused before it made anything


def test_cluster_start_stops_its_nodes_when_one_fails(cluster_scratch):
    # A file where node 3's Raft log directory goes: node 3 cannot start; 1 and 2 can.
    os.makedirs(os.path.join(CLUSTER_DIR, "node3"))
    with open(os.path.join(CLUSTER_DIR, "node3", "node-3"), "w"):
        pass
    done = run_start_sh()
    pids = started_pids(done.stdout)
    try:
        assert done.returncode == 1, done.stdout + done.stderr
        assert sorted(pids) == [1, 2, 3]
        assert "node3" in done.stderr and "exited during start-up" in done.stderr
        assert [pid for pid in pids.values() if alive(pid)] == []
        assert [n for n in (1, 2, 3)
                if os.path.exists(os.path.join(CLUSTER_DIR, f"node{n}", "pid"))] == []
    finally:
        for pid in pids.values():  # only if the script failed to: by PID, never by name
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
