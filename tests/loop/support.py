"""Helpers shared by the event-loop tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio

from mooncaked.io import uring

TIMEOUT_S = 60.0  # only so a broken loop fails the test instead of hanging the suite


def run(loop, coro, timeout: float = TIMEOUT_S):
    """Run coro to completion on loop; a hang becomes a TimeoutError, not a stuck suite."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def is_uring(loop) -> bool:
    return isinstance(loop, uring.UringEventLoop)
