"""The io_uring event loop, as an asyncio event loop.

    loop = mooncaked.io.uring.new_event_loop()

`UringEventLoop` is the Cython `UringLoop` (mooncaked/_native, built from _native/loop/)
mixed with `asyncio.AbstractEventLoop`, as uvloop does, so `isinstance(loop,
asyncio.AbstractEventLoop)` holds and the methods it leaves out (TLS, UDP, subprocesses,
sendfile) raise NotImplementedError. `usable()` says whether this kernel and process allow it.

What it adds to asyncio's interface: `set_busy_poll(microseconds)` (spin before sleeping; off
unless asked for, see its docstring) and, in mooncaked._native, `set_zerocopy_threshold(n)`
(SEND_ZC for TCP sends of n bytes or more; off: on loopback it does not pay).
"""

from __future__ import annotations

import asyncio
import functools
import os

from mooncaked import _native

__all__ = ["UringEventLoop", "new_event_loop", "usable"]


class UringEventLoop(_native.UringLoop, asyncio.AbstractEventLoop):
    """asyncio's event loop interface over one io_uring instance."""


BUSY_POLL_ENV = "MOONCAKED_URING_BUSY_POLL_US"


def new_event_loop(busy_poll_us: float | None = None) -> UringEventLoop:
    """A new loop; busy_poll_us (default: $MOONCAKED_URING_BUSY_POLL_US, else 0) is how long
    it polls for completions before sleeping (see UringEventLoop.set_busy_poll)."""
    loop = UringEventLoop()
    if busy_poll_us is None:
        busy_poll_us = float(os.environ.get(BUSY_POLL_ENV) or 0)
    if busy_poll_us:
        loop.set_busy_poll(busy_poll_us)
    return loop


@functools.lru_cache(maxsize=1)
def usable() -> tuple[bool, str]:
    """(True, description) if the io_uring loop can run here, else (False, why not).

    It sets up a ring as the loop does and runs one request through it, so whatever stops
    io_uring (sysctl kernel.io_uring_disabled, a seccomp filter, an old kernel, memlock)
    shows up here rather than at the first connection.
    """
    disabled = _sysctl_io_uring_disabled()
    if disabled == 2:
        return False, "io_uring is disabled by sysctl kernel.io_uring_disabled=2"
    ok, reason = _native.uring_probe()
    if not ok and disabled == 1:
        reason += " (sysctl kernel.io_uring_disabled=1 allows only kernel.io_uring_group)"
    return ok, reason


def _sysctl_io_uring_disabled() -> int:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):  # older kernels have no such knob
        return 0
