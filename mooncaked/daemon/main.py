"""The mooncaked daemon: configuration, segments, listeners, the sweep timer, and shutdown.

Start-up: load and check the config (a bad key or value stops here, naming the key and file),
create and mount the segments, listen on TCP and the Unix socket, then tell systemd READY=1.
SIGTERM / SIGINT: STOPPING=1, stop accepting, let in-flight requests finish within
`shutdown_grace_ms`, abort what is left (unfinished puts are revoked), remove the segment files,
exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket
import stat
import sys
import time

from mooncaked import __version__
from mooncaked import config as config_module
from mooncaked._native import OffsetAllocator
from mooncaked.daemon import handlers
from mooncaked.daemon.connection import Connection
from mooncaked.daemon.metrics import MetricsServer, Stats, make_registry
from mooncaked.daemon.reservations import Reservations
from mooncaked.daemon.sdnotify import Notifier
from mooncaked.errors import ErrorCode
from mooncaked.io.loops import choose_loop
from mooncaked.proto import framing
from mooncaked.daemon.segment_memory import SegmentMemory, remove_stale_files
from mooncaked.meta import commands
from mooncaked.meta.master import Master
from mooncaked.meta.state_machine import Replica, StateMachine, Version

log = logging.getLogger("mooncaked")

DEFAULT_CONFIG_PATH = "/etc/mooncaked/mooncaked.toml"


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class Daemon:
    def __init__(self, config: config_module.Config) -> None:
        self.config = config
        self.pid = os.getpid()
        self.node_name = config.node_name
        server = config.server
        self.max_header_bytes = server.max_header_bytes
        self.max_payload_bytes = server.max_payload_bytes
        self.max_key_bytes = server.max_key_bytes
        self.max_batch_keys = server.max_batch_keys
        self.now_ms = monotonic_ms
        self.handlers = handlers.HANDLERS
        self.stats = Stats(self.handlers)
        self.connections: set[Connection] = set()
        self.draining = False
        self.started_at = time.time()
        self.tcp_port = 0
        self.metrics_port = 0
        store = config.store
        state = StateMachine(
            lambda size, alignment, max_allocations: OffsetAllocator(size, alignment,
                                                                     max_allocations),
            max_objects=store.max_objects,
            put_start_discard_timeout_ms=store.put_start_discard_timeout_ms,
            put_start_release_timeout_ms=store.put_start_release_timeout_ms,
            allocation_strategy=store.allocation_strategy)
        self.master = Master(state, store, seed=int.from_bytes(os.urandom(8), "little"))
        self.reservations = Reservations(self.master, server.max_reserved_bytes_per_connection)
        self.memory: dict[int, SegmentMemory] = {}
        self._connection_ids = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._metrics: MetricsServer | None = None
        self._notifier = Notifier()
        self.stop_requested: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None  # set once draining leaves no connection
        self._sweep: asyncio.TimerHandle | None = None
        self._last_status = ""
        self.loop_reason = ""  # why this event loop was chosen (status, log)
        self.join_address = ""  # --join: a cluster member to join through
        self.cluster = None  # the ClusterService when [cluster] enabled

    # -- start-up ---------------------------------------------------------------------------

    def mount_segments(self) -> None:
        segments = self.config.segments
        removed = remove_stale_files(segments.shm_dir)
        if removed:
            log.info("removed %d segment files left by stopped daemons", removed)
        clustered = self.config.cluster.enabled
        for index in range(segments.count):
            # Keyed by the segment's index on this node; in a cluster the log mounts it under
            # a cluster-wide id once the node has registered (cluster/service.py).
            segment_id = index
            memory = SegmentMemory(segment_id, segments.shm_dir, segments.size_bytes,
                                   segments.shm_mode, segments.numa_node,
                                   segments.huge_pages, segments.prefault)
            self.memory[segment_id] = memory
            if clustered:
                continue
            self.master.propose(commands.MountSegment(
                segment_id, f"{self.node_name}/{segment_id}", self.node_name,
                segments.size_bytes, segments.alignment_bytes, segments.max_allocations))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.stop_requested = asyncio.Event()
        self._drained = asyncio.Event()
        self.mount_segments()
        server = self.config.server
        tcp = await loop.create_server(lambda: Connection(self, "tcp"), server.tcp_host,
                                       server.tcp_port, reuse_address=True)
        for sock in tcp.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_port = tcp.sockets[0].getsockname()[1]
        self._servers.append(tcp)
        if server.unix_socket:
            self._servers.append(await self._listen_unix(loop, server.unix_socket))
        if self.config.cluster.enabled:
            from mooncaked.cluster.service import ClusterService
            from mooncaked.daemon import cluster_handlers
            self.handlers = cluster_handlers.HANDLERS
            self.stats.methods = frozenset(self.handlers)
            self.cluster = ClusterService(self, self.join_address)
            await self.cluster.start()
        metrics = self.config.metrics
        if metrics.enabled:
            self._metrics = MetricsServer(make_registry(self))
            self.metrics_port = await self._metrics.start(metrics.host, metrics.port)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        self._schedule_sweep()
        log.info("mooncaked %s on %s: tcp %s:%d, unix %s, metrics %s, %d segment(s) of %d "
                 "bytes, loop %s", __version__, self.node_name, server.tcp_host, self.tcp_port,
                 server.unix_socket or "-", self.metrics_port or "-", len(self.memory),
                 self.config.segments.size_bytes, self.loop_name())
        self._notifier.notify(READY="1", STATUS=self._status_line(), MAINPID=str(self.pid))

    async def _listen_unix(self, loop, path: str) -> asyncio.AbstractServer:
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise SystemExit(f"mooncaked: {path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by a daemon that is gone
            else:
                raise SystemExit(f"mooncaked: another daemon listens on {path}")
            finally:
                probe.close()
        unix = await loop.create_unix_server(lambda: Connection(self, "unix"), path)
        os.chmod(path, 0o660)
        return unix

    # -- running ----------------------------------------------------------------------------

    def loop_name(self) -> str:
        return "uring" if type(asyncio.get_running_loop()).__name__ == "UringEventLoop" \
            else "asyncio"

    def _schedule_sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweep = loop.call_later(self.config.store.eviction_interval_ms / 1000, self._tick)

    def _tick(self) -> None:
        try:
            if self.cluster is None:  # in a cluster the leader sweeps (cluster/service.py)
                self.sweep(self.now_ms())
        except Exception:
            log.exception("sweep failed")
        if self._notifier.enabled:
            line = self._status_line()
            if line != self._last_status:
                self._last_status = line
                self._notifier.notify(STATUS=line)
        self._schedule_sweep()

    def sweep(self, now_ms: int) -> None:
        """One run of a single node's sweep: deadlines, eviction, and the reservations the
        deadlines released."""
        released = self.master.tick(now_ms)
        if released and self.reservations:
            self.reservations.forget_released(self.connections)

    def next_connection_id(self) -> int:
        self._connection_ids += 1
        return self._connection_ids

    def connection_opened(self, conn: Connection) -> None:
        if self.draining or len(self.connections) >= self.config.server.max_connections:
            reason = ("the daemon is stopping" if self.draining else
                      f"too many connections ({self.config.server.max_connections})")
            code = ErrorCode.SHUTTING_DOWN if self.draining else ErrorCode.BUSY
            conn.transport.write(framing.protocol_error_head(code, reason))
            conn.transport.close()
            return
        self.connections.add(conn)
        self.stats.connections_total += 1

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        for key in list(conn.puts_in_progress):
            try:
                self.master.put_revoke(key, conn.connection_id)
            except Exception as exc:  # the put may have been preempted meanwhile
                log.debug("revoking %r: %s", key, exc)
        conn.puts_in_progress.clear()
        if conn.reservations:
            self.reservations.release_all(conn)
        if self.draining and not self.connections:
            self._drained.set()

    def puts_in_progress(self) -> int:
        """Unfinished puts of clients (reservations are unfinished puts too, not counted)."""
        return len(self.master.state.pending_order) - len(self.reservations)

    def objects_count(self) -> int:
        """Objects as users see them: readable or being written, not reservations."""
        return len(self.master.state.objects) - len(self.reservations)

    def max_reserved_bytes(self, conn: Connection) -> int:
        """What a connection may hold reserved: 0 where shared memory is not offered."""
        if conn.transport_kind != "unix" or self.cluster is not None:
            return 0
        return self.config.server.max_reserved_bytes_per_connection

    # -- data -------------------------------------------------------------------------------

    def replica_view(self, replica: Replica, size_bytes: int) -> memoryview:
        return self.memory[replica.segment_id].slice(replica.offset, size_bytes)

    def own_memory(self, segment_id: int) -> SegmentMemory | None:
        """This node's memory behind a mounted segment id; None for another node's segment."""
        if self.cluster is None:
            return self.memory.get(segment_id)
        if commands.node_of_segment(segment_id) != self.config.cluster.node_id:
            return None
        return self.memory.get(commands.slot_of_segment(segment_id))

    def copy_to_other_replicas(self, replicas: list[Replica], size_bytes: int) -> None:
        if len(replicas) > 1:
            source = self.replica_view(replicas[0], size_bytes)
            for replica in replicas[1:]:
                self.replica_view(replica, size_bytes)[:] = source

    def local_replica(self, version: Version) -> Replica:
        return version.replicas[0]

    # -- reports ----------------------------------------------------------------------------

    def segment_descriptions(self) -> list[dict]:
        prefaulted = self.config.segments.prefault
        if self.cluster is not None:
            return []  # values move through the socket: replicas may be on other nodes
        return [{"id": s.segment_id, "name": s.name, "size_bytes": s.size_bytes,
                 "shm_path": self.memory[s.segment_id].path, "prefaulted": prefaulted}
                for s in self.master.state.segment_list]

    def segment_report(self) -> list[dict]:
        report = []
        for s in self.master.state.segment_list:
            memory = self.own_memory(s.segment_id)
            if memory is None:
                continue  # another node's segment
            allocator = s.allocator
            report.append({
                "id": s.segment_id, "name": s.name, "size_bytes": s.size_bytes,
                "used_bytes": allocator.used_bytes, "free_bytes": allocator.free_bytes,
                "allocations": allocator.allocation_count,
                "largest_free_bytes": allocator.largest_free_bytes(),
                "shm_path": memory.path})
        return report

    def describe_object(self, key, entry) -> dict:
        now_ms = self.now_ms()
        version = entry.complete or entry.pending
        lease_left = max(0, self.master.lease_end_ms(key) - now_ms) if entry.complete else 0
        soft_left = (max(0, entry.soft_pin_deadline_ms - now_ms)
                     if entry.soft_pin_deadline_ms is not None else None)
        return {
            "namespace": key[0], "key": key[1], "size_bytes": version.size_bytes,
            "state": "complete" if entry.complete else "writing",
            "replicas": [{"segment_id": r.segment_id, "offset": r.offset}
                         for r in version.replicas],
            "lease_expires_in_ms": lease_left, "soft_pin_expires_in_ms": soft_left,
            "hard_pin": entry.hard_pin, "created_ms_ago": now_ms - entry.created_ms}

    def status(self) -> dict:
        state = self.master.state
        return {
            "node_name": self.node_name, "server_version": __version__, "pid": self.pid,
            "uptime_s": round(time.time() - self.started_at, 3), "loop": self.loop_name(),
            "loop_reason": self.loop_reason,
            "objects": self.objects_count(), "used_bytes": state.used_bytes(),
            "reserved_bytes": self.reservations.reserved_bytes(),
            "capacity_bytes": state.capacity_bytes(), "connections": len(self.connections),
            "leases": self.master.active_leases(self.now_ms()),
            "puts_in_progress": self.puts_in_progress(), "tcp_port": self.tcp_port,
            "unix_socket": self.config.server.unix_socket, "metrics_port": self.metrics_port,
            "draining": self.draining,
            "cluster": self.cluster.status() if self.cluster is not None else None,
            "evictions": {"runs": self.master.evictions.runs,
                          "objects": self.master.evictions.objects,
                          "bytes": self.master.evictions.bytes}}

    def _status_line(self) -> str:
        state = self.master.state
        return (f"{self.objects_count()} objects, {state.used_bytes()}/{state.capacity_bytes()} "
                f"bytes used, {len(self.connections)} clients")

    # -- shutdown ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("stopping: %d connection(s) open", len(self.connections))
        self._notifier.notify(STOPPING="1", STATUS="stopping")
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        if not self.connections:
            self._drained.set()
        self.stop_requested.set()

    def abandon(self) -> None:
        """Undo a start-up that failed part way: listeners closed, segment files removed."""
        for server in self._servers:
            server.close()
        if self.cluster is not None:
            self.cluster.close()
        if self._metrics is not None:
            self._metrics.close()
        for memory in self.memory.values():
            memory.close()
        self._notifier.close()

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.leave()
        grace_s = self.config.server.shutdown_grace_ms / 1000
        try:
            await asyncio.wait_for(self._drained.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("%d connection(s) still busy after %.1f s; closing them",
                        len(self.connections), grace_s)
            for conn in list(self.connections):
                conn.abort()
            await asyncio.sleep(0)
        if self._sweep is not None:
            self._sweep.cancel()
        if self.cluster is not None:
            self.cluster.close()
        if self._metrics is not None:
            self._metrics.close()
        if self.config.server.unix_socket:
            try:
                os.unlink(self.config.server.unix_socket)
            except FileNotFoundError:
                pass
        for memory in self.memory.values():
            memory.close()
        self._notifier.close()
        log.info("stopped")


async def serve(config: config_module.Config, loop_reason: str = "",
                join_address: str = "") -> None:
    daemon = Daemon(config)
    daemon.loop_reason = loop_reason
    daemon.join_address = join_address
    try:
        await daemon.start()
    except BaseException:
        daemon.abandon()
        raise
    await daemon.stop_requested.wait()
    await daemon.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mooncaked", description="KV-cache store daemon")
    parser.add_argument("-c", "--config", default=os.environ.get("MOONCAKED_CONFIG"),
                        help=f"configuration file (default {DEFAULT_CONFIG_PATH}, or "
                             "$MOONCAKED_CONFIG; without one, the built-in defaults)")
    parser.add_argument("--check-config", action="store_true",
                        help="load and check the configuration, print it, and exit")
    parser.add_argument("--join", metavar="HOST:PORT", default="",
                        help="join the cluster of the member whose peer listener is HOST:PORT "
                        "(needs [cluster] enabled; overrides [cluster] join)")
    parser.add_argument("--version", action="version", version=f"mooncaked {__version__}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.config
    if path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        path = DEFAULT_CONFIG_PATH
    try:
        config = config_module.load(path) if path else config_module.Config(source="<defaults>")
    except config_module.ConfigError as exc:
        print(f"mooncaked: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log.level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.join and not config.cluster.enabled:
        print("mooncaked: --join needs [cluster] enabled = true", file=sys.stderr)
        return 2
    if args.check_config:
        import json
        print(json.dumps(config.as_dict(), indent=2))
        return 0
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a daemon hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        loop_factory, loop_reason = choose_loop(config.server.loop,
                                                config.server.busy_poll_us)
    except (RuntimeError, ValueError) as exc:
        print(f"mooncaked: cannot start: {exc}", file=sys.stderr)
        return 1
    log.info("event loop: %s", loop_reason)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(config, loop_reason, args.join))
    except (OSError, ValueError) as exc:
        print(f"mooncaked: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
