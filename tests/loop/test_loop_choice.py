"""Choosing the event loop: choose_loop("auto" | "uring" | "asyncio"), MOONCAKED_LOOP, usable()."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.io import loops, uring


def test_usable_gives_a_reason():
    ok, reason = uring.usable()
    assert isinstance(ok, bool) and reason


def test_asyncio_by_name(monkeypatch):
    monkeypatch.delenv(loops.ENV_VAR, raising=False)
    factory, reason = loops.choose_loop("asyncio")
    assert factory is asyncio.new_event_loop and reason.startswith("asyncio")


def test_auto_takes_uring_where_usable(monkeypatch):
    monkeypatch.delenv(loops.ENV_VAR, raising=False)
    factory, reason = loops.choose_loop("auto")
    ok, why = uring.usable()
    if ok:
        assert factory is uring.new_event_loop and why in reason
    else:
        assert factory is asyncio.new_event_loop and why in reason


def test_auto_falls_back_when_uring_is_unusable(monkeypatch):
    monkeypatch.delenv(loops.ENV_VAR, raising=False)
    monkeypatch.setattr(uring, "usable", lambda: (False, "io_uring is disabled by sysctl"))
    factory, reason = loops.choose_loop("auto")
    assert factory is asyncio.new_event_loop and "disabled by sysctl" in reason
    with pytest.raises(RuntimeError, match="disabled by sysctl"):
        loops.choose_loop("uring")


def test_environment_overrides_the_configured_name(monkeypatch):
    monkeypatch.setenv(loops.ENV_VAR, "asyncio")
    factory, reason = loops.choose_loop("uring")
    assert factory is asyncio.new_event_loop and loops.ENV_VAR in reason


def test_unknown_names_are_refused(monkeypatch):
    monkeypatch.delenv(loops.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="epoll"):
        loops.choose_loop("epoll")
    monkeypatch.setenv(loops.ENV_VAR, "libuv")
    with pytest.raises(ValueError, match=loops.ENV_VAR):
        loops.choose_loop("auto")
