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

from mooncaked import environment
from mooncaked import __version__
from mooncaked import config as config_module
from mooncaked._native import OffsetAllocator
from mooncaked.credentials import CredentialsError
from mooncaked.daemon import auth, handlers
from mooncaked.daemon.connection import AdminConnection, Connection
from mooncaked.daemon.fd_handover import FdHandover
from mooncaked.daemon.metrics import MetricsServer, Stats, make_registry
from mooncaked.daemon.reservations import Reservations
from mooncaked.daemon.sdnotify import Notifier
from mooncaked.daemon.transfer_segments import TransferSegments
from mooncaked.errors import ErrorCode
from mooncaked.io.loops import choose_loop
from mooncaked.proto import framing
from mooncaked.daemon.segment_memory import SegmentMemory, remove_stale_files
from mooncaked.meta import commands
from mooncaked.meta.master import Master
from mooncaked.meta.state_machine import Replica, StateMachine, Version

log = logging.getLogger("mooncaked")

DEFAULT_CONFIG_PATH = "/etc/mooncaked/mooncaked.toml"
EXIT_FAILED = 70  # EX_SOFTWARE: a fatal error at run time (fail_stop)


def monotonic_ms() -> int:
    return environment.monotonic_ns() // 1_000_000


class Daemon:
    # The module of the disk tier (mooncaked.ssd.tier when None); tests give another.
    disk_tier_module = None

    def __init__(self, config: config_module.Config,
                 authenticator: auth.Authenticator | None = None) -> None:
        self.config = config
        self.auth = authenticator  # None: authentication off
        self.pid = os.getpid()
        self.node_name = config.node_name
        server = config.server
        self.max_header_bytes = server.max_header_bytes
        self.max_payload_bytes = server.max_payload_bytes
        self.max_key_bytes = server.max_key_bytes
        self.max_batch_keys = server.max_batch_keys
        self.max_response_bytes = server.max_response_bytes_per_connection
        self.hello_timeout_ms = server.hello_timeout_ms
        self.frame_timeout_ms = server.frame_timeout_ms
        self.payload_timeout_ms = server.payload_timeout_ms
        # A put's payload goes into ranges the release sweep frees this long after the start.
        self.put_payload_timeout_ms = min(server.payload_timeout_ms, max(
            1, config.store.put_start_release_timeout_ms // 2))
        self.handlers = handlers.HANDLERS
        self.payload_methods = handlers.PAYLOAD_METHODS  # see Connection._dispatch
        self.stats = Stats(self.handlers)
        self.connections: set[Connection] = set()
        self.admin_connections = 0  # of them, in the Unix socket's administrative slots
        self.draining = False
        self.started_at = time.time()
        self.tcp_port = 0
        self.metrics_port = 0
        # A cluster's state machine decides by the [store] settings its log carries
        # (SetStoreSettings), the same on every node whatever its config: until the log sets
        # them, by the built-in defaults. A single node's decides by its config.
        store = config.store
        settings = config_module.StoreConfig() if config.cluster.enabled else store
        state = StateMachine(
            lambda size, alignment, max_allocations: OffsetAllocator(size, alignment,
                                                                     max_allocations),
            max_objects=settings.max_objects,
            put_start_discard_timeout_ms=settings.put_start_discard_timeout_ms,
            put_start_release_timeout_ms=settings.put_start_release_timeout_ms,
            allocation_strategy=settings.allocation_strategy)
        seed = int.from_bytes(environment.random_bytes(8), "little")
        if config.cluster.enabled:
            from mooncaked.cluster.master import ReplicatedMaster
            # Mutations go through the log (the cluster service attaches it at start); ages
            # and leases in reports (objects stat, status, metrics) are on the log's clock, as
            # the master grants them, not this process's own monotonic clock.
            # An arena that may still receive a write is held after it closes: a part handed
            # out just before reaches its writer within rpc_timeout_ms, whose write times out
            # within another, and may land up to the hold a revoked put's ranges get (twice
            # rpc_timeout_ms, cluster_handlers._store_value) after that.
            self.master = ReplicatedMaster(
                state, store, None, seed, arena_bytes=config.cluster.arena_bytes,
                late_write_ms=4 * config.cluster.rpc_timeout_ms)
        else:
            self.master = Master(state, store, seed)
        self.now_ms = self.master.now_ms if config.cluster.enabled else monotonic_ms
        self.reservations = Reservations(self.master, server.max_reserved_bytes_per_connection)
        if not config.cluster.enabled:
            # A single node's state starts empty: its config is the quotas. (A cluster's come
            # from the log; the leader proposes configured ones, cluster/service.py.)
            for namespace, quota in config.namespaces.items():
                self.master.set_quota(namespace, quota.max_bytes, quota.max_objects)
        self.memory: dict[int, SegmentMemory] = {}
        self.shared_segment_ids: list[int] = []
        self.pool_segment_ids: dict[str, list[int]] = {}  # namespace -> its pool's segments
        self.fd_handover: FdHandover | None = None
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
        self.get_staging = None  # a cluster node's GetStaging, for its local clients' gets
        # Local clients' transfer segments (te_* methods), None when [transfer] is off.
        self.transfer = TransferSegments(config.transfer) if config.transfer.enabled else None
        self.tiering = None  # daemon/tiering.py, when [ssd] is on (single node)
        self.exit_status = 0  # EXIT_FAILED after fail_stop

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
            self.shared_segment_ids.append(segment_id)
            if clustered:
                continue
            self.master.propose(commands.MountSegment(
                segment_id, f"{self.node_name}/{segment_id}", self.node_name,
                segments.size_bytes, segments.alignment_bytes, segments.max_allocations))
        # Namespace pools (refused with [cluster] enabled by the config check): one memfd
        # segment each, after the shared ones.
        pools = config_module.parse_namespace_pools(segments.namespace_pools)
        for namespace, size_bytes in pools.items():
            segment_id = len(self.memory)
            self.memory[segment_id] = SegmentMemory(
                segment_id, segments.shm_dir, size_bytes, segments.shm_mode,
                segments.numa_node, segments.huge_pages, segments.prefault,
                memfd_name=namespace)
            self.pool_segment_ids[namespace] = [segment_id]
            self.master.propose(commands.MountSegment(
                segment_id, f"{self.node_name}/pool/{namespace}", self.node_name, size_bytes,
                segments.alignment_bytes, segments.max_allocations, namespace))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.stop_requested = asyncio.Event()
        self._drained = asyncio.Event()
        self.mount_segments()
        if self.config.ssd.enabled and self.config.ssd.capacity_bytes \
                and not self.config.cluster.enabled:
            await self._open_disk_tier()
        server = self.config.server
        tcp = await loop.create_server(self._tcp_protocol_factory(loop), server.tcp_host,
                                       server.tcp_port, reuse_address=True)
        for sock in tcp.sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tcp_port = tcp.sockets[0].getsockname()[1]
        self._servers.append(tcp)
        if server.unix_socket:
            self._servers.append(await self._listen_unix(loop, server.unix_socket))
            if self.cluster is None and not self.config.cluster.enabled:
                self.fd_handover = FdHandover(server.unix_socket + ".fd",
                                              server.fd_token_ttl_ms, self._segment_fd,
                                              server.max_connections)
                self.fd_handover.start()
            elif self.config.cluster.get_staging_bytes:
                self._start_get_staging()
        if self.config.cluster.enabled:
            from mooncaked.cluster.service import ClusterService
            from mooncaked.daemon import cluster_handlers
            self.handlers = cluster_handlers.HANDLERS
            self.payload_methods = cluster_handlers.PAYLOAD_METHODS
            self.stats.methods = frozenset(self.handlers)
            self.cluster = ClusterService(self, self.join_address)
            await self.cluster.start()
        metrics = self.config.metrics
        if metrics.enabled:
            self._metrics = MetricsServer(make_registry(self))
            self.metrics_port = await self._metrics.start(metrics.host, metrics.port)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        if self.auth is not None:
            loop.add_signal_handler(signal.SIGHUP, self.auth.reload)
        elif not auth.is_loopback(server.tcp_host):
            log.warning("authentication is off ([auth] credentials_file is empty) and the TCP "
                        "listener is on %s, not loopback: anyone who can reach port %d may "
                        "read, write and remove every namespace's objects", server.tcp_host,
                        self.tcp_port)
        self._schedule_sweep()
        log.info("mooncaked %s on %s: tcp%s %s:%d, unix %s, metrics %s, %d segment(s) of %d "
                 "bytes, loop %s", __version__, self.node_name,
                 " (tls)" if self.config.tls.enabled else "", server.tcp_host, self.tcp_port,
                 server.unix_socket or "-", self.metrics_port or "-", len(self.memory),
                 self.config.segments.size_bytes, self.loop_name())
        self._notifier.notify(READY="1", STATUS=self._status_line(), MAINPID=str(self.pid))

    async def _open_disk_tier(self) -> None:
        """Open the disk tier ([ssd]) and make what it recovered readable again."""
        from mooncaked.daemon.tiering import Tiering
        tier_module = self.disk_tier_module
        if tier_module is None:
            from mooncaked.ssd import tier as tier_module

        def on_reclaim(records) -> None:
            self.tiering.on_reclaim(records)
        try:
            tier = await tier_module.DiskTier.open(self.config.ssd,
                                                   loop=asyncio.get_running_loop(),
                                                   on_reclaim=on_reclaim)
        except OSError:
            raise  # "cannot start: ..." with the system's reason
        except Exception as exc:  # formatted with other sizes, in use, no room for the files
            raise SystemExit(f"mooncaked: [ssd] directory {self.config.ssd.directory}: "
                             f"{exc}") from None
        self.tiering = Tiering(self, self.config.ssd, tier, tier_module)
        self.tiering.attach()
        recovered = await self.tiering.recover(self.now_ms())
        status = tier.status()
        log.info("disk tier in %s: %d of %d bytes, %d object(s) recovered%s",
                 self.config.ssd.directory, status.get("used_bytes", 0),
                 status.get("capacity_bytes", 0), recovered,
                 "" if status.get("direct_io", True)
                 else f"; without O_DIRECT ({status.get('direct_io_reason', '')})")

    def settled(self, outcome):
        """`outcome`, or with a disk tier a coroutine giving it once the versions the request
        removed or replaced are off the disk (daemon/tiering.py Tiering.settle)."""
        if self.tiering is None:
            return outcome
        return self.tiering.settle(outcome)

    def _start_get_staging(self) -> None:
        """A cluster node's local clients map its get staging area (cluster/get_staging.py)
        instead of its segments; its fd goes to them through the fd socket."""
        from mooncaked.cluster.get_staging import GetStaging
        segments, server = self.config.segments, self.config.server
        self.get_staging = GetStaging(self.config.cluster.get_staging_bytes, segments.shm_dir,
                                      segments.shm_mode, segments.prefault)
        self.fd_handover = FdHandover(server.unix_socket + ".fd", server.fd_token_ttl_ms,
                                      self.get_staging.segment_fd, server.max_connections)
        self.fd_handover.start()

    def _tcp_protocol_factory(self, loop):
        """Connections of the TCP listener; with [tls] enabled, each wrapped in TLS (on either
        loop, see mooncaked/tls.py)."""
        def plain() -> Connection:
            return Connection(self, "tcp")
        tls_config = self.config.tls
        if not tls_config.enabled:
            return plain
        from mooncaked import tls
        return tls.server_factory(loop, plain, tls.server_context(tls_config),
                                  tls_config.handshake_timeout_ms / 1000)

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
        unix = await loop.create_unix_server(self._unix_connection, path)
        os.chmod(path, 0o660)
        return unix

    def _unix_connection(self) -> Connection:
        """A full daemon still takes a few administrative connections on the Unix socket."""
        if len(self.connections) - self.admin_connections >= self.config.server.max_connections:
            return AdminConnection(self, "unix")
        return Connection(self, "unix")

    # -- running ----------------------------------------------------------------------------

    def loop_name(self) -> str:
        return "uring" if type(asyncio.get_running_loop()).__name__ == "UringEventLoop" \
            else "asyncio"

    def _schedule_sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweep = loop.call_later(self.config.store.eviction_interval_ms / 1000, self._tick)

    def _tick(self) -> None:
        try:
            now_ms = self.now_ms()
            if self.cluster is None:
                self.sweep(now_ms)
            else:  # in a cluster the leader sweeps the store (cluster/service.py)
                self._close_late_connections(now_ms)
            if self.fd_handover is not None:
                self.fd_handover.prune()
        except Exception:
            log.exception("sweep failed")
        if self._notifier.enabled:
            line = self._status_line()
            if line != self._last_status:
                self._last_status = line
                self._notifier.notify(STATUS=line)
        self._schedule_sweep()

    def _segment_fd(self, segment_id: int) -> int | None:
        """The open fd of a segment's memory (called by the fd handover's threads)."""
        memory = self.memory.get(segment_id)
        return memory.fd if memory is not None and memory.fd >= 0 else None

    def _close_late_connections(self, now_ms: int) -> bool:
        """Close connections past a deadline (connection.py); True if one of them was
        receiving a put's payload into segment ranges."""
        receiving_put = False
        for conn in list(self.connections):
            if conn.check_deadlines(now_ms):
                receiving_put = True
        return receiving_put

    def sweep(self, now_ms: int) -> None:
        """One run of a single node's sweep: connection deadlines, then expiry and eviction,
        and the reservations that released. A connection closed while it was receiving a put
        into segment ranges defers the rest to the next run: a loop iteration must first
        cancel that receive, before the ranges can be freed and reused."""
        if self._close_late_connections(now_ms):
            return
        released = self.master.tick(now_ms)
        if released and self.reservations:
            self.reservations.forget_released(self.connections)
        if self.tiering is not None:
            self.tiering.sweep(now_ms)

    def next_connection_id(self) -> int:
        self._connection_ids += 1
        return self._connection_ids

    def connection_opened(self, conn: Connection) -> None:
        server = self.config.server
        admin = type(conn) is AdminConnection
        if admin:
            full = self.admin_connections >= server.admin_connections
        else:
            full = len(self.connections) - self.admin_connections >= server.max_connections
        if self.draining or full:
            reason = ("the daemon is stopping" if self.draining else
                      f"too many connections ({server.max_connections}"
                      + (f" and {server.admin_connections} administrative)" if admin else ")"))
            code = ErrorCode.SHUTTING_DOWN if self.draining else ErrorCode.BUSY
            conn.transport.write(framing.protocol_error_head(code, reason))
            conn.transport.close()
            return
        self.connections.add(conn)
        if admin:
            self.admin_connections += 1
        self.stats.connections_total += 1

    def connection_closed(self, conn: Connection) -> None:
        if conn not in self.connections:
            return  # refused at connection_opened
        self.connections.discard(conn)
        if type(conn) is AdminConnection:
            self.admin_connections -= 1
        for key in list(conn.puts_in_progress):
            try:
                self.master.put_revoke(key, conn.connection_id)
            except Exception as exc:  # the put may have been preempted meanwhile
                log.debug("revoking %r: %s", key, exc)
        conn.puts_in_progress.clear()
        if conn.reservations:
            self.reservations.release_all(conn)
        if self.transfer is not None:
            self.transfer.connection_closed(conn)
        if self.fd_handover is not None and conn.mappable_segments:
            self.fd_handover.forget_connection(conn.connection_id)
        if self.get_staging is not None and self.get_staging.admitted(conn.connection_id):
            self.fd_handover.forget_connection(conn.connection_id)
            self.get_staging.forget_connection(conn.connection_id)
        if self.draining and not self.connections:
            self._drained.set()

    def puts_in_progress(self) -> int:
        """Unfinished puts of clients (reservations are unfinished puts too, not counted)."""
        return self.master.puts_in_progress() - len(self.reservations)

    def objects_count(self) -> int:
        """Objects as users see them: readable or being written, not reservations."""
        return len(self.master.state.objects) - len(self.reservations)

    def max_reserved_bytes(self, conn: Connection) -> int:
        """What a connection may hold reserved: 0 where shared memory is not offered."""
        if not conn.mappable_segments:
            return 0
        return self.config.server.max_reserved_bytes_per_connection

    def mappable_segments(self, conn: Connection) -> frozenset[int]:
        """The segments a connection may map: those holding its namespace's objects, over the
        Unix socket, single node. A namespace with a pool gets that pool and nothing else;
        one without gets the shared segments if `share_with_local_clients` and, with
        authentication on, only if its principal may read every namespace (the shared
        segments hold the bytes of every namespace without a pool); else nothing."""
        if conn.transport_kind != "unix" or self.cluster is not None \
                or self.fd_handover is None:
            return frozenset()
        pool = self.master.state.pool_of(conn.namespace)
        if pool:
            return frozenset(self.pool_segment_ids.get(pool, ()))
        if self.config.segments.share_with_local_clients and (
                self.auth is None or self.auth.may_read_every_namespace(conn)):
            return frozenset(self.shared_segment_ids)
        return frozenset()

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

    def segment_descriptions(self, conn: Connection) -> list[dict]:
        """hello's `segments` for a connection: what it may map, each with a one-time token
        for its file descriptor (and the file's path, for a shared segment)."""
        prefaulted = self.config.segments.prefault
        descriptions = []
        for segment_id in sorted(conn.mappable_segments):
            segment = self.master.state.segments[segment_id]
            description = {"id": segment_id, "name": segment.name,
                           "size_bytes": segment.size_bytes, "prefaulted": prefaulted,
                           "fd_token": self.fd_handover.issue(conn.connection_id, conn.peer_pid,
                                                              segment_id)}
            path = self.memory[segment_id].path
            if path:
                description["shm_path"] = path
            descriptions.append(description)
        return descriptions

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
                "shm_path": memory.path})  # "" for a namespace pool (a memfd)
        return report

    def describe_object(self, key, entry) -> dict:
        now_ms = self.now_ms()
        version = entry.complete or entry.pending
        lease_left = max(0, self.master.lease_end_ms(key) - now_ms) if entry.complete else 0
        soft_left = (max(0, entry.soft_pin_deadline_ms - now_ms)
                     if entry.soft_pin_deadline_ms is not None else None)
        disk = entry.complete.disk if entry.complete is not None else None
        return {
            "namespace": key[0], "key": key[1], "size_bytes": version.size_bytes,
            "state": "complete" if entry.complete else "writing",
            "replicas": [{"segment_id": r.segment_id, "offset": r.offset}
                         for r in version.replicas],
            # Where the bytes are: "dram" (a replica, maybe a disk copy too) or "ssd" only.
            "tier": "dram" if version.replicas else "ssd",
            "disk": None if disk is None else {"node_id": disk.node_id, "region": disk.region,
                                               "offset": disk.offset},
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
            "unsent_response_bytes": sum(conn.transport.get_write_buffer_size()
                                         for conn in self.connections
                                         if conn.transport is not None),
            "leases": self.master.active_leases(self.now_ms()),
            "puts_in_progress": self.puts_in_progress(), "tcp_port": self.tcp_port,
            "unix_socket": self.config.server.unix_socket, "metrics_port": self.metrics_port,
            "draining": self.draining, "namespaces": self.master.quota_report(),
            "cluster": self.cluster.status() if self.cluster is not None else None,
            "transfer": self.transfer.report() if self.transfer is not None else None,
            "tiers": self.tiering.status() if self.tiering is not None else None,
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

    def fail_stop(self, reason: str) -> None:
        """Stop because going on could serve wrong state; exit non-zero so a supervisor
        (systemd's Restart=on-failure) sees the failure."""
        log.critical("stopping on a fatal error: %s", reason)
        self.exit_status = EXIT_FAILED
        self.request_stop()

    def abandon(self) -> None:
        """Undo a start-up that failed part way: listeners closed, segment files removed."""
        for server in self._servers:
            server.close()
        if self.fd_handover is not None:
            self.fd_handover.close()
        if self.cluster is not None:
            self.cluster.close()
        if self._metrics is not None:
            self._metrics.close()
        for memory in self.memory.values():
            memory.close()
        if self.get_staging is not None:
            self.get_staging.close()
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
        if self.transfer is not None:
            await self.transfer.close_all()
        if self.tiering is not None:
            await self.tiering.close()
        if self.cluster is not None:
            self.cluster.close()
        if self._metrics is not None:
            self._metrics.close()
        if self.config.server.unix_socket:
            try:
                os.unlink(self.config.server.unix_socket)
            except FileNotFoundError:
                pass
        if self.fd_handover is not None:
            self.fd_handover.close()
        for memory in self.memory.values():
            memory.close()
        if self.get_staging is not None:
            self.get_staging.close()
        self._notifier.close()
        log.info("stopped")


async def serve(config: config_module.Config, loop_reason: str = "",
                join_address: str = "", authenticator: auth.Authenticator | None = None
                ) -> int:
    """Run a daemon until it is stopped; its exit status."""
    daemon = Daemon(config, authenticator)
    daemon.loop_reason = loop_reason
    daemon.join_address = join_address
    try:
        await daemon.start()
    except BaseException:
        daemon.abandon()
        raise
    await daemon.stop_requested.wait()
    await daemon.stop()
    return daemon.exit_status


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
    authenticator = None
    if config.auth.credentials_file:
        try:
            authenticator = auth.Authenticator.load(config.auth.credentials_file)
        except CredentialsError as exc:
            print(f"mooncaked: credentials error ([auth] credentials_file in {config.source}): "
                  f"{exc}", file=sys.stderr)
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
            return runner.run(serve(config, loop_reason, args.join, authenticator))
    except (OSError, ValueError) as exc:
        print(f"mooncaked: cannot start: {exc}", file=sys.stderr)
        return 1
