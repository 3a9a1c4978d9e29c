"""sd_notify: datagrams to $NOTIFY_SOCKET, abstract addresses, and never blocking the loop.

Method: a datagram socket the test owns plays systemd's part.
"""

from __future__ import annotations

import logging
import os
import socket

from mooncaked.daemon.sdnotify import Notifier


def test_sends_key_value_lines(tmp_path):
    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    notifier = Notifier(path)
    assert notifier.notify(READY="1", STATUS="serving") is True
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"
    notifier.close()
    receiver.close()


def test_abstract_namespace_address():
    name = f"mooncaked-test-{os.getpid()}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + name)
    notifier = Notifier("@" + name)
    assert notifier.notify(STOPPING="1")
    assert receiver.recv(4096) == b"STOPPING=1"
    notifier.close()
    receiver.close()


def test_disabled_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert notifier.enabled is False and notifier.notify(READY="1") is False


def test_a_reader_that_stops_reading_never_blocks(tmp_path):
    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    notifier = Notifier(path)
    results = [notifier.notify(STATUS="x" * 1000) for _ in range(5000)]
    assert results[0] is True and results[-1] is False  # the queue filled; no call blocked
    notifier.close()
    receiver.close()


def test_a_missing_receiver_is_logged_once(tmp_path, caplog):
    notifier = Notifier(str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.WARNING):
        assert notifier.notify(STATUS="a") is False
        assert notifier.notify(STATUS="b") is False
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1
    notifier.close()
