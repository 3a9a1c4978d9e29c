"""The three servers under test, each started on free loopback ports, pinned to the placement's
server CPUs, and stopped by PID (procs.PROCS):

    mooncaked        `python -m mooncaked --config FILE` under the project's Python, its own
                     config in a temp dir (Unix socket, a segment in a private /dev/shm
                     directory per daemon, metrics off), ready when it sends READY=1 to $NOTIFY_SOCKET;
                     $MOONCAKED_LOOP selects its event loop (asyncio|uring|auto; unset =
                     the daemon's default); optionally TCP only and/or a cluster node (a
                     [cluster] section), started without waiting (await_mooncaked) and
                     started again after a kill (relaunch_mooncaked)
    mooncake_master  from the bench venv, with its HTTP metadata server
    mooncake_client  from the bench venv: Mooncake's standalone store process (owns the
                     segment; clients call setup_dummy)
    redis-server     Debian's, no persistence, 127.0.0.1 and a Unix socket (clients use it)

All log at the same level (LOG_LEVEL). Busy polling is off unless asked for (busy_poll=True,
mooncaked's `+bp` rows).

Each start function returns a Server: the process, the command line (as `taskset ...` for the
record) and what clients need to connect.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from procs import MOONCAKED_SRC, PROCS, Placement, free_port, wait_tcp


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    command: str
    connect: dict = field(default_factory=dict)
    notify: socket.socket | None = None  # mooncaked's $NOTIFY_SOCKET, drained until stop

    def stop(self) -> None:
        PROCS.stop(self.process, grace_s=15)
        if self.notify is not None:
            self.notify.close()


def _drain(sock: socket.socket) -> None:
    """Read and drop the daemon's later STATUS= datagrams (a closed socket makes it log a
    warning per datagram)."""
    sock.settimeout(None)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


def _command(argv: list[str], placement: Placement, env: dict | None = None) -> str:
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return prefix + Placement.taskset(placement.servers) + " ".join(shlex.quote(x) for x in argv)


def _toml(sections: dict) -> str:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = str(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


BUSY_POLL_US_WHEN_APART = 100

# Every server logs at the same level, info: mooncaked "info" (its default), Mooncake's glog
# INFO (its default; the line that says whether its transfers use the local memcpy path is an
# INFO line), Redis "notice" (its info level; "verbose" and "debug" are below it).
LOG_LEVEL = {"mooncaked": "info", "mooncake": "INFO (glog default, minloglevel=0)",
             "redis": "notice"}
# The line Mooncake logs at start-up (INFO) that says how it moves bytes within one host.
MOONCAKE_MEMCPY_LINE = "MC_STORE_MEMCPY not set, auto-detected: "
MOONCAKE_MEMCPY_ON = "TCP-only environment, memcpy enabled"


def apart(placement: Placement) -> bool:
    """Whether the servers have CPUs their clients do not use (busy polling makes sense)."""
    return bool(placement.servers) and not placement.servers & placement.clients


def daemon_knows(src: str, key: str) -> bool:
    """Whether the checkout's mooncaked.toml lists a key (the daemon refuses unknown keys)."""
    try:
        with open(os.path.join(src, "mooncaked.toml")) as f:
            return any(line.startswith(key + " =") for line in f)
    except OSError:
        return False


