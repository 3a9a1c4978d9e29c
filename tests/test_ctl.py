"""Tests of mooncakectl (mooncaked/ctl.py), run as `python -m mooncaked.ctl` against a real daemon.

Objects are put with BlockingClient in two namespaces (`objects ls` lists both unless told
one), then each command is checked over TCP and the Unix socket: its JSON output against what the daemon reports, its table output for the
header row and the data, and its exit codes (0 ok, 1 error, 2 usage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest

import mooncaked
from conftest import REPO, free_port
from mooncaked import config as config_module
from mooncaked.client.blocking import BlockingClient

DEFAULT_VALUES = {"alpha/1": b"a" * 100, "alpha/2": b"b" * 200, "beta/1": b"c" * 300}
OTHER_NAMESPACE = "other"
OTHER_VALUES = {"gamma/1": b"d" * 50}


def ctl(*args: str, env_address: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKED_ADDRESS"}
    env["PYTHONPATH"] = REPO
    if env_address is not None:
        env["MOONCAKED_ADDRESS"] = env_address
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def ctl_json(address: str, *args: str):
    done = ctl("-a", address, "-o", "json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def ctl_table(address: str, *args: str) -> list[list[str]]:
    """The table's lines, each split into its cells (header first)."""
    done = ctl("-a", address, *args)
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines()]


@pytest.fixture
def stocked(daemon):
    with BlockingClient.connect(daemon.tcp_address) as client:
        for key, value in DEFAULT_VALUES.items():
            assert client.put(key, value) is True
    with BlockingClient.connect(daemon.tcp_address, namespace=OTHER_NAMESPACE) as client:
        for key, value in OTHER_VALUES.items():
            assert client.put(key, value) is True
    return daemon


@pytest.fixture(params=["tcp", "unix"])
def address(request, stocked) -> str:
    return stocked.tcp_address if request.param == "tcp" else stocked.unix_address


def keys_of(listing: list[dict]) -> list[str]:
    return [o["key"] for o in listing]


# -- status and segments ------------------------------------------------------------------------

def test_status_json(address):
    status = ctl_json(address, "status")
    assert status["node_name"] == "test-node"
    assert status["objects"] == len(DEFAULT_VALUES) + len(OTHER_VALUES)
    assert status["used_bytes"] > 0
    assert status["capacity_bytes"] == 64 << 20


def test_status_table(address):
    rows = ctl_table(address, "status")
    assert rows[0] == ["FIELD", "VALUE"]
    assert ["node_name", "test-node"] in rows
    assert ["objects", str(len(DEFAULT_VALUES) + len(OTHER_VALUES))] in rows
    assert ["capacity_bytes", "64.0", "MiB"] in rows


def test_segments_json_matches_segment_report(stocked, address):
    with BlockingClient.connect(stocked.tcp_address) as client:
        report = client.segment_report()
    segments = ctl_json(address, "segments")
    assert len(segments) == 1
    assert segments[0]["used_bytes"] > 0
    assert segments[0]["used_bytes"] == report[0]["used_bytes"]
    assert segments[0]["size_bytes"] == 64 << 20
    assert segments[0]["name"] == "test-node/0"


def test_segments_table(address):
    rows = ctl_table(address, "segments")
    assert rows[0][:4] == ["ID", "NAME", "SIZE", "USED"]
    assert rows[1][:4] == ["0", "test-node/0", "64.0", "MiB"]
    assert len(rows) == 2


# -- objects ls ---------------------------------------------------------------------------------

ALL_OBJECTS = sorted([("default", k) for k in DEFAULT_VALUES] +
                     [(OTHER_NAMESPACE, k) for k in OTHER_VALUES])


def pairs_of(listing: list[dict]) -> list[tuple[str, str]]:
    return [(o["namespace"], o["key"]) for o in listing]


def test_ls_lists_exactly_the_keys_put_in_every_namespace(address):
    # The README puts into its own namespace and then runs `objects ls`: it must see them.
    listing = ctl_json(address, "objects", "ls")
    assert pairs_of(listing) == ALL_OBJECTS
    values = {"default": DEFAULT_VALUES, OTHER_NAMESPACE: OTHER_VALUES}
    for obj in listing:
        assert obj["size_bytes"] == len(values[obj["namespace"]][obj["key"]])
        assert obj["state"] == "complete"


