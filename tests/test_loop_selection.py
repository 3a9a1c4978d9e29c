"""Which event loop the daemon runs on: `[server] loop`, $MOONCAKED_LOOP, and the fallback.

Method: start the real daemon with each setting and read `status()["loop"]`; check the
selection function's fallback when io_uring is reported unusable.
"""

from __future__ import annotations

import os

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


def test_auto_falls_back_when_io_uring_is_unusable(monkeypatch, no_loop_env):
    monkeypatch.setattr(uring, "usable", lambda: (False, "io_uring_setup: EPERM (test)"))
    factory, reason = loops.choose_loop("auto")
    assert "EPERM (test)" in reason and reason.startswith("asyncio")
    loop = factory()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
    with pytest.raises(RuntimeError, match="EPERM"):
        loops.choose_loop("uring")


def test_unknown_loop_name_is_refused(no_loop_env):
    with pytest.raises(ValueError, match="unknown event loop"):
        loops.choose_loop("libuv")
    os.environ[loops.ENV_VAR] = "nope"
    try:
        with pytest.raises(ValueError, match=loops.ENV_VAR):
            loops.choose_loop("auto")
    finally:
        del os.environ[loops.ENV_VAR]
