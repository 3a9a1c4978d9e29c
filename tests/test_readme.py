"""Tests of README.md: its Python snippets run as written, and the commands it names exist.

Every ```python block of the README is run, as its own `python -c` process, against a real
daemon the test starts (a fresh one per block). The snippets name the default addresses
(`unix:/run/mooncaked/mooncaked.sock`, `127.0.0.1:50051`); the test replaces exactly those
literals with its daemon's Unix socket and TCP address, and nothing else (MOONCAKED_ADDRESS is
unset, so the Mooncake facade also uses the address written in the snippet). A block must
exit 0 (the snippets state their results as asserts) and leave objects in the daemon, which
`mooncakectl objects ls` then lists: the README's own walk-through. A block meant only to be
read must use another fence than ```python.

The quick-start command names files that exist and a configuration that passes
--check-config; every tools/ and tests/ path the README names exists; and every option of
`python -m mooncaked.sim --help` has a description.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from mooncaked.client.blocking import BlockingClient

README = os.path.join(REPO, "README.md")
UNIX_LITERAL = "unix:/run/mooncaked/mooncaked.sock"
TCP_LITERAL = "127.0.0.1:50051"
QUICK_START = "bash tools/install.sh && .venv/bin/mooncaked --config mooncaked.toml"


def readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", readme(), re.MULTILINE | re.DOTALL)


def block_id(block: str) -> str:
    """The block's first statement that is not an import, for the test id."""
    lines = [line for line in block.splitlines()
             if line.strip() and not line.startswith(("import ", "from ", "#"))]
    return lines[0][:40] if lines else "empty"


def env_without_address() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MOONCAKED_ADDRESS", "NOTIFY_SOCKET")}
    env["PYTHONPATH"] = REPO
    return env


BLOCKS = python_blocks()


def test_readme_has_the_client_and_mooncake_snippets():
    assert len(BLOCKS) >= 3
    text = "\n".join(BLOCKS)
    for name in ("BlockingClient.connect", "Client.connect", "MooncakeDistributedStore"):
        assert name in text


@pytest.mark.parametrize("block", BLOCKS, ids=[block_id(b) for b in BLOCKS])
def test_snippet_runs_as_written_against_a_daemon(make_daemon, tmp_path, block):
    # Each snippet talks to the daemon through a literal the test replaces; one that named
    # another address would not reach this daemon.
    assert UNIX_LITERAL in block or TCP_LITERAL in block, "the snippet names no daemon address"
    daemon = make_daemon()
    source = block.replace(UNIX_LITERAL, daemon.unix_address).replace(TCP_LITERAL,
                                                                       daemon.tcp_address)
    done = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env_without_address(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    # It stored something here, and `mooncakectl objects ls` (no options) lists all of it,
    # whatever namespace the snippet chose.
    with BlockingClient.connect(daemon.tcp_address, map_segments=False) as client:
        stored = client.status()["objects"]
    assert stored > 0
    listed = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", daemon.tcp_address,
                             "-o", "json", "objects", "ls"], cwd=REPO, env=env_without_address(),
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == stored


def test_blocking_snippet_objects_are_listed_in_its_namespace(make_daemon, tmp_path):
    # The walk-through: the first snippet puts into llama-3-8b, then `objects ls`.
    block = next(b for b in BLOCKS if "BlockingClient.connect" in b)
    daemon = make_daemon()
    done = subprocess.run([sys.executable, "-c", block.replace(UNIX_LITERAL, daemon.unix_address)],
                          cwd=tmp_path, env=env_without_address(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    listed = subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", daemon.tcp_address,
                             "-o", "json", "objects", "ls"], cwd=REPO, env=env_without_address(),
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert [(o["namespace"], o["key"], o["size_bytes"]) for o in json.loads(listed.stdout)] == [
        ("llama-3-8b", "blk:1", 65536), ("llama-3-8b", "prefix:abc", len(b"...kv bytes..."))]


def test_quick_start_command_names_what_exists():
    assert QUICK_START in readme()
    assert os.path.isfile(os.path.join(REPO, "tools", "install.sh"))
    venv_daemon = os.path.join(REPO, ".venv", "bin", "mooncaked")
    if not os.access(venv_daemon, os.X_OK):
        pytest.skip(".venv/bin/mooncaked is missing (bash tools/install.sh makes it)")
    env = env_without_address()
    env.pop("MOONCAKED_LOOP", None)
    done = subprocess.run([venv_daemon, "--config", "mooncaked.toml", "--check-config"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["server"]["tcp_port"] == 50051


def test_every_tools_and_tests_path_named_exists():
    named = set(re.findall(r"\b((?:tools|tests)/[\w./-]*\w)", readme()))
    assert "tools/cluster/start.sh" in named
    written_by_runs = {"tools/bench/results"}  # the benchmark's output directory
    missing = sorted(p for p in named - written_by_runs
                     if not os.path.exists(os.path.join(REPO, p)))
    assert missing == []


def test_every_simulator_option_is_described():
    done = subprocess.run([sys.executable, "-m", "mooncaked.sim", "--help"], cwd=REPO,
                          env=env_without_address(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("options:", 1)[1]
    # argparse prints "  --name [METAVAR]  description" or the description on the next line.
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    assert len(entries) >= 13
    for entry in entries:
        words = entry.split()
        described = [w for w in words if not w.startswith(("-", "{", "[")) and w.isalpha()
                     and w.islower()]
        assert described, f"no description: {entry!r}"