def test_ls_prefix_and_regex_filter(address):
    assert keys_of(ctl_json(address, "objects", "ls", "--prefix", "alpha/")) == \
        ["alpha/1", "alpha/2"]
    assert keys_of(ctl_json(address, "objects", "ls", "--regex", "1$")) == \
        ["alpha/1", "beta/1", "gamma/1"]
    assert keys_of(ctl_json(address, "objects", "ls", "--prefix", "alpha/",
                            "--regex", "^beta")) == []


def test_ls_namespace_option_restricts_to_one(address):
    only_default = ctl_json(address, "objects", "ls", "--namespace", "default")
    assert pairs_of(only_default) == [("default", k) for k in sorted(DEFAULT_VALUES)]
    only_other = ctl_json(address, "objects", "ls", "--namespace", OTHER_NAMESPACE)
    assert pairs_of(only_other) == [(OTHER_NAMESPACE, k) for k in sorted(OTHER_VALUES)]
    assert ctl_json(address, "objects", "ls", "--namespace", "nobody") == []
    # An explicit -n restricts too; --all-namespaces (the old flag) still lists everything.
    assert pairs_of(ctl_json(address, "-n", OTHER_NAMESPACE, "objects", "ls")) == \
        [(OTHER_NAMESPACE, k) for k in sorted(OTHER_VALUES)]
    assert pairs_of(ctl_json(address, "objects", "ls", "--all-namespaces")) == ALL_OBJECTS
    assert pairs_of(ctl_json(address, "objects", "ls", "--namespace", "*")) == ALL_OBJECTS


def test_ls_limit(address):
    done = ctl("-a", address, "-o", "json", "objects", "ls", "--limit", "2")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 2
    assert "--limit 2" in done.stderr


def test_ls_table(address):
    rows = ctl_table(address, "objects", "ls")
    assert rows[0][:4] == ["NAMESPACE", "KEY", "SIZE", "STATE"]
    assert [row[:5] for row in rows[1:]] == [
        ["default", "alpha/1", "100", "B", "complete"],
        ["default", "alpha/2", "200", "B", "complete"],
        ["default", "beta/1", "300", "B", "complete"],
        [OTHER_NAMESPACE, "gamma/1", "50", "B", "complete"]]


# -- objects stat -------------------------------------------------------------------------------

def test_stat(address):
    obj = ctl_json(address, "objects", "stat", "alpha/2")
    assert obj["key"] == "alpha/2"
    assert obj["namespace"] == "default"
    assert obj["size_bytes"] == 200
    assert obj["state"] == "complete"
    assert len(obj["replicas"]) == 1
    other = ctl_json(address, "-n", OTHER_NAMESPACE, "objects", "stat", "gamma/1")
    assert (other["namespace"], other["size_bytes"]) == (OTHER_NAMESPACE, 50)


def test_stat_table(address):
    rows = ctl_table(address, "objects", "stat", "beta/1")
    assert rows[0] == ["FIELD", "VALUE"]
    assert ["key", "beta/1"] in rows
    assert ["size_bytes", "300", "B"] in rows
    assert ["state", "complete"] in rows


def test_stat_of_missing_key_exits_1(address):
    done = ctl("-a", address, "objects", "stat", "no-such-key")
    assert done.returncode == 1
    assert done.stderr.startswith("mooncakectl: OBJECT_NOT_FOUND (-704): ")
    assert done.stdout == ""
    # Namespaces are separate: the other namespace's key is not found from the default one.
    done = ctl("-a", address, "objects", "stat", "gamma/1")
    assert done.returncode == 1
    assert "OBJECT_NOT_FOUND (-704)" in done.stderr


# -- objects rm ---------------------------------------------------------------------------------

