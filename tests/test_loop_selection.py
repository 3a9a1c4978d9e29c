"""Which event loop the daemon runs on: `[server] loop` and $MOONCAKED_LOOP.

Method: start the real daemon with each setting and read `status()["loop"]`. The selection
function itself (fallback, bad names) is tested in tests/loop/test_loop_choice.py.
"""

from __future__ import annotations

import pytest

from mooncaked import BlockingClient
from mooncaked.io import loops, uring

uring_usable, why_not = uring.usable()
needs_uring = pytest.mark.skipif(not uring_usable, reason=f"io_uring unusable here: {why_not}")


def loop_of(daemon) -> tuple[str, str]:
    with BlockingClient.connect(daemon.unix_address) as client:
        status = client.status()
    return status["loop"], status["loop_reason"]


@pytest.fixture
def no_loop_env(monkeypatch):
    monkeypatch.delenv(loops.ENV_VAR, raising=False)


def test_asyncio_when_configured(make_daemon, no_loop_env):
    assert loop_of(make_daemon(server={"loop": "asyncio"}))[0] == "asyncio"


@needs_uring
def test_uring_by_default_where_usable(make_daemon, no_loop_env):
    name, reason = loop_of(make_daemon())
    assert name == "uring" and "uring" in reason


@needs_uring
def test_environment_overrides_the_config(make_daemon, monkeypatch):
    monkeypatch.setenv(loops.ENV_VAR, "asyncio")
    name, reason = loop_of(make_daemon(server={"loop": "uring"}))
    assert name == "asyncio" and loops.ENV_VAR in reason


@needs_uring
def test_busy_poll_is_configured_on_the_uring_loop(make_daemon, no_loop_env):
    daemon = make_daemon(server={"busy_poll_us": 50})
    name, reason = loop_of(daemon)
    assert name == "uring" and "busy poll 50 us" in reason
    with BlockingClient.connect(daemon.tcp_address) as client:
        assert client.put("k", b"v") and client.get("k") == b"v"
