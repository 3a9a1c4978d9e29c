"""A client written in C with msgpack-c speaks the protocol to a real daemon.

Goal: wire/PROTOCOL.md is enough to write a working client in another language with another
msgpack implementation (interoperability, not just agreement of the project with itself).

Method: compile tests/c_client/client.c with gcc against Debian's libmsgpack-dev
(`-lmsgpackc`) into a temp directory, run it against the real daemon's TCP port, and check its
exit status and its exact output lines (hello, put, get with a byte comparison, a missing key's
-704, exists false, an unknown method's -3002). Then read the value the C client stored from
Python and compare it byte for byte. Skipped only when gcc or msgpack.h is absent (CI installs
both).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import mooncaked

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "c_client", "client.c")
RUN_TIMEOUT_S = 60  # a bound on a hung client, never an assertion on speed


def expected_value(size: int) -> bytes:
    """The value client.c puts: byte i is (i * 131 + 7) mod 256."""
    return bytes((i * 131 + 7) & 0xFF for i in range(size))


@pytest.fixture(scope="module")
def c_client(tmp_path_factory) -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (CI installs it)")
    probe = subprocess.run([gcc, "-E", "-x", "c", "-"], input="#include <msgpack.h>\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("msgpack.h is not installed (Debian: libmsgpack-dev; CI installs it)")
    binary = str(tmp_path_factory.mktemp("c_client") / "client")
    build = subprocess.run(
        [gcc, "-std=c11", "-O2", "-Wall", "-Wextra", "-o", binary, SOURCE,
         "-lmsgpackc"], capture_output=True, text=True)
    assert build.returncode == 0, f"client.c does not build:\n{build.stderr}"
    return binary


@pytest.mark.parametrize("size", [1, 5, 100_000, 3 << 20])
def test_c_client_against_daemon(daemon, c_client, size):
    key = f"c-client/value-{size}"
    run = subprocess.run([c_client, "127.0.0.1", str(daemon.tcp_port), key, str(size)],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.stderr == ""
    assert run.stdout.splitlines() == [
        "hello ok protocol 1",
        "put ok",
        f"get ok {size} bytes",
        "miss -704",
        "exists false",
        "unknown -3002",
    ]
    with mooncaked.BlockingClient.connect(daemon.tcp_address) as client:
        assert client.get(key) == expected_value(size)
    with mooncaked.BlockingClient.connect(daemon.unix_address) as client:
        assert client.get(key) == expected_value(size)


def test_c_client_reports_a_mismatch(daemon, c_client):
    """The C client fails when the daemon's answer is not what it expects: its put of a key
    that already exists gets false, and it must exit non-zero."""
    key = "c-client/taken"
    with mooncaked.BlockingClient.connect(daemon.tcp_address) as client:
        assert client.put(key, b"already here") is True
    run = subprocess.run([c_client, "127.0.0.1", str(daemon.tcp_port), key, "10"],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 1
    assert run.stdout.splitlines() == ["hello ok protocol 1"]
    assert run.stderr.startswith("FAIL: put: expected true")
    with mooncaked.BlockingClient.connect(daemon.tcp_address) as client:
        assert client.get(key) == b"already here"  # write-once: unchanged