def test_rm_of_leased_key_needs_force(stocked, address):
    with BlockingClient.connect(stocked.tcp_address) as client:
        assert client.get("alpha/1") == DEFAULT_VALUES["alpha/1"]  # a read lease (10 s)
    done = ctl("-a", address, "objects", "rm", "alpha/1")
    assert done.returncode == 1
    assert done.stderr.startswith("mooncakectl: OBJECT_HAS_LEASE (-706): ")
    # The message says how to remove it now.
    assert "`objects rm alpha/1 --force` removes it anyway" in done.stderr
    assert "alpha/1" in keys_of(ctl_json(address, "objects", "ls"))

    removed = ctl_json(address, "objects", "rm", "alpha/1", "--force")
    assert removed == {"namespace": "default", "key": "alpha/1", "removed": True}
    assert keys_of(ctl_json(address, "objects", "ls", "--namespace", "default")) == \
        ["alpha/2", "beta/1"]
    with BlockingClient.connect(stocked.tcp_address) as client:
        assert client.exists("alpha/1") is False


def test_rm_without_lease_and_of_missing_key(address):
    done = ctl("-a", address, "objects", "rm", "beta/1")
    assert done.returncode == 0, done.stderr
    assert "beta/1" in done.stdout
    assert keys_of(ctl_json(address, "objects", "ls", "--namespace", "default")) == \
        ["alpha/1", "alpha/2"]
    done = ctl("-a", address, "objects", "rm", "beta/1")
    assert done.returncode == 1
    assert "OBJECT_NOT_FOUND (-704)" in done.stderr
    assert "--force" not in done.stderr  # the hint is for leases only


def test_rm_stays_in_its_namespace(address):
    done = ctl("-a", address, "objects", "rm", "gamma/1")
    assert done.returncode == 1
    assert keys_of(ctl_json(address, "-n", OTHER_NAMESPACE, "objects", "ls")) == ["gamma/1"]


# -- config show --------------------------------------------------------------------------------

def test_config_show_json_equals_daemon_config(stocked, address):
    shown = ctl_json(address, "config", "show")
    assert shown == config_module.load(stocked.config_path).as_dict()
    assert shown["segments"]["size_bytes"] == 64 << 20
    assert shown["node"]["name"] == "test-node"
    assert shown["segments"]["shm_mode"] == "0o600"


def test_config_show_table(address):
    rows = ctl_table(address, "config", "show")
    assert rows[0] == ["SECTION", "KEY", "VALUE"]
    assert ["segments", "size_bytes", "64.0", "MiB"] in rows
    assert ["node", "name", "test-node"] in rows
    # Octal, as mooncaked.toml writes it and as `mooncaked --check-config` prints it.
    assert ["segments", "shm_mode", "0o600"] in rows


# -- addresses and exit codes -------------------------------------------------------------------

def test_address_from_environment(stocked):
    done = ctl("-o", "json", "status", env_address=stocked.tcp_address)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["node_name"] == "test-node"
    # A bare absolute path is a Unix socket.
    assert ctl_json(stocked.unix_socket, "status")["node_name"] == "test-node"


@pytest.mark.parametrize("args", [
    ["frobnicate"],                          # unknown subcommand
    ["objects", "frobnicate"],
    ["objects", "stat"],                     # missing argument
    ["objects", "rm"],
    ["-o", "yaml", "status"],                # bad -o value
    ["status", "--no-such-option"],
    ["objects", "ls", "--limit", "0"],
    ["objects", "ls", "--namespace", "a", "--all-namespaces"],
    ["-a", "no-port-here", "status"],        # an address that is none of the three forms
])
def test_usage_errors_exit_2(args):
    dead = f"127.0.0.1:{free_port()}"
    done = ctl("-a", dead, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "cannot connect" not in done.stderr


def test_version_is_the_package_version():
    done = ctl("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"mooncakectl {mooncaked.__version__}\n"
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == mooncaked.__version__


def test_dead_tcp_address_exits_1():
    dead = f"127.0.0.1:{free_port()}"
    done = ctl("-a", dead, "status")
    assert done.returncode == 1
    assert done.stderr.startswith(f"mooncakectl: cannot connect to {dead}: ")
    assert done.stdout == ""


def test_dead_unix_address_exits_1(tmp_path):
    dead = f"unix:{tmp_path / 'nobody.sock'}"
    done = ctl("-a", dead, "-o", "json", "objects", "ls")
    assert done.returncode == 1
    assert done.stderr.startswith(f"mooncakectl: cannot connect to {dead}: ")
