"""Set-up for the benchmark: Debian packages, the bench venv, and the project's extension.

Three interpreters/environments are involved:
- the project's Python (the one running run.py, `sys.executable`): it has mooncaked; the
  mooncaked daemon and the mooncaked client workers run under it;
- the bench venv (`tools/bench/.venv`, git-ignored): Mooncake's PyPI wheel, redis-py with
  hiredis (its C reply parser), numpy, matplotlib; the Mooncake and Redis workers, the memcpy
  probe and the chart run under it;
- Debian's redis-server (and libibverbs1, which the Mooncake wheel links against), and fio
  (the ssd section's measure of the device).

Everything here is idempotent: a second run only checks.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(HERE, ".venv")

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
MOONCAKE_VERSION = "0.3.13.post1"  # the version research/anchors-perf.md measured
VENV_PACKAGES = ["redis", "hiredis", "numpy", "matplotlib"]
APT_PACKAGES = ["redis-server", "libibverbs1", "fio"]
VENV_CHECK = "import mooncake.store, redis, hiredis, numpy, matplotlib"


def _run(argv: list[str], log, **kw) -> int:
    log(f"$ {' '.join(argv)}")
    return subprocess.run(argv, **kw).returncode


def _dpkg_installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                         capture_output=True, text=True)
    return out.returncode == 0 and "install ok installed" in out.stdout


def ensure_apt(log) -> None:
    """apt-get install the Debian packages that are missing (apt-get update only on failure)."""
    missing = [p for p in APT_PACKAGES if not _dpkg_installed(p)]
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    argv = ["apt-get", "install", "-y", "-q", *missing]
    if _run(argv, log, env=env, stdout=subprocess.DEVNULL) != 0:
        _run(["apt-get", "update", "-q"], log, env=env, stdout=subprocess.DEVNULL)
        if _run(argv, log, env=env, stdout=subprocess.DEVNULL) != 0:
            raise SystemExit(f"bench: could not apt-get install {' '.join(missing)}")


def venv_python() -> str:
    return os.path.join(VENV, "bin", "python")


def ensure_venv(log) -> str:
    """Create tools/bench/.venv and install Mooncake, redis-py, numpy, matplotlib into it."""
    py = venv_python()
    if not os.path.exists(py):
        # The venv is made by the project's interpreter: the same Python version on both sides.
        if _run([sys.executable, "-m", "venv", VENV], log) != 0:
            raise SystemExit("bench: could not create the venv (apt-get install python3-venv?)")
    if subprocess.run([py, "-c", VENV_CHECK], capture_output=True).returncode == 0:
        return py
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pinned = f"{MOONCAKE_PACKAGE}=={MOONCAKE_VERSION}"
    if _run(pip + [pinned, *VENV_PACKAGES], log) != 0:
        log(f"bench: {pinned} is not installable here; trying the newest {MOONCAKE_PACKAGE}")
        if _run(pip + [MOONCAKE_PACKAGE, *VENV_PACKAGES], log) != 0:
            raise SystemExit("bench: pip install into the bench venv failed")
    check = subprocess.run([py, "-c", VENV_CHECK], capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"bench: the bench venv cannot import its packages:\n{check.stderr}")
    return py


def ensure_project(log, src: str = REPO) -> None:
    """The project's Python must import mooncaked (from `src`) and its Cython extension. The
    extension is built in place only when it is missing: a present but broken one is reported,
    not rebuilt (someone may be in the middle of changing it)."""
    probe = [sys.executable, "-c", "import mooncaked._native, mooncaked.client.blocking"]
    env = dict(os.environ, PYTHONPATH=src)
    built = glob.glob(os.path.join(src, "mooncaked", "_native*.so"))
    if not built:
        _run([sys.executable, "setup.py", "build_ext", "--inplace"], log, cwd=src,
             stdout=subprocess.DEVNULL)
    check = subprocess.run(probe, cwd=src, env=env, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(
            f"bench: this Python ({sys.executable}) cannot import mooncaked from {src}.\n"
            "Run it with the project's interpreter (e.g. .venv/bin/python after "
            "tools/install.sh), rebuild the extension (python setup.py build_ext --inplace), or "
            "measure another checkout with --src DIR.\n" + check.stderr.strip().splitlines()[-1])


def ensure_all(log, src: str = REPO) -> str:
    """Everything the run needs; returns the bench venv's python."""
    ensure_apt(log)
    ensure_project(log, src)
    return ensure_venv(log)


if __name__ == "__main__":
    print(ensure_all(print))
