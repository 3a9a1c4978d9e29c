"""One seed's cluster shape and fault mix, drawn swarm-style: every seed picks which faults it
turns on and how hard, so a few hundred seeds cover calm runs, single-fault runs and storms.

Times are virtual milliseconds. The Raft timing is the daemon's default scaled down tenfold
(tick 10 ms instead of 100 ms, the same tick counts), and so are the store's timeouts, so
that a few virtual seconds hold many elections, expiries and lease ends.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

# Fixes for bugs this simulation found in the daemon's cluster logic (cluster/service.py,
# cluster/master.py, daemon/cluster_handlers.py), applied to the sim's copy of that logic. On by
# default, so the seeds test the other code (Raft core, state machine) against the daemon as it
# should be; `fixes=()` (--daemon-as-is) runs the daemon's logic as it is.
FIXES = (
    # A replica request names the memory generation the sender's log shows for the node (the
    # NodeUp of its current registration) and the node refuses another. The daemon checks only
    # that the segment is mounted in its own applied state, so a restarted node serves its
    # fresh memory for segments its replayed log still lists.
    "replica_generation",
    # A read re-checks after its read barrier that no command that may end the key's version
    # (PutEnd of an upsert, Remove, Evict) was proposed meanwhile. The daemon's
    # ReplicatedMaster.read leases the version anyway, and the command frees it at a deadline
    # that did not count that lease (an Evict at once).
    "lease_after_barrier",
    # A writer id per put attempt (hardening). With the daemon's id per connection, a PutEnd or
    # PutRevoke of an earlier attempt that timed out but reaches the log after the next put's
    # PutStart applies to that put's version: it publishes it before its bytes are written, or
    # frees it while they are. The sim's requests are not FIFO, so it sees this whenever a
    # revoke times out; the daemon only across a reconnect of its link to the leader.
    "writer_per_put",
    # A node registers again when the log undoes its registration while that registration is
    # in flight (a NodeDown) or after it (a NodeUp of an earlier, dead incarnation committed
    # late). The daemon's service forgets a NodeDown that comes while it registers and cannot
    # tell a stale NodeUp, and stays without segments until it restarts.
    "reregister",
)

MUTANTS = (
    "ack_before_sync",  # the disk reports a sync done but only writes back later
    "vote_not_persisted",  # a vote is granted without its hard state reaching the disk
)


@dataclass
class Params:
    seed: int
    # cluster
    voters: int = 3
    learner: bool = False  # a node joins later as a learner, then is promoted
    read_mode: str = "safe"
    tick_ms: int = 10
    election_ticks: int = 10
    heartbeat_ticks: int = 1
    # network
    drop: float = 0.0
    duplicate: float = 0.0
    delay_min_ms: float = 0.5
    delay_mean_ms: float = 2.0
    partition_every_ms: float = 0.0  # mean gap between partitions; 0 = never
    partition_ms: float = 0.0  # mean partition length
    # processes, clocks, disks
    crash_every_ms: float = 0.0
    down_ms: float = 0.0  # mean time a crashed node stays down
    pause_every_ms: float = 0.0
    crash_after_vote: float = 0.0  # chance that a node crashes right after granting a vote
    outage_every_ms: float = 0.0  # every node crashes at once (a power cut) and comes back
    drift: float = 0.0  # each node's tick rate is off by up to this fraction
    fsync_ms: float = 0.0  # mean time a sync takes (the node keeps serving meanwhile)
    snapshot_entries: int = 0  # compact the log every so many applied entries; 0 = never
    transfer_every_ms: float = 0.0  # leadership transfers
    # store
    lease_ttl_ms: int = 1000
    discard_timeout_ms: int = 1000
    release_timeout_ms: int = 3000
    node_ttl_ms: int = 500
    segment_kib: int = 64  # one segment per node
    max_value_bytes: int = 8192
    fixes: tuple[str, ...] = FIXES  # see FIXES above
    rpc_timeout_ms: int = 500
    # workload
    clients: int = 3
    ops: int = 100
    keys: int = 4
    replicas: int = 2
    max_safety_ms: int = 30_000  # the safety phase ends here even if ops are left
    mutant: str | None = None

    @property
    def election_ms(self) -> int:
        return self.tick_ms * self.election_ticks

    def describe(self) -> str:
        """The parameters that differ from the defaults (plus the cluster and workload size)."""
        default = Params(self.seed)
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name) or f.name in ("seed", "voters", "clients", "ops"):
                parts.append(f"{f.name}={round(value, 3) if isinstance(value, float) else value}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def draw(seed: int, rng: random.Random, **overrides) -> Params:
    """Draw a seed's parameters from `rng`; `overrides` (CLI options, tests) win."""
    p = Params(seed)

    def sometimes(probability: float) -> bool:
        return rng.random() < probability

    p.voters = rng.choice((3, 3, 5))
    p.learner = sometimes(0.3)
    p.read_mode = rng.choice(("safe", "lease"))  # lease is the daemon's default
    if sometimes(0.6):
        p.drop = rng.uniform(0.0, 0.3)
    if sometimes(0.5):
        p.duplicate = rng.uniform(0.0, 0.5)
    # One-way delays up to a fifth of the election timeout in the safety phase (congestion);
    # the liveness phase caps them (see Network.calm).
    p.delay_min_ms = rng.uniform(0.0, 5.0)
    p.delay_mean_ms = p.delay_min_ms + rng.uniform(0.5, 20.0)
    if sometimes(0.5):
        p.partition_every_ms = rng.uniform(300.0, 3000.0)
        p.partition_ms = rng.uniform(50.0, 1500.0)
    if sometimes(0.5):
        p.crash_every_ms = rng.uniform(200.0, 3000.0)
        p.down_ms = rng.uniform(10.0, 1000.0)
    if sometimes(0.5):
        p.crash_after_vote = rng.uniform(0.2, 1.0)
    if sometimes(0.3):
        p.outage_every_ms = rng.uniform(500.0, 3000.0)
    if sometimes(0.4):
        p.pause_every_ms = rng.uniform(200.0, 3000.0)
    if sometimes(0.5):
        p.drift = rng.uniform(0.0, 0.01)
    if sometimes(0.5):
        p.fsync_ms = rng.uniform(0.0, 3.0)
    if sometimes(0.5):
        p.snapshot_entries = rng.randint(10, 80)
    if sometimes(0.3):
        p.transfer_every_ms = rng.uniform(300.0, 3000.0)
    p.segment_kib = rng.choice((16, 32, 64, 256))
    p.clients = rng.randint(1, 8)
    p.keys = rng.randint(1, 6)
    p.replicas = rng.randint(1, 3)
    for name, value in overrides.items():
        if value is not None:
            setattr(p, name, value)
    return p
