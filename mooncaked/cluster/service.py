"""A daemon's part in a cluster: membership, the leader's duties, forwarding, replica bytes.

- The Raft node (cluster/raft_node.py) replicates the metadata log; the leader's master
  (cluster/master.py) turns client operations into log commands.
- A follower forwards a client's metadata operation to the leader (`meta` peer request) and
  returns its answer; the client never needs to know who leads.
- Replica bytes move daemon to daemon (`write_replica`, `read_replica` peer requests over the
  data links), never through the leader. Values above `stripe_bytes` are split over the
  `data_connections` links and sent in parallel.
- The leader declares a node down when it has heard nothing from it for `node_ttl_ms`
  (NodeDown: its segments and their replicas leave reads and placement), promotes learners
  once they have caught up, and runs the expiry and eviction sweep.
- Reconciliation: a silent member may be cut off or paused, not lost. Its NodeDown keeps what
  it held for `node_return_grace_ms` (meta/state_machine.py DownNode): its ranges stay
  allocated, its replicas parked. When the same process comes back (it still holds the mount
  generation its segments had) it proposes NodeReturn instead of a NodeUp, and gets back,
  under a new generation, the replicas of values whose version is still the readable one and
  lacks replicas (repair may have restored them meanwhile; then its copies are freed). A
  restarted process has new memory: it registers with a NodeUp, which drops what was kept.
  After the grace the leader drops it (ReleaseDownNode), as it does for a node removed.
  Why a returning node's bytes can be trusted: every range it held stayed allocated while it
  was down, so nothing was placed in that memory; writes only ever go to unfinished puts'
  ranges, never a readable version's; and any request that names the old generation, late
  by however long, is refused once it is back.
- The leader restores replica_num after a node is declared down, copying the values that lost
  a replica to other nodes (cluster/repair.py).
- Each node registers itself (NodeUp, then MountSegment for each of its segments) once a
  leader is known, and again whenever the log says it was declared down (first trying to
  return with its memory, NodeReturn).
- The `[store]` values the state machine decides by (max_objects, the put timeouts,
  allocation_strategy) are replicated state too (SetStoreSettings): the first leader of a new
  cluster proposes its config's; a node whose config says otherwise logs which keys differ and
  follows the log.
- Namespace quotas are replicated state (SetQuota): a new leader proposes the `[namespaces]`
  quotas of its own config for namespaces the log has never had a quota for; after that they
  change only through `quota_set` (mooncakectl quota set), so every node enforces the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from mooncaked import environment
from mooncaked.cluster import meta_requests
from mooncaked.cluster.master import ReplicatedMaster
from mooncaked.cluster.peer_security import PeerSecurity
from mooncaked.cluster.peer_transport import (PeerLink, PeerServer, PeerUnreachable,
                                              uninitialized_bytearray)
from mooncaked.cluster.raft_node import RaftNode
from mooncaked.cluster.repair import ReplicaRepair
from mooncaked.config import parse_members
from mooncaked.daemon.auth import is_loopback
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec as command_codec
from mooncaked.meta import commands as c
from mooncaked.meta.master import ReplicateConfig
from mooncaked.meta.state_machine import Replica, Version, store_settings_problem
from mooncaked.raft.fs import OsFileSystem
from mooncaked.raft.log_store import LogStore
from mooncaked.raft.types import ConfChange, ConfChangeKind, Role

log = logging.getLogger(__name__)


def version_to_wire(version: Version | None):
    if version is None:
        return None
    return [version.size_bytes, [[r.segment_id, r.offset] for r in version.replicas]]


def replicas_to_wire(replicas: list[Replica]) -> list:
    return [[r.segment_id, r.offset, r.handle] for r in replicas]


def replicas_from_wire(value) -> list[Replica]:
    return [Replica(segment_id, offset, handle) for segment_id, offset, handle in value]


def config_to_wire(config: ReplicateConfig) -> list:
    return [config.replica_num, list(config.preferred_segments), config.soft_pin_ttl_ms,
            config.hard_pin]


def _int_params(params: list, count: int, shape: str) -> list:
    """A replica request's params: exactly `count` ints, else INVALID_PARAMS."""
    if len(params) != count or any(type(p) is not int for p in params):
        raise MooncakedError(ErrorCode.INVALID_PARAMS, f"takes {shape}")
    return params


# Forwarded methods that change nothing: asked again of a new leader when the old one is
# replaced while it holds them.
READ_ONLY_METHODS = frozenset({"read"})
# A read is asked again after these: none of them says anything about its answer.
RETRIED_READ_ERRORS = frozenset({ErrorCode.NO_LEADER, ErrorCode.OUTCOME_UNKNOWN,
                                 ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT})
# Forwarded methods that propose one command: NO_LEADER says it was not applied, so they are
# asked again (of the same leader, or a new one) until the wait for a leader ends.
SINGLE_STEP_METHODS = frozenset({"put_start", "put_end", "put_revoke", "remove"})
# The applied commands that _applied acts on (membership, segments, settings).
_COMMANDS_THE_SERVICE_FOLLOWS = frozenset({c.SetStoreSettings, c.NodeDown, c.NodeUp,
                                           c.UnmountSegment, c.MountSegment, c.NodeReturn})