def start_mooncaked(python: str, workdir: str, placement: Placement, segment_bytes: int,
                    loop: str | None, log_path: str, *, unix_socket: bool = True,
                    cluster: dict | None = None, busy_poll: bool = False,
                    name: str = "bench", wait: bool = True,
                    extra_sections: dict | None = None) -> Server:
    """loop: the value for $MOONCAKED_LOOP, or None to leave it unset (the default loop).
    The segment is prefaulted at start-up when the daemon has that switch (what an operator
    who cares about latency sets); otherwise run.py fills it once before measuring.
    unix_socket=False: TCP only (connect["tcp_address"] in both cases). cluster: the
    [cluster] section (a cluster node; the caller waits for a leader). busy_poll: True = set
    busy_poll_us (only where the daemon has CPUs its clients do not use); default off, like
    every other server here. Log level LOG_LEVEL (the same as the other servers).
    wait=False: return at once; await_mooncaked(server) waits for READY=1 (several daemons
    then start side by side). extra_sections: more config sections (e.g. {"tls": {...}})."""
    src = MOONCAKED_SRC[0]
    os.makedirs(workdir, exist_ok=True)
    shm_dir = os.path.join("/dev/shm",
                           f"mooncaked-bench-{os.getpid()}-{os.path.basename(workdir)}")
    os.makedirs(shm_dir, exist_ok=True)
    socket_path = os.path.join(workdir, "mooncaked.sock")
    config_path = os.path.join(workdir, "mooncaked.toml")
    segments = {"size_bytes": segment_bytes, "shm_dir": shm_dir}
    if daemon_knows(src, "prefault"):
        segments["prefault"] = True
    tcp_port = free_port()
    listeners = {"tcp_host": "127.0.0.1", "tcp_port": tcp_port,
                 "unix_socket": socket_path if unix_socket else "", "shutdown_grace_ms": 1000}
    if busy_poll and apart(placement) and daemon_knows(src, "busy_poll_us"):
        # The daemon has CPUs its clients do not use: the documented setting for that case.
        listeners["busy_poll_us"] = BUSY_POLL_US_WHEN_APART
    sections = {
        "node": {"name": name},
        "server": listeners,
        "segments": segments,
        "metrics": {"enabled": False},
        "log": {"level": LOG_LEVEL["mooncaked"]},
    }
    if cluster is not None:
        sections["cluster"] = dict(cluster, enabled=True)
    sections.update(extra_sections or {})
    with open(config_path, "w") as f:
        f.write(_toml(sections))
    loop_env = {} if loop is None else {"MOONCAKED_LOOP": loop}
    env = dict(os.environ, PYTHONPATH=src, **loop_env)
    if loop is None:
        env.pop("MOONCAKED_LOOP", None)
    argv = [python, "-m", "mooncaked", "--config", config_path]
    connect = {"address": f"unix:{socket_path}" if unix_socket else f"127.0.0.1:{tcp_port}",
               "tcp_address": f"127.0.0.1:{tcp_port}", "shm_dir": shm_dir,
               "config": config_path, "busy_poll_us": listeners.get("busy_poll_us", 0),
               "launch": {"argv": argv, "env": env, "workdir": workdir, "cpus": placement.servers,
                          "log_path": log_path}}
    server = Server("mooncaked", None, _command(argv, placement, loop_env), connect)
    _spawn(server)
    if wait:
        await_mooncaked(server)
    return server


def relaunch_mooncaked(server: Server) -> float:
    """Start a stopped (or killed) daemon again with the same config, data and ports; returns
    the seconds to READY=1. server.process is replaced."""
    if server.notify is not None:
        server.notify.close()
    _spawn(server)
    return await_mooncaked(server)


def _spawn(server: Server) -> None:
    """Start `python -m mooncaked` with a fresh $NOTIFY_SOCKET."""
    launch = server.connect["launch"]
    notify_path = os.path.join(launch["workdir"], "notify.sock")
    if os.path.exists(notify_path):
        os.unlink(notify_path)
    server.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.notify.bind(notify_path)
    env = dict(launch["env"], NOTIFY_SOCKET=notify_path)
    log = open(launch["log_path"], "ab")
    server.connect["spawned"] = time.monotonic()
    server.process = PROCS.popen("mooncaked", launch["argv"], cpus=launch["cpus"],
                                 cwd=MOONCAKED_SRC[0], env=env, stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT)
    log.close()


def await_mooncaked(server: Server) -> float:
    """Wait for READY=1 from a spawned daemon; returns (and records) the seconds from its start.
    On failure the daemon is stopped."""
    p, notify, log_path = server.process, server.notify, server.connect["launch"]["log_path"]
    started = server.connect["spawned"]
    try:
        deadline = time.monotonic() + 60  # prefaulting a large segment takes a while
        notify.settimeout(0.2)
        while True:
            try:
                if "READY=1" in notify.recv(4096).decode().split("\n"):
                    break
            except socket.timeout:
                pass
            if p.poll() is not None:
                raise RuntimeError(f"mooncaked exited with {p.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncaked sent no READY=1 within 60 s; see {log_path}")
    except BaseException:
        notify.close()
        server.notify = None
        PROCS.stop(p)
        raise
    server.connect["startup_s"] = time.monotonic() - started
    threading.Thread(target=_drain, args=(notify,), daemon=True).start()
    return server.connect["startup_s"]


