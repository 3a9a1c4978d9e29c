"""Tests of the systemd unit, tools/systemd/mooncaked.service.

- `systemd-analyze verify` accepts it with no warning about the unit. The unit's ExecStart
  (/usr/local/bin/mooncaked) need not exist here, and verify rejects a missing binary, so a
  copy whose ExecStart runs `<this python> -m mooncaked` is verified; a copy with a misspelt
  key checks that such warnings are caught. Skipped only where systemd-analyze is absent.
- The settings the daemon relies on are there: Type=notify, NotifyAccess=main,
  LimitMEMLOCK=infinity, the runtime directory of the default Unix socket, a stop timeout
  above the default shutdown grace, and hardening that leaves /dev/shm writable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from mooncaked.config import ServerConfig, SegmentsConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(REPO, "tools", "systemd", "mooncaked.service")
EXEC_START = "/usr/local/bin/mooncaked --config /etc/mooncaked/mooncaked.toml"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (CI installs systemd)")


def unit_text() -> str:
    with open(UNIT, encoding="utf-8") as f:
        return f.read()


def settings(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}}; comments and blank lines skipped."""
    parsed: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            parsed.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        parsed[section].setdefault(key.strip(), []).append(value.strip())
    return parsed


def service() -> dict[str, list[str]]:
    return settings(unit_text())["Service"]


def seconds(value: str) -> float:
    """A systemd time span such as 10, 10s, 1min 30s, 1500ms, in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def verify(tmp_path, text: str) -> subprocess.CompletedProcess:
    """Write `text` as mooncaked.service in tmp_path and run systemd-analyze verify on it."""
    path = tmp_path / "mooncaked.service"
    path.write_text(text)
    command = [SYSTEMD_ANALYZE, "verify"]
    help_text = subprocess.run([SYSTEMD_ANALYZE, "--help"], capture_output=True,
                               text=True).stdout
    if "--man" in help_text:
        command.append("--man=no")
    return subprocess.run(command + [str(path)], capture_output=True, text=True, timeout=120)


def runnable_copy() -> str:
    """The unit with ExecStart running this interpreter's mooncaked (verify needs a binary)."""
    text = unit_text()
    original = f"ExecStart={EXEC_START}\n"
    assert original in text
    return text.replace(original, f"ExecStart={sys.executable} -m mooncaked --config "
                                  "/etc/mooncaked/mooncaked.toml\n")


def unit_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "mooncaked.service" in line]


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    result = verify(tmp_path, runnable_copy())
    assert result.returncode == 0, result.stderr
    assert unit_warnings(result.stderr) == []


@needs_systemd_analyze
def test_verify_reports_a_misspelt_key(tmp_path):
    text = runnable_copy().replace("NotifyAccess=main", "NotifyAcess=main")
    result = verify(tmp_path, text)
    assert any("NotifyAcess" in line for line in unit_warnings(result.stderr)), result.stderr


def test_exec_start_runs_the_installed_daemon_on_the_etc_config():
    assert service()["ExecStart"] == [EXEC_START]


def test_notify_type_and_access():
    unit = service()
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]


def test_limits():
    unit = service()
    assert unit["LimitMEMLOCK"] == ["infinity"]
    assert unit["LimitNOFILE"] == ["65536"]


def test_runtime_directory_holds_the_default_unix_socket():
    unit = service()
    assert unit["RuntimeDirectory"] == ["mooncaked"]
    socket_dir = os.path.dirname(ServerConfig().unix_socket)
    assert socket_dir == "/run/" + unit["RuntimeDirectory"][0]


def test_stop_signal_and_timeout_cover_the_shutdown_grace():
    unit = service()
    assert unit["KillSignal"] == ["SIGTERM"]
    assert unit["Restart"] == ["on-failure"]
    grace_s = ServerConfig().shutdown_grace_ms / 1000
    assert seconds(unit["TimeoutStopSec"][0]) > grace_s


def test_hardening_leaves_shared_memory_and_runtime_dir_writable():
    unit = service()
    assert unit["ProtectSystem"] == ["strict"]
    writable = " ".join(unit["ReadWritePaths"]).split()
    assert SegmentsConfig().shm_dir in writable
    assert os.path.dirname(ServerConfig().unix_socket) in writable
    assert unit["NoNewPrivileges"] == ["yes"]
    assert unit["PrivateTmp"] == ["yes"]
    assert unit["ProtectHome"] == ["yes"]
    assert "PrivateDevices" not in unit or unit["PrivateDevices"] == ["no"]


def test_unit_and_install_sections():
    parsed = settings(unit_text())
    assert "network.target" in " ".join(parsed["Unit"]["After"]).split()
    assert parsed["Install"]["WantedBy"] == ["multi-user.target"]