class ClusterService:
    def __init__(self, daemon, join_address: str = "") -> None:
        self.daemon = daemon
        config = daemon.config
        self.cluster_config = cc = config.cluster
        self.node_id = cc.node_id
        self.join_address = join_address or cc.join
        self.members_config = parse_members(cc.initial_members)
        self.addresses: dict[int, str] = dict(self.members_config)  # node id -> peer host:port
        self.rpc_timeout_s = cc.rpc_timeout_ms / 1000
        self.security = PeerSecurity.from_config(config)
        self.peer_server = PeerServer(self._on_hello, self._on_raft, self._on_request,
                                      config.server.max_payload_bytes, self._payload_target,
                                      self.security)
        self._control: dict[int, PeerLink] = {}
        self._data: dict[int, list[PeerLink]] = {}
        self._data_turn = 0
        self.peer_address = ""
        self.raft: RaftNode | None = None
        self.master: ReplicatedMaster | None = None
        self.registered_term = -1  # the term in which this node last registered itself
        # Each registration mounts the segments under the generation the log gave its NodeUp
        # (meta/commands.py), never one this node had before; 0 until registered.
        self.mount_generation = 0
        self._registering: asyncio.Task | None = None
        self._duties: asyncio.TimerHandle | None = None
        self._sweeping = False
        self.leaving = False  # a clean stop announced: do not register again
        # Removed from the cluster (its own removal applied here, or the leader refused it as
        # no member): it serves no cluster data and does not register again.
        self.removed = False
        self._membership_check_at = 0.0  # monotonic: when a leaderless node may ask peers again
        self._membership_check: asyncio.Task | None = None
        self._known_leader = 0
        self._leader_changed: asyncio.Future | None = None  # resolved when the leader changes
        # Numbers the writer ids of this node's puts; a random start keeps them apart from an
        # earlier incarnation's, whose late commands may still reach the log.
        self.put_attempts = int.from_bytes(environment.random_bytes(4), "little")
        self._leader_since = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"forwarded": 0, "replica_bytes_sent": 0, "replica_bytes_received": 0,
                      "replica_read_failovers": 0, "nodes_declared_down": 0,
                      "returns": 0}
        self.repair = ReplicaRepair(self)

    # -- start and stop -----------------------------------------------------------------------

    async def start(self) -> None:
        self._leader_changed = asyncio.get_running_loop().create_future()
        cc = self.cluster_config
        port = await self.peer_server.start(cc.peer_host, cc.peer_port)
        host = cc.advertise_host or cc.peer_host
        self.peer_address = f"{host}:{port}"
        log.info("peer listener on %s; peers authenticated by %s", self.peer_address,
                 self.security.describe())
        if self.security.secret is None and self.security.server_context is None \
                and not is_loopback(cc.peer_host):
            log.warning("peer links are not authenticated ([tls] off, no [cluster] "
                        "secret_file) and the peer listener is on %s, not loopback: any process "
                        "that reaches port %d can join, forward requests and write replicas",
                        cc.peer_host, port)
        self.addresses[self.node_id] = self.peer_address
        store = LogStore(os.path.join(cc.data_dir, f"node-{self.node_id}"), fsync=cc.fsync,
                         **environment.log_store_options())
        if self.members_config:
            voters = tuple(sorted(self.members_config))
        elif self.join_address:
            voters = None  # learns the membership from the cluster it joins
        else:
            voters = (self.node_id,)  # a new cluster of one, which others may join
        daemon = self.daemon
        self.raft = RaftNode(
            self.node_id, daemon.master.state, store, election_ticks=cc.election_ticks,
            heartbeat_ticks=cc.heartbeat_ticks, tick_ms=cc.tick_ms, read_mode=cc.read_mode,
            snapshot_entries=cc.snapshot_entries, max_pending_proposals=cc.max_pending_proposals,
            proposal_timeout_ms=cc.rpc_timeout_ms, initial_voters=voters, send=self._send_raft)
        self.master = daemon.master  # the daemon built it for cluster mode
        self.master.attach(self.raft)
        self.raft.on_role_change = self._role_changed
        self.raft.on_applied = self._applied
        self.raft.on_conf_change = self._conf_changed
        self.raft.on_snapshot_restored = self._snapshot_restored
        self.raft.fatal = lambda error: daemon.fail_stop(f"the Raft node stopped: {error!r}")
        for node in daemon.master.state.nodes.values():
            self.addresses.setdefault(node.node_id, node.peer_address)
        self.raft.start()
        if self._log_fs().exists(self._removed_marker()):
            self._mark_removed("it had been removed before this start")
        fresh_join = voters is None and self.raft.core.last_index == 0
        if fresh_join:
            await self._join()
        self._schedule_duties()

    async def leave(self, timeout_s: float = 1.0) -> None:
        """On a clean stop: have this node declared down now, so no new put is placed on it.

        Its Raft membership stays (it is expected back); a node that never says so is
        declared down by the leader after node_ttl_ms.
        """
        self.leaving = True
        if self._registering is not None:
            self._registering.cancel()
        try:
            await asyncio.wait_for(self.meta("leave", [self.node_id]), timeout_s)
        except (MooncakedError, asyncio.TimeoutError) as exc:
            log.info("could not announce leaving: %s", getattr(exc, "message", "timeout"))

    def close(self) -> None:
        self.repair.stop()
        if self._duties is not None:
            self._duties.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self.raft is not None:
            self.raft.stop()
        self.peer_server.close()
        for link in self._control.values():
            link.close()
        for links in self._data.values():
            for link in links:
                link.close()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- links --------------------------------------------------------------------------------

    def _address_of(self, node_id: int):
        return lambda: self.addresses.get(node_id)

    def _new_link(self, node_id: int) -> PeerLink:
        host = self.cluster_config.peer_host
        return PeerLink(self.node_id, self.peer_address, node_id, self._address_of(node_id),
                        self.daemon.config.server.max_payload_bytes, self.rpc_timeout_s,
                        None if host in ("0.0.0.0", "::", "") else host, self.security)

    def control(self, node_id: int) -> PeerLink:
        link = self._control.get(node_id)
        if link is None:
            link = self._control[node_id] = self._new_link(node_id)
        return link

    def data_link(self, node_id: int) -> PeerLink:
        links = self._data.get(node_id)
        if links is None:
            links = self._data[node_id] = [self._new_link(node_id) for _ in
                                           range(self.cluster_config.data_connections)]
        self._data_turn += 1
        return links[self._data_turn % len(links)]

    def _send_raft(self, to: int, data: bytes) -> bool:
        if to == self.node_id:
            return True
        return self.control(to).send_raft(data)

    def _on_hello(self, node_id: int, address: str) -> None:
        if node_id and address:
            self.addresses[node_id] = address

    def _on_raft(self, data: bytes) -> None:
        self.raft.step(data)

    # -- Raft hooks ---------------------------------------------------------------------------

    def _role_changed(self, role: Role, leader: int, term: int) -> None:
        if leader != self._known_leader:
            self._known_leader = leader
            self._leader_changed.set_result(leader)
            self._leader_changed = asyncio.get_running_loop().create_future()
        if role == Role.LEADER:
            self.master.become_leader()
            if self.daemon.config.namespaces:
                self._spawn(self._seed_quotas(term))
            self._spawn(self._seed_store_settings(term))
            self._leader_since = now = environment.monotonic()
            for node_id in self.daemon.master.state.nodes:
                self.raft.last_contact[node_id] = now  # silence is counted from here
            self.repair.start(term)
        else:
            self.repair.stop()
        if leader and self.registered_term < 0:
            self._register_soon()

    def _applied(self, index: int, command, result) -> None:
        if type(command) not in _COMMANDS_THE_SERVICE_FOLLOWS:
            return  # most entries: puts, removes, evictions
        if isinstance(command, c.SetStoreSettings):
            self._compare_store_settings()
        if isinstance(command, (c.NodeDown, c.NodeUp, c.UnmountSegment)):
            self._check_own_segments()
        if isinstance(command, (c.NodeDown, c.NodeUp, c.UnmountSegment, c.MountSegment,
                                c.NodeReturn)):
            self.repair.state_changed()
        if isinstance(command, c.NodeUp):
            self.addresses[command.node_id] = command.peer_address
        if isinstance(command, (c.NodeUp, c.NodeReturn)):
            # It has just registered: its silence is counted from here, not from before it
            # (re)started, or the leader declares it down again at once.
            self.raft.last_contact[command.node_id] = environment.monotonic()

    def _check_own_segments(self) -> None:
        """Register again when the log no longer mounts this node's current segments: it was
        declared down, or a late NodeUp of an earlier incarnation dropped them. A registration
        in flight ends only once its own commands are applied here (see _register)."""
        if self.registered_term < 0 or self.leaving:
            return
        state = self.daemon.master.state
        own = [c.segment_id_of(self.node_id, index, self.mount_generation)
               for index in range(self.daemon.config.segments.count)]
        if not all(segment_id in state.segments for segment_id in own):
            log.warning("the log no longer mounts this node's segments (declared down); "
                        "registering them again")
            self.registered_term = -1
            self._register_soon()

    def _conf_changed(self, change: ConfChange, conf_state) -> None:
        if change.context:
            self.addresses[change.node_id] = change.context.decode()
        log.info("membership: %s node %d; voters %s, learners %s", change.kind.name.lower(),
                 change.node_id, list(conf_state.voters), list(conf_state.learners))
        if change.kind == ConfChangeKind.REMOVE and change.node_id == self.node_id \
                and self.node_id not in conf_state.voters \
                and self.node_id not in conf_state.learners:
            self._mark_removed("its removal was applied")

    def _mark_removed(self, why: str) -> None:
        """This node is no member any more: it stops registering and refuses data requests
        (NOT_A_MEMBER) instead of serving a copy of the log that no longer grows."""
        if self.removed:
            return
        self.removed = True
        self.registered_term = -1
        if self._registering is not None:
            self._registering.cancel()
        self.raft.stop_ticking()  # it never campaigns again
        log.warning("this node was removed from the cluster (%s): it serves no cluster data; "
                    "to serve again, restart it with an empty data_dir and add it again", why)
        # Remembered across restarts: the removal may be compacted into a snapshot, and the
        # members that could tell it again no longer replicate to it.
        fs = self._log_fs()
        try:
            fd = fs.open_truncate(self._removed_marker())
            try:
                fs.write(fd, f"{why}\n".encode())
                fs.fsync(fd)
            finally:
                fs.close(fd)
            fs.fsync_directory(self.cluster_config.data_dir)
        except OSError as exc:
            log.warning("could not record the removal in %s: %s", self._removed_marker(), exc)

    @staticmethod
    def _log_fs():
        """The file system of the Raft log's data_dir (a simulated one under the simulator)."""
        return environment.log_store_options().get("fs") or OsFileSystem()

    def _removed_marker(self) -> str:
        return os.path.join(self.cluster_config.data_dir, f"node-{self.node_id}.removed")

    def check_member(self) -> None:
        if self.removed:
            raise MooncakedError(ErrorCode.NOT_A_MEMBER,
                                 f"node {self.node_id} was removed from the cluster; "
                                 "ask another node")

    def _snapshot_restored(self) -> None:
        for node in self.daemon.master.state.nodes.values():
            self.addresses[node.node_id] = node.peer_address
        self._compare_store_settings()
        self._check_own_segments()

    def _store_settings_differences(self) -> list[str]:
        """`key=cluster's (config: this node's)` for each [store] value the log sets otherwise."""
        cluster = self.daemon.master.state.store_settings()
        store = self.daemon.config.store
        return [f"{field.name}={getattr(cluster, field.name)!r} "
                f"(config: {getattr(store, field.name)!r})"
                for field in dataclasses.fields(cluster)
                if getattr(cluster, field.name) != getattr(store, field.name)]

    def _compare_store_settings(self) -> None:
        if not self.daemon.master.state.store_settings_from_log:
            return
        differences = self._store_settings_differences()
        if differences:
            log.warning("[store] settings differ from the cluster's, which this node follows: "
                        "%s", ", ".join(differences))

    # -- registration -------------------------------------------------------------------------

    async def until_registered(self) -> None:
        """Wait (within the leader wait) while this node's segments are not mounted in the log
        (at start, or after it was declared down): a put placed meanwhile could not use them,
        and placement no longer waits in the log behind the registration."""
        deadline = environment.monotonic() + self._leader_wait_s()
        while self.registered_term < 0 and not self.removed and not self.leaving \
                and environment.monotonic() < deadline:
            await asyncio.sleep(self.cluster_config.tick_ms / 1000)

    def _register_soon(self) -> None:
        if self.leaving or self.removed:
            return
        if self._registering is None or self._registering.done():
            self._registering = self._spawn(self._register())

    async def _register(self) -> None:
        """NodeUp then MountSegment for each own segment, through the leader; retried."""
        daemon = self.daemon
        segments = daemon.config.segments
        server = daemon.config.server
        host = self.cluster_config.advertise_host or server.tcp_host
        commands = [c.NodeUp(self.node_id, daemon.node_name, f"{host}:{daemon.tcp_port}",
                             self.peer_address)]
        for index in range(segments.count):
            # Generation 0 here: the leader mounts them under the one the log gives the NodeUp.
            commands.append(c.MountSegment(
                c.segment_id_of(self.node_id, index),
                f"{daemon.node_name}/{index}",
                daemon.node_name, segments.size_bytes, segments.alignment_bytes,
                segments.max_allocations))
        while True:
            try:
                generation = await self._return() if self.mount_generation else 0
                if not generation:
                    generation = await self.meta(
                        "register", [[command_codec.encode(x) for x in commands]])
                if type(generation) is not int or not 1 <= generation <= c.MAX_GENERATION:
                    raise MooncakedError(ErrorCode.INTERNAL_ERROR,
                                         f"the leader answered generation {generation!r:.40}")
                self.mount_generation = generation
                # Done once this node has applied its own registration too: until then it
                # may still replay an older NodeDown of itself, which must not count as new.
                own = [c.segment_id_of(self.node_id, index, generation)
                       for index in range(segments.count)]
                state = daemon.master.state
                deadline = environment.monotonic() + self.rpc_timeout_s
                while not all(segment_id in state.segments for segment_id in own):
                    if environment.monotonic() > deadline:
                        raise MooncakedError(ErrorCode.RPC_TIMEOUT,
                                             "the registration was not applied here in time")
                    await asyncio.sleep(0.01)
                self.registered_term = self.raft.core.term
                log.info("registered %d segment(s) with the cluster", segments.count)
                return
            except MooncakedError as exc:
                if exc.code == ErrorCode.NOT_A_MEMBER:
                    return
                log.info("registration: %s; retrying", exc.message)
                await asyncio.sleep(self.cluster_config.tick_ms * 2 / 1000)

    async def _return(self) -> int:
        """This process registered before and still has its memory: ask the log for what it
        kept of this node (NodeReturn). The new generation, or 0 when nothing was kept (then
        this node registers anew, its memory counted as empty)."""
        generation = await self.meta("return", [self.node_id, self.mount_generation])
        if type(generation) is not int or not 0 <= generation <= c.MAX_GENERATION:
            raise MooncakedError(ErrorCode.INTERNAL_ERROR,
                                 f"the leader answered generation {generation!r:.40}")
        if generation:
            self.stats["returns"] += 1
            log.warning("declared down, back with its memory: the replicas the log kept of "
                        "this node are restored, under mount generation %d", generation)
        else:
            log.warning("declared down, and the log keeps nothing of this node's segments "
                        "(node_return_grace_ms passed, or it was dropped): registering anew")
            self.mount_generation = 0
        return generation

    async def _join(self) -> None:
        """Ask the cluster (through any member) to add this node as a learner."""
        link = PeerLink(self.node_id, self.peer_address, 0, lambda: self.join_address,
                        self.daemon.config.server.max_payload_bytes, self.rpc_timeout_s,
                        security=self.security)
        try:
            for _ in range(60):
                try:
                    await link.call("meta_forward", ["join", [self.node_id, self.peer_address]],
                                    timeout_s=self.rpc_timeout_s)
                    log.info("joined the cluster through %s", self.join_address)
                    return
                except MooncakedError as exc:
                    log.info("joining through %s: %s; retrying", self.join_address, exc.message)
                    await asyncio.sleep(0.5)
            raise MooncakedError(ErrorCode.RPC_FAIL,
                                 f"could not join the cluster through {self.join_address}")
        finally:
            link.close()

    # -- the leader's duties ------------------------------------------------------------------

    def _schedule_duties(self) -> None:
        loop = asyncio.get_running_loop()
        self._duties = loop.call_later(self.cluster_config.tick_ms / 1000, self._run_duties)

    def _run_duties(self) -> None:
        self._schedule_duties()
        if not self.raft.leader_id and not self.removed:
            self._check_membership_soon()
        if self.raft.role != Role.LEADER or self._sweeping:
            return
        self._sweeping = True
        task = self._spawn(self._leader_duties())
        task.add_done_callback(lambda t: setattr(self, "_sweeping", False))

    def _check_membership_soon(self) -> None:
        now = environment.monotonic()
        checking = self._membership_check
        if now >= self._membership_check_at and (checking is None or checking.done()):
            self._membership_check_at = now + self._leader_wait_s()
            self._membership_check = self._spawn(self._check_membership())

    async def _check_membership(self) -> None:
        """A node that hears from no leader asks its peers whether it is still a member: one
        removed while it was down, stopped or cut off never receives its removal (the leader
        no longer replicates to it). Removed once a peer that has applied at least as much
        of the log as this node lists it no more: what a node applied was committed, so the
        removal is in the log. Any peer will do, not only a leader: the leader may be a node
        this one has never heard of."""
        conf = self.raft.core.conf_state
        members = set(conf.voters) | set(conf.learners)
        if self.node_id not in members:
            return  # joining: not a member yet
        applied = self.raft.applied_index
        for node_id in sorted(members - {self.node_id}):
            try:
                status, _ = await self.control(node_id).call("status", [],
                                                             timeout_s=self.rpc_timeout_s)
            except MooncakedError:
                continue
            if type(status) is not dict or not isinstance(status.get("applied"), int) \
                    or status["applied"] < applied:
                continue
            if self.node_id not in status.get("voters", ()) \
                    and self.node_id not in status.get("learners", ()):
                self._mark_removed(f"node {node_id}, which has applied more of the log, "
                                   "no longer lists it")
                return

    async def _leader_duties(self) -> None:
        try:
            await self._check_liveness()
            await self._promote_learners()
            await self.master.sweep()
        except MooncakedError as exc:
            log.debug("leader duties: %s", exc.message)

    async def _check_liveness(self) -> None:
        """Declare silent nodes down (what they held kept for node_return_grace_ms, unless
        they are no members), and drop what is kept once the grace has passed."""
        state = self.daemon.master.state
        ttl_s = self.cluster_config.node_ttl_ms / 1000
        grace_ms = self.cluster_config.node_return_grace_ms
        now = environment.monotonic()
        members = set(self.raft.core.conf_state.voters) | set(self.raft.core.conf_state.learners)
        for node in list(state.nodes.values()):
            if not node.up or node.node_id == self.node_id:
                continue
            last = self.raft.last_contact.get(node.node_id, self._leader_since)
            if now - last > ttl_s or node.node_id not in members:
                log.warning("node %d (%s) silent for %.1f s: declaring it down", node.node_id,
                            node.name, now - last)
                self.stats["nodes_declared_down"] += 1
                keep_until_ms = self.master.now_ms() + grace_ms \
                    if grace_ms and node.node_id in members else 0
                await self.raft.propose(c.NodeDown(node.node_id, keep_until_ms))
        for kept in list(state.down_nodes.values()):
            if kept.keep_until_ms <= self.master.now_ms() or kept.node_id not in members:
                log.warning("node %d did not return within node_return_grace_ms: the %d "
                            "replicas kept for it are dropped", kept.node_id, len(kept.parked))
                await self.raft.propose(c.ReleaseDownNode(kept.node_id, kept.generation))

    async def _seed_quotas(self, term: int) -> None:
        """Propose this node's configured quotas for namespaces the log has none for."""
        try:
            await self.raft.read_barrier()  # everything earlier leaders committed is applied
            state = self.daemon.master.state
            for namespace, quota in self.daemon.config.namespaces.items():
                if self.raft.role != Role.LEADER or self.raft.core.term != term:
                    return
                wanted = (quota.max_bytes, quota.max_objects)
                current = state.quotas.get(namespace)
                if current is None:
                    await self.raft.propose(c.SetQuota(namespace, *wanted))
                elif current != wanted:
                    log.warning("namespace %r: the cluster's quota is max_bytes=%d "
                                "max_objects=%d, this node's config says %d and %d; the "
                                "cluster's stays (change it with mooncakectl quota set)",
                                namespace, *current, *wanted)
        except MooncakedError as exc:
            log.info("quotas from the config not proposed: %s", exc.message)

    async def _promote_learners(self) -> None:
        core = self.raft.core
        learners = core.conf_state.learners
        if not learners:
            return
        progress = core.status().get("progress", {})
        for learner in learners:
            match = progress.get(learner, {}).get("match", 0)
            if match >= core.commit_index:
                log.info("learner %d caught up (match %d): promoting it", learner, match)
                await self.raft.propose_conf_change(ConfChange(ConfChangeKind.PROMOTE, learner))
                return  # one change at a time

    # -- forwarding to the leader -------------------------------------------------------------

    def _leader_wait_s(self) -> float:
        """How long a request waits for a leader: twice the election timeout plus 1 s."""
        cc = self.cluster_config
        return 2 * cc.election_ticks * cc.tick_ms / 1000 + 1

    async def leader_id(self, deadline: float | None = None) -> int:
        """The current leader, waiting until `deadline` (monotonic seconds; by default
        _leader_wait_s from now) for one to appear, then NO_LEADER."""
        if deadline is None:
            deadline = environment.monotonic() + self._leader_wait_s()
        while True:
            self.check_member()
            leader = self.raft.leader_id
            if leader:
                return leader
            if environment.monotonic() > deadline:
                raise MooncakedError(ErrorCode.NO_LEADER, "the cluster has no leader now")
            await asyncio.sleep(self.cluster_config.tick_ms / 1000)

    async def _before_asking_again(self, deadline: float, why: str) -> None:
        """Wait until the leader changes or a tick passes (a restarted leader may be back);
        NO_LEADER once the deadline has passed. Only for a request nothing applied."""
        remaining = deadline - environment.monotonic()
        if remaining <= 0:
            raise MooncakedError(ErrorCode.NO_LEADER,
                                 f"no leader answered in time ({why}); the request was not "
                                 "applied")
        await asyncio.wait([self._leader_changed],
                           timeout=min(remaining, self.cluster_config.tick_ms / 1000))

    @staticmethod
    def _ask_again(method: str, error: MooncakedError) -> bool:
        """Whether a failed attempt may be repeated: a read after any failure to get an answer;
        another single-step request when nothing was applied (NO_LEADER)."""
        if method in READ_ONLY_METHODS:
            return error.code in RETRIED_READ_ERRORS
        return method in SINGLE_STEP_METHODS and error.code == ErrorCode.NO_LEADER

    async def meta(self, method: str, params: list) -> Any:
        """Run a metadata operation on the leader: here, or forwarded to it.

        Until a leader answers, within _leader_wait_s: a request that never reached a leader
        (none known, its node unreachable) is asked again, as is a read after any failure and
        a single-step request the leader refused before applying it (NO_LEADER); then
        NO_LEADER. A mutation the leader may have received answers the leader's answer, or,
        when its outcome is unknown, OUTCOME_UNKNOWN (the leader changed while it held it) or
        RPC_FAIL / RPC_TIMEOUT (the connection failed after it was sent).
        """
        deadline = environment.monotonic() + self._leader_wait_s()
        while True:
            leader = await self.leader_id(deadline)
            if leader == self.node_id:
                try:
                    return await self._leader_meta(method, params)
                except MooncakedError as exc:
                    if not self._ask_again(method, exc):
                        raise
                    await self._before_asking_again(deadline, exc.message)
                    continue
            self.stats["forwarded"] += 1
            call = asyncio.ensure_future(self.control(leader).call(
                "meta", [method, params, self.node_id], timeout_s=self.rpc_timeout_s))
            changed = self._leader_changed
            await asyncio.wait([call, changed], return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                try:
                    result, _ = call.result()
                    return result
                except PeerUnreachable as exc:
                    # Never sent: the leader cannot have acted on it. Ask again, of a new
                    # leader or of this one once it is back.
                    await self._before_asking_again(deadline, exc.message)
                    continue
                except MooncakedError as exc:
                    if exc.code == ErrorCode.NOT_A_MEMBER:
                        self._mark_removed(f"node {leader}, the leader, no longer lists it")
                        self.check_member()
                    if not self._ask_again(method, exc):
                        raise
                    await self._before_asking_again(deadline, exc.message)
                    continue
            # A new leader is known while the old one still holds the request (paused, cut
            # off): do not wait out the RPC timeout. A read is asked again of the new leader;
            # a mutation may or may not have reached the old one's log.
            call.cancel()
            call.add_done_callback(lambda f: f.cancelled() or f.exception())
            if method not in READ_ONLY_METHODS:
                raise MooncakedError(ErrorCode.OUTCOME_UNKNOWN,
                                     f"node {leader} stopped being the leader while it held "
                                     f"the request; it may or may not take effect")

    async def put_start(self, key: c.ObjectKey, size_bytes: int, config: ReplicateConfig,
                        upsert: bool, writer_id: int) -> list[Replica]:
        """meta put_start; on the leader itself, straight to the master (its params come
        from the daemon's own checks, not the wire)."""
        if self.raft.role == Role.LEADER:
            self.check_member()
            try:
                return await self.master.put_start_async(key, size_bytes, config, upsert,
                                                         writer_id)
            except MooncakedError as exc:
                if not self._ask_again("put_start", exc):
                    raise
        return replicas_from_wire(await self.meta(
            "put_start", [list(key), size_bytes, config_to_wire(config), upsert, writer_id]))

    async def put_end(self, key: c.ObjectKey, writer_id: int) -> None:
        """meta put_end; on the leader itself, straight to the master."""
        if self.raft.role == Role.LEADER:
            self.check_member()
            try:
                return await self.master.put_end_async(key, writer_id)
            except MooncakedError as exc:
                if not self._ask_again("put_end", exc):
                    raise
        await self.meta("put_end", [list(key), writer_id])

    async def _leader_meta(self, method: str, params: list) -> Any:
        if self.raft.role != Role.LEADER:
            raise MooncakedError(ErrorCode.NO_LEADER,
                                 f"not the leader (leader: {self.raft.leader_id or '?'})")
        # Checked before anything is proposed: what is proposed, every node applies.
        params = meta_requests.check(method, params)
        master = self.master
        if method == "put_start":
            key, size, config, upsert, writer_id = params
            replicas = await master.put_start_async(key, size, config, upsert, writer_id)
            return replicas_to_wire(replicas)
        if method == "put_end":
            key, writer_id = params
            await master.put_end_async(key, writer_id)
            return 0
        if method == "put_revoke":
            key, writer_id, hold_ms = params
            await master.put_revoke_async(key, writer_id, hold_ms)
            return 0
        if method == "read":
            versions = await master.read(params[0])
            return [version_to_wire(v) for v in versions]
        if method == "remove":
            key, force = params
            await master.remove_async(key, force)
            return 0
        if method == "remove_matching":
            namespace, pattern, force = params
            return await master.remove_matching_async(namespace, pattern, force)
        if method == "set_quota":
            namespace, max_bytes, max_objects = params
            await self.raft.read_barrier()  # None keeps the value the log has now
            await self.raft.propose(master.quota_command(namespace, max_bytes, max_objects))
            return 0
        if method == "register":
            return await self._register_node(params[0])
        if method == "return":
            node_id, generation = params
            now = master.now_ms()
            # A kept replica whose version ended meanwhile may still be under a read lease
            # granted before the node went down: freed only after one lease TTL.
            return await self.raft.propose(c.NodeReturn(node_id, generation, now,
                                                        now + master.lease_ttl_ms))
        if method == "set_store_settings":
            await self.raft.read_barrier()  # None keeps the value the log has now
            state = self.daemon.master.state
            current = dataclasses.astuple(state.store_settings())
            wanted = c.SetStoreSettings(*(now if new is None else new
                                          for now, new in zip(current, params)))
            problem = store_settings_problem(wanted)
            if problem is not None:
                raise MooncakedError(ErrorCode.INVALID_PARAMS, f"store settings: {problem}")
            await self.raft.propose(wanted)
            return dataclasses.asdict(state.store_settings())
        if method == "join":
            node_id, address = params
            conf = self.raft.core.conf_state
            if node_id in conf.voters or node_id in conf.learners:
                self.addresses[node_id] = address
                return 0
            self.addresses[node_id] = address
            await self.raft.propose_conf_change(
                ConfChange(ConfChangeKind.ADD_LEARNER, node_id, address.encode()))
            return 0
        if method == "leave":
            (node_id,) = params
            node = self.daemon.master.state.nodes.get(node_id)
            if node is not None and node.up:
                await self.raft.propose(c.NodeDown(node_id))
            return 0
        if method == "remove_member":
            (node_id,) = params
            await self.raft.propose_conf_change(ConfChange(ConfChangeKind.REMOVE, node_id))
            # A leader that removed itself has stepped down: the next one declares it down
            # (a node that is no member is, _check_liveness).
            if node_id in self.daemon.master.state.nodes and node_id != self.node_id:
                await self.raft.propose(c.NodeDown(node_id))
            return 0
        if method == "transfer_leader":
            (node_id,) = params
            self.raft.transfer_leader(node_id)
            return 0
        assert method == "drain", method  # meta_requests.check knows no other method
        (node_id,) = params
        return await self._drain(node_id)

    async def _register_node(self, commands: list) -> int:
        """A node's NodeUp, then its segments mounted under the generation the log gave that
        NodeUp (whatever generation the node's ids named); returns the generation."""
        node_up, mounts = commands[0], commands[1:]
        generation = await self.raft.propose(node_up)
        for mount in mounts:
            segment_id = c.segment_id_of(node_up.node_id, c.slot_of_segment(mount.segment_id),
                                         generation)
            try:
                await self.raft.propose(dataclasses.replace(mount, segment_id=segment_id))
            except MooncakedError as exc:
                if exc.code != ErrorCode.SEGMENT_ALREADY_EXISTS:
                    raise
        return generation

    async def _seed_store_settings(self, term: int) -> None:
        """A new cluster's first leader proposes its config's [store] settings; later leaders
        leave the log's (a differing config is logged, see _compare_store_settings)."""
        try:
            await self.raft.read_barrier()  # everything earlier leaders committed is applied
            if self.raft.role != Role.LEADER or self.raft.core.term != term \
                    or self.daemon.master.state.store_settings_from_log:
                return
            store = self.daemon.config.store
            await self.raft.propose(c.SetStoreSettings(
                store.max_objects, store.put_start_discard_timeout_ms,
                store.put_start_release_timeout_ms, store.allocation_strategy))
        except MooncakedError as exc:
            log.info("store settings from the config not proposed: %s", exc.message)

    async def _drain(self, node_id: int) -> dict:
        """Copy objects whose only replicas are on the node elsewhere, then remove the node.

        A move is conditional on the version it copied (c.MoveCommit): a key upserted or
        removed while its bytes were being copied keeps that write, and is not counted.
        """
        state = self.daemon.master.state
        moved = dropped = 0
        for key, entry in list(state.objects.items()):
            version = entry.complete
            if version is None or key[0] == c.RESERVED_NAMESPACE:
                continue
            if all(c.node_of_segment(r.segment_id) == node_id for r in version.replicas):
                try:
                    if await self._move_object(key, version, node_id):
                        moved += 1
                except MooncakedError as exc:
                    log.warning("drain: could not move %r: %s", key, exc.message)
                    dropped += 1
        await self._leader_meta("remove_member", [node_id])
        return {"moved": moved, "dropped": dropped}

    async def _move_object(self, key, version: Version, away_from: int) -> bool:
        """Copy a version's bytes off a node; False if the key changed meanwhile (the copy
        is dropped, the newer write stands)."""
        payload = await self.read_replica_bytes(version.replicas, version.size_bytes)
        state = self.daemon.master.state
        others = tuple(s.name for s in state.segment_list
                       if c.node_of_segment(s.segment_id) != away_from)
        if not others:
            raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE, "no other node has segments")
        self.put_attempts += 1
        writer_id = (self.node_id << 40) | (self.put_attempts & ((1 << 40) - 1))
        reserved_key, replicas = await self.master.move_start_async(
            key, version.size_bytes, others, writer_id)
        try:
            if any(c.node_of_segment(r.segment_id) == away_from for r in replicas):
                raise MooncakedError(ErrorCode.NO_AVAILABLE_HANDLE,
                                     "no other node has room for the value")
            await self.write_replicas(replicas, payload)
        except MooncakedError:
            await self.master.put_revoke_async(reserved_key, writer_id,
                                               2 * self.cluster_config.rpc_timeout_ms)
            raise
        return await self.master.move_commit_async(reserved_key, key, writer_id, version)

    # -- peer requests ------------------------------------------------------------------------

    async def _on_request(self, method: str, params: list, payload: bytes | None):
        if method == "meta_forward":
            if len(params) != 2 or type(params[0]) is not str or type(params[1]) is not list:
                raise MooncakedError(ErrorCode.INVALID_PARAMS, f"{method} takes [method, params]")
            # From a node that knows no leader (one joining): passed on at most once, so two
            # nodes that disagree about the leader cannot bounce a request forever.
            return await self.meta(params[0], params[1]), None
        if method == "meta":
            if len(params) not in (2, 3) or type(params[0]) is not str \
                    or type(params[1]) is not list \
                    or (len(params) == 3 and type(params[2]) is not int):
                raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                     "meta takes [method, params, from_node_id?]")
            if len(params) == 3:
                self._check_sender_is_member(params[2])
            return await self._leader_meta(params[0], params[1]), None
        if method == "write_replica":
            segment_id, offset = _int_params(params, 2, "[segment_id, offset]")
            size = len(payload) if payload is not None else 0
            # A memoryview is the segment range _payload_target handed out, which the peer
            # server has already received the bytes into; anything else is copied in.
            if type(payload) is not memoryview:
                self._local_view(segment_id, offset, size)[:] = payload or b""
            self.stats["replica_bytes_received"] += size
            return 0, None
        if method == "read_replica":
            segment_id, offset, size = _int_params(params, 3, "[segment_id, offset, size]")
            # Sent from the segment itself (the peer transport sends it read-only, no copy).
            return size, [self._local_view(segment_id, offset, size)]
        if method == "status":
            return self.status(), None
        raise MooncakedError(ErrorCode.UNKNOWN_METHOD, f"no peer method {method!r}")

    def _check_sender_is_member(self, node_id: int) -> None:
        """A leader refuses a forwarded request from a node its applied membership no longer
        lists (removed while it was cut off, or before it applied its own removal): that node
        learns it was removed from this answer. A node still joining forwards nothing until
        this leader replicates to it, which it does only once it has applied the node's
        addition."""
        if self.raft.role != Role.LEADER:
            return  # _leader_meta answers NO_LEADER
        conf = self.raft.core.conf_state
        if node_id not in conf.voters and node_id not in conf.learners:
            raise MooncakedError(ErrorCode.NOT_A_MEMBER,
                                 f"node {node_id} was removed from the cluster")

    def _payload_target(self, method: str, params: list, length: int) -> memoryview | None:
        """Where the peer server receives a request's payload: a write_replica's goes straight
        into its segment range, checked before the bytes arrive (a refusal is answered and the
        payload dropped). Other requests' payloads get a buffer of their own (None)."""
        if method != "write_replica":
            return None
        segment_id, offset = _int_params(params, 2, "[segment_id, offset]")
        return self._local_view(segment_id, offset, length)

    def _local_view(self, segment_id: int, offset: int, size: int) -> memoryview:
        """A range of one of this node's segments; refused unless the log says it is ours."""
        memory = self.daemon.own_memory(segment_id)
        # Until this run of the daemon has registered (NodeUp drops what the log says its
        # segments held), the log may still list replicas in memory that a restart emptied.
        # A segment id names the mount generation too: ids of an earlier registration (before
        # a restart, or before this node was declared down) are refused, so a late request
        # never touches memory that was handed out again since.
        current = c.segment_id_of(self.node_id, c.slot_of_segment(segment_id),
                                  self.mount_generation)
        if memory is None or self.registered_term < 0 or segment_id != current \
                or segment_id not in self.daemon.master.state.segments:
            raise MooncakedError(ErrorCode.SEGMENT_NOT_FOUND,
                                 f"segment {segment_id} is not mounted on node {self.node_id}")
        if offset < 0 or size < 0 or offset + size > memory.size_bytes:
            raise MooncakedError(ErrorCode.INVALID_PARAMS, "range outside the segment")
        return memory.slice(offset, size)

    # -- replica bytes ------------------------------------------------------------------------

    async def write_replicas(self, replicas: list[Replica], payload) -> None:
        """Write a value into every replica: own segments by memcpy, others over the network."""
        size = len(payload)
        sends = []
        remote = 0
        try:
            for replica in replicas:
                node = c.node_of_segment(replica.segment_id)
                if node == self.node_id:
                    self._local_view(replica.segment_id, replica.offset, size)[:] = payload
                else:
                    remote += 1
                    sends.extend(self._send_stripes(node, replica, payload))
        except BaseException:
            for send in sends:  # never started: nothing is sent
                send.close()
            raise
        if sends:
            results = await asyncio.gather(*sends, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise MooncakedError(ErrorCode.TRANSFER_FAIL,
                                         f"writing a replica failed: {result}")
            self.stats["replica_bytes_sent"] += size * remote

    def _send_stripes(self, node: int, replica: Replica, payload) -> list:
        stripe = self.cluster_config.stripe_bytes
        view = memoryview(payload)
        size = len(view)
        if size <= stripe:
            return [self.data_link(node).call("write_replica", [replica.segment_id,
                                                                 replica.offset], [view],
                                              timeout_s=self.rpc_timeout_s)]
        count = min(self.cluster_config.data_connections, -(-size // stripe))
        piece = -(-size // count)
        return [self.data_link(node).call("write_replica",
                                          [replica.segment_id, replica.offset + start],
                                          [view[start:start + piece]],
                                          timeout_s=self.rpc_timeout_s)
                for start in range(0, size, piece)]

    def nearest_first(self, replicas: list[Replica]) -> list[Replica]:
        """The order to read replicas in: this node's own first."""
        return sorted(replicas, key=lambda r: c.node_of_segment(r.segment_id) != self.node_id)

    async def read_replica_bytes(self, replicas: list[Replica], size: int):
        """The value from the nearest replica (own node first); the next one if a node fails."""
        last_error = None
        for replica in self.nearest_first(replicas):
            try:
                return await self.read_one_replica(replica, size)
            except MooncakedError as exc:
                last_error = exc
                if c.node_of_segment(replica.segment_id) != self.node_id:
                    self.stats["replica_read_failovers"] += 1
        raise MooncakedError(ErrorCode.TRANSFER_FAIL,
                             f"no replica could be read: {last_error.message if last_error else ''}")

    async def read_one_replica(self, replica: Replica, size: int, into: memoryview | None = None):
        """One replica's bytes: a view of this node's segment, or fetched from its node.

        With `into` (a writable buffer of `size` bytes, e.g. a get staging range) the bytes
        land there and `into` is returned. When this raises, nothing writes into `into` any
        more: every stripe's call has ended, and a stripe that timed out while receiving has
        had its connection dropped (PeerLink.call)."""
        node = c.node_of_segment(replica.segment_id)
        if node == self.node_id:
            view = self._local_view(replica.segment_id, replica.offset, size)
            if into is None:
                return view
            into[:] = view
            return into
        return await self._fetch(node, replica, size, into)

    async def _fetch(self, node: int, replica: Replica, size: int, into: memoryview | None = None):
        """One remote replica's bytes, received straight into one buffer: `into`, else a new
        one.

        Each stripe's response lands in its own slice of the buffer (call(into=...)), so
        nothing is reassembled. A new buffer per attempt: after a failed stripe the others may
        still be writing into the old one. Left uninitialised (no zero-fill pass): it is
        returned only once every stripe has been received in full. Returned read-only, so the
        client connection's transport sends it by reference instead of copying what the socket
        does not take at once.
        """
        if size == 0:
            return b"" if into is None else into
        stripe = self.cluster_config.stripe_bytes
        value = memoryview(uninitialized_bytearray(size)) if into is None else into
        count = min(self.cluster_config.data_connections, -(-size // stripe))
        piece = -(-size // count)
        parts = [value[start:start + piece] for start in range(0, size, piece)]
        offsets = range(replica.offset, replica.offset + size, piece)
        # Every stripe ends (answered, failed, timed out) before this returns or raises: a
        # caller's buffer is then no longer written into.
        answers = await asyncio.gather(*(self.data_link(node).call(
            "read_replica", [replica.segment_id, offset, len(part)],
            timeout_s=self.rpc_timeout_s, into=part) for offset, part in zip(offsets, parts)),
            return_exceptions=True)
        for answer in answers:
            if isinstance(answer, MooncakedError):
                raise answer
            if isinstance(answer, BaseException):
                raise MooncakedError(ErrorCode.TRANSFER_FAIL, f"reading a replica: {answer}")
        for part, (_, payload) in zip(parts, answers):
            if payload is not part:  # the peer sent another length (or none): not our bytes
                raise MooncakedError(ErrorCode.TRANSFER_FAIL, "short replica read")
        return value.toreadonly() if into is None else into

    # -- reports ------------------------------------------------------------------------------

    def status(self) -> dict:
        raft = self.raft.status()
        # msgpack map keys on the wire are strings (clients unpack with strict_map_key).
        raft["progress"] = {str(k): v for k, v in raft.get("progress", {}).items()}
        state = self.daemon.master.state
        return {
            "node_id": self.node_id, "peer_address": self.peer_address,
            "leader": self.raft.leader_id,
            "role": "removed" if self.removed else self.raft.role.name.lower(),
            "term": raft.get("term"), "commit": raft.get("commit"),
            "applied": raft.get("applied"), "last_index": raft.get("last_index"),
            "voters": list(self.raft.core.conf_state.voters),
            "learners": list(self.raft.core.conf_state.learners),
            "registered": self.registered_term >= 0, "removed": self.removed,
            "mount_generation": self.mount_generation,
            "store_settings": {**dataclasses.asdict(state.store_settings()),
                               "from_log": state.store_settings_from_log},
            "nodes": [{"node_id": n.node_id, "name": n.name, "up": n.up,
                       "client_address": n.client_address, "peer_address": n.peer_address,
                       "segments": sum(1 for s in state.segments
                                       if c.node_of_segment(s) == n.node_id),
                       "kept_replicas": state.kept_replicas(n.node_id)}
                      for n in state.nodes.values()],
            "raft": raft, "repair": self.repair.status(), **self.stats}
