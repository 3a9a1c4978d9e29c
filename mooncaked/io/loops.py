"""Which event loop to run: the io_uring loop, or stdlib asyncio's.

    factory, reason = choose_loop(config_value)   # "auto" | "uring" | "asyncio"
    loop = factory()

`auto` takes the io_uring loop when `uring.usable()` says it can run here and falls back to
asyncio otherwise. The environment variable MOONCAKED_LOOP, when set, overrides the name
passed in (it is how tests and operators force one loop). The reason is for the log.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Callable

LOOP_NAMES = ("auto", "uring", "asyncio")
ENV_VAR = "MOONCAKED_LOOP"


def choose_loop(name: str = "auto", busy_poll_us: int = 0
                ) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """(loop factory, reason). Raises ValueError for an unknown name, RuntimeError when
    "uring" is asked for and cannot run here. `busy_poll_us` is passed to the io_uring loop
    (0: its own default, $MOONCAKED_URING_BUSY_POLL_US or none)."""
    source = "configured"
    env = os.environ.get(ENV_VAR)
    if env:
        name, source = env.strip().lower(), f"${ENV_VAR}"
    if name not in LOOP_NAMES:
        raise ValueError(f"unknown event loop {name!r} ({source}); "
                         f"expected one of {', '.join(LOOP_NAMES)}")
    if name == "asyncio":
        return asyncio.new_event_loop, f"asyncio ({source})"
    try:
        from mooncaked.io import uring
    except ImportError as exc:  # the extension was built without the loop
        ok, why = False, f"mooncaked._native has no io_uring loop: {exc}"
    else:
        ok, why = uring.usable()
    if ok:
        if busy_poll_us:
            return (functools.partial(uring.new_event_loop, busy_poll_us),
                    f"uring: {why}, busy poll {busy_poll_us} us ({source})")
        return uring.new_event_loop, f"uring: {why} ({source})"
    if name == "uring":
        raise RuntimeError(f"the io_uring loop was asked for ({source}) but cannot run: {why}")
    return asyncio.new_event_loop, f"asyncio: io_uring unusable: {why}"