def start_mooncake_master(venv_python: str, placement: Placement, log_path: str,
                          extra_args=()) -> Server:
    """extra_args: more flags (the ssd section's --enable_offload)."""
    exe = os.path.join(os.path.dirname(venv_python), "mooncake_master")
    metadata, rpc, metrics = free_port(), free_port(), free_port()
    argv = [exe, "--enable_http_metadata_server=true", f"--http_metadata_server_port={metadata}",
            "--http_metadata_server_host=127.0.0.1", f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1", f"--metrics_port={metrics}", "--metrics_host=127.0.0.1",
            *extra_args]
    log = open(log_path, "ab")
    p = PROCS.popen("mooncake_master", argv, cpus=placement.servers, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_tcp(rpc, p)
    wait_tcp(metadata, p)
    time.sleep(0.5)
    return Server("mooncake_master", p, _command(argv, placement),
                  {"metadata_url": f"http://127.0.0.1:{metadata}/metadata",
                   "master_addr": f"127.0.0.1:{rpc}"})


def start_mooncake_client(venv_python: str, placement: Placement, master: Server,
                          segment_bytes: int, log_path: str, env: dict) -> Server:
    """Mooncake's own store daemon (`mooncake_client`, from the wheel): a process that owns a
    global segment of `segment_bytes` and serves clients that call setup_dummy(mem_pool_size,
    local_buffer_size, "127.0.0.1:PORT") (an RPC port plus a local IPC socket for the shared
    memory pool). Registered with `master`; its transfers are logged like the in-process
    client's."""
    exe = os.path.join(os.path.dirname(venv_python), "mooncake_client")
    port = free_port()
    argv = [exe, "--host=127.0.0.1", f"--metadata_server={master.connect['metadata_url']}",
            f"--master_server_address={master.connect['master_addr']}", f"--port={port}",
            f"--global_segment_size={segment_bytes // (1024 * 1024)} MB",
            "--local_buffer_size=256 MB", "--protocol=tcp", "--threads=1"]
    log = open(log_path, "ab")
    p = PROCS.popen("mooncake_client", argv, cpus=placement.servers, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    wait_tcp(port, p, timeout_s=60)
    time.sleep(0.5)
    return Server("mooncake_client", p, _command(argv, placement, {
        k: v for k, v in env.items() if k.startswith("MC_")}),
        {"client_addr": f"127.0.0.1:{port}", "log_path": log_path})


def start_redis(workdir: str, placement: Placement, maxmemory: int | None = None) -> Server:
    """redis-server listening on 127.0.0.1 and on a Unix socket (the clients use the socket).
    maxmemory: a capacity, with allkeys-lru eviction (the replay section)."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    sock = os.path.join(workdir, "redis.sock")
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock,
            "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--protected-mode", "yes", "--dir", workdir,
            "--loglevel", LOG_LEVEL["redis"], "--logfile", os.path.join(workdir, "redis.log")]
    if maxmemory:
        argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
    p = PROCS.popen("redis-server", argv, cpus=placement.servers, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_tcp(port, p)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    return Server("redis-server", p, _command(argv, placement),
                  {"port": port, "unix_socket": sock})


def mooncake_transfer_mode(log_paths) -> dict:
    """What Mooncake's processes logged about their local transfers: {line: count}."""
    seen: dict = {}
    for path in log_paths:
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    at = line.find(MOONCAKE_MEMCPY_LINE)
                    if at >= 0:
                        text = line[at + len(MOONCAKE_MEMCPY_LINE):].strip()
                        seen[text] = seen.get(text, 0) + 1
        except OSError:
            pass
    return seen
