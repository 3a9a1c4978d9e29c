"""The simulated network: every message gets a random delay (which also reorders them), and
may be dropped, duplicated or blocked by a partition.

Raft messages between nodes get all the faults. Requests between clients and nodes, and replica
bytes, model a TCP connection: they can be lost (the connection breaks, the caller times out)
and delayed, but not duplicated. Partitions cut node-to-node links only; clients stand for the
processes that reach the cluster from outside it.
"""

from __future__ import annotations

import random
from typing import Callable

from mooncaked.sim.events import MS, Scheduler


class Network:
    def __init__(self, scheduler: Scheduler, rng: random.Random, params,
                 deliver: Callable[[int, int, object], None]) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.drop = params.drop
        self.duplicate = params.duplicate
        self.delay_min_ns = int(params.delay_min_ms * MS)
        self.delay_extra_mean_ns = max(1.0, (params.delay_mean_ms - params.delay_min_ms) * MS)
        self.replay_ms = 2 * params.election_ms
        self._deliver = deliver
        self.blocked: set[tuple[int, int]] = set()  # directed (from, to) node pairs cut off
        self.faults = True  # off in the liveness phase
        self.sent = self.dropped = self.duplicated = 0

    def _delay(self) -> int:
        return self.delay_min_ns + int(self.rng.expovariate(1.0 / self.delay_extra_mean_ns))

    def send_raft(self, src: int, dst: int, message) -> bool:
        """Send; False when the link is cut (the daemon's send fails on a broken connection and
        reports the peer unreachable), True otherwise, even if the message is lost on the way."""
        self.sent += 1
        if self.faults:
            if (src, dst) in self.blocked:
                self.dropped += 1
                return False
            if self.rng.random() < self.drop:
                self.dropped += 1
                return True
            if self.rng.random() < self.duplicate:
                # A replayed copy: it may come much later than the original (a stale packet).
                self.duplicated += 1
                replay = int(self.rng.uniform(0, self.replay_ms) * MS)
                self.scheduler.after(self._delay() + replay, self._deliver, dst, src, message)
        self.scheduler.after(self._delay(), self._deliver, dst, src, message)
        return True

    def send_rpc(self, src: int, dst: int, payload) -> None:
        self.sent += 1
        if self.faults and (self.rng.random() < self.drop / 2 or (src, dst) in self.blocked):
            self.dropped += 1
            return
        self.scheduler.after(self._delay(), self._deliver, dst, src, payload)

    # -- partitions ---------------------------------------------------------------------------

    def partition(self, side: list[int], others: list[int], one_way: bool) -> None:
        """Cut `side` off from `others`: both directions, or only messages leaving `side`."""
        for a in side:
            for b in others:
                self.blocked.add((a, b))
                if not one_way:
                    self.blocked.add((b, a))

    def heal(self) -> None:
        self.blocked.clear()

    def calm(self, params) -> None:
        """The liveness phase: no faults, and delays at most a LAN's (mean 5% of the election
        timeout), so that convergence within 10 election timeouts measures the protocol and
        not a congested network."""
        self.faults = False
        self.heal()
        cap_ns = params.election_ms * MS / 20
        self.delay_min_ns = min(self.delay_min_ns, int(cap_ns / 2))
        self.delay_extra_mean_ns = min(self.delay_extra_mean_ns, cap_ns / 2)
