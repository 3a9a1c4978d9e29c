"""Tests of the systemd unit, tools/systemd/mooncaked.service, as `tools/install.sh --system`
installs it (tools/systemd/install-system.sh).

- The install, run into a temporary root (`--root`), writes the unit, the configuration (only
  if absent) and /usr/local/bin wrappers that run this checkout's .venv entry points.
- `systemd-analyze verify --root ROOT mooncaked.service` accepts the unit installed there with
  no warning about it: the unit exactly as shipped, its ExecStart (/usr/local/bin/mooncaked)
  resolved inside that root, so a missing binary fails it (checked), as does a misspelt key.
  The root gets a copy of the host's system units (network.target, ...) the unit refers to.
  No systemd runs as PID 1 here, so `systemctl start` cannot be tested; verify can. Skipped
  only where systemd-analyze is absent, or .venv is (the wrappers need its entry points).
- The settings the daemon relies on are there: Type=notify, NotifyAccess=main,
  LimitMEMLOCK=infinity, the runtime directory of the default Unix socket, the state directory
  of the default cluster data_dir, a stop timeout above the default shutdown grace, and
  hardening that leaves /dev/shm writable and a checkout under /root or /home readable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import mooncaked
from mooncaked.config import ClusterConfig, ServerConfig, SegmentsConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(REPO, "tools", "systemd", "mooncaked.service")
INSTALL_SYSTEM = os.path.join(REPO, "tools", "systemd", "install-system.sh")
VENV_BIN = os.path.join(os.path.realpath(REPO), ".venv", "bin")
EXEC_START = "/usr/local/bin/mooncaked --config /etc/mooncaked/mooncaked.toml"
HOST_UNITS = "/usr/lib/systemd/system"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (CI installs systemd)")
needs_venv = pytest.mark.skipif(
    not os.access(os.path.join(VENV_BIN, "mooncaked"), os.X_OK),
    reason=".venv/bin/mooncaked is missing (bash tools/install.sh makes it)")


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


def install_system(root) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", INSTALL_SYSTEM, "--root", str(root)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def installed(tmp_path):
    """A root with mooncaked installed by install-system.sh, plus the host's system units."""
    root = tmp_path / "root"
    result = install_system(root)
    assert result.returncode == 0, result.stderr
    shutil.copytree(HOST_UNITS, root / HOST_UNITS.lstrip("/"), symlinks=True)
    # The unit's ExecReload runs the system's kill, which a real root has.
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2("/bin/kill", root / "bin" / "kill")
    return root


def verify(root) -> subprocess.CompletedProcess:
    """systemd-analyze verify of mooncaked.service as installed under `root`."""
    command = [SYSTEMD_ANALYZE, "verify", f"--root={root}"]
    help_text = subprocess.run([SYSTEMD_ANALYZE, "--help"], capture_output=True,
                               text=True).stdout
    if "--man" in help_text:
        command.append("--man=no")
    return subprocess.run(command + ["mooncaked.service"], capture_output=True, text=True,
                          timeout=120, cwd=root)


def unit_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "mooncaked.service" in line]


@needs_systemd_analyze
@needs_venv
def test_systemd_analyze_verify_accepts_the_installed_unit(installed):
    result = verify(installed)
    assert result.returncode == 0, result.stderr
    assert unit_warnings(result.stderr) == []


@needs_systemd_analyze
@needs_venv
def test_verify_fails_without_the_installed_binary(installed):
    # What a unit copied without `install.sh --system` met: ExecStart names nothing.
    os.unlink(installed / "usr/local/bin/mooncaked")
    result = verify(installed)
    assert result.returncode != 0
    assert any("/usr/local/bin/mooncaked" in line for line in unit_warnings(result.stderr)), \
        result.stderr


@needs_systemd_analyze
@needs_venv
def test_verify_reports_a_misspelt_key(installed):
    path = installed / "etc/systemd/system/mooncaked.service"
    path.write_text(path.read_text().replace("NotifyAccess=main", "NotifyAcess=main"))
    result = verify(installed)
    assert any("NotifyAcess" in line for line in unit_warnings(result.stderr)), result.stderr


@needs_venv
def test_install_writes_the_unit_config_and_wrappers_of_the_venv(installed):
    assert (installed / "etc/systemd/system/mooncaked.service").read_text() == unit_text()
    with open(os.path.join(REPO, "mooncaked.toml")) as f:
        assert (installed / "etc/mooncaked/mooncaked.toml").read_text() == f.read()
    for tool in ("mooncaked", "mooncakectl"):
        wrapper = installed / "usr/local/bin" / tool
        assert os.access(wrapper, os.X_OK)
        # It runs the venv's entry point (by exec: the PID systemd watches stays the daemon's).
        assert f"exec '{VENV_BIN}/{tool}' \"$@\"" in wrapper.read_text()
        done = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{tool} {mooncaked.__version__}"


@needs_venv
def test_install_keeps_an_existing_config(installed):
    config = installed / "etc/mooncaked/mooncaked.toml"
    config.write_text("[segments]\ncount = 2\n")
    result = install_system(installed)
    assert result.returncode == 0, result.stderr
    assert config.read_text() == "[segments]\ncount = 2\n"
    assert "kept" in result.stdout


def test_install_sh_documents_its_flags_and_refuses_unknown_ones():
    done = subprocess.run(["bash", os.path.join(REPO, "tools", "install.sh"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--system", "--root", "--mooncake-compat"):
        assert flag in done.stdout
    # Flags are parsed before anything is installed: a bad one changes nothing.
    for args in (["--bogus"], ["--root", "/nowhere"]):
        done = subprocess.run(["bash", os.path.join(REPO, "tools", "install.sh"), *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)


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


def test_state_directory_holds_the_default_cluster_data_dir():
    # ProtectSystem=strict makes /var/lib read-only; StateDirectory= makes this one writable.
    unit = service()
    assert unit["StateDirectory"] == ["mooncaked"]
    assert ClusterConfig().data_dir == "/var/lib/" + unit["StateDirectory"][0]


def test_hardening_leaves_shared_memory_and_runtime_dir_writable():
    unit = service()
    assert unit["ProtectSystem"] == ["strict"]
    writable = " ".join(unit["ReadWritePaths"]).split()
    assert SegmentsConfig().shm_dir in writable
    assert os.path.dirname(ServerConfig().unix_socket) in writable
    assert unit["NoNewPrivileges"] == ["yes"]
    assert unit["PrivateTmp"] == ["yes"]
    # Not "yes": that hides /root and /home, where the checkout's .venv often is.
    assert unit["ProtectHome"] == ["read-only"]
    assert "PrivateDevices" not in unit or unit["PrivateDevices"] == ["no"]


def test_unit_and_install_sections():
    parsed = settings(unit_text())
    assert "network.target" in " ".join(parsed["Unit"]["After"]).split()
    assert parsed["Install"]["WantedBy"] == ["multi-user.target"]
