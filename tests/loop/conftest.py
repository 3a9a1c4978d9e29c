"""The event-loop suite runs every test on both loops: ours (io_uring) and stdlib asyncio's.

asyncio is the oracle, as uvloop's suite uses it: a test that passes there and fails on the
io_uring loop is a bug in ours. The "uring" run is skipped, with the reason, only where
`mooncaked.io.uring.usable()` says the kernel or process does not allow io_uring.

Each test gets a fresh loop whose exception handler records calls; a test that did not
expect any fails if one happened (uvloop's habit). Tests never assert durations; timeouts
only keep a broken loop from hanging the run.
"""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.io import uring

@pytest.fixture(params=["uring", "asyncio"])
def loop_factory(request):
    if request.param == "uring":
        ok, reason = uring.usable()
        if not ok:
            pytest.skip(f"io_uring loop not usable here: {reason}")
        return uring.new_event_loop
    return asyncio.new_event_loop


@pytest.fixture
def loop(loop_factory):
    loop = loop_factory()
    loop.handler_calls = []
    loop.set_exception_handler(lambda _loop, context: loop.handler_calls.append(context))
    asyncio.set_event_loop(loop)
    try:
        yield loop
        assert not loop.handler_calls, f"unexpected exception handler calls: {loop.handler_calls}"
    finally:
        try:
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            asyncio.set_event_loop(None)

