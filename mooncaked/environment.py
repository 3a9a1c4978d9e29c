"""The clock and the randomness a node reads.

A daemon reads the time and draws random numbers through this module, never through `time`
or `os.urandom` directly: a process that runs one daemon gets the system's; the simulator
(mooncaked/sim/), which runs several daemons in one process on a virtual-time event loop, gives
each node its own (a virtual clock that may drift, a generator drawn from the seed) by setting
`current` in the context the node's callbacks run in.
"""

from __future__ import annotations

import contextvars
import os
import time


class SystemEnvironment:
    """What a daemon process gets: the system's monotonic clock and entropy."""

    def monotonic(self) -> float:
        return time.monotonic()

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def random_bytes(self, count: int) -> bytes:
        return os.urandom(count)

    def log_store_options(self) -> dict:
        """Extra keyword arguments for the node's Raft LogStore (none: the real disk)."""
        return {}


SYSTEM = SystemEnvironment()

current: contextvars.ContextVar = contextvars.ContextVar("mooncaked_environment",
                                                         default=SYSTEM)


def monotonic() -> float:
    return current.get().monotonic()


def monotonic_ns() -> int:
    return current.get().monotonic_ns()


def random_bytes(count: int) -> bytes:
    return current.get().random_bytes(count)


def log_store_options() -> dict:
    return current.get().log_store_options()
