"""compat/install.sh: the `mooncake` compatibility package goes into a fresh venv, where
`mooncake.store` is mooncaked's facade; and the script refuses an environment with the real
Mooncake in it, leaving that environment as it was.

The venvs are made without pip (fast); install.sh then uses python3's pip with --python, and
python3 is this test's interpreter. mooncaked reaches them through a .pth file that adds this
interpreter's site-packages, where it is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap

from conftest import REPO

INSTALL = os.path.join(REPO, "compat", "install.sh")


def make_venv(path: str, with_mooncaked: bool = True) -> tuple[str, str]:
    """A venv without pip; returns its interpreter and site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    if with_mooncaked:
        # addsitedir also runs that directory's .pth files (mooncaked's editable install).
        with open(os.path.join(site_packages, "with-mooncaked.pth"), "w") as f:
            f.write(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    return python, site_packages


def install(python: str) -> subprocess.CompletedProcess:
    # python3 on PATH is this interpreter: its pip serves the venv that has none.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(["bash", INSTALL, python], env=env, capture_output=True, text=True,
                          timeout=300)


def run_in(python: str, code: str) -> str:
    return subprocess.run([python, "-c", textwrap.dedent(code)], check=True, cwd="/",
                          capture_output=True, text=True).stdout


def test_install_gives_mooncake_store_backed_by_mooncaked(tmp_path):
    python, site_packages = make_venv(str(tmp_path / "venv"))
    result = install(python)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.path.exists(os.path.join(site_packages, "mooncake", "store.py"))
    out = run_in(python, """
        import importlib.metadata
        import mooncake.store, mooncaked.mooncake_store as facade
        assert mooncake.store.MooncakeDistributedStore is facade.MooncakeDistributedStore
        assert mooncake.store.ReplicateConfig is facade.ReplicateConfig
        assert sorted(mooncake.store.__all__) == sorted(facade.__all__)
        assert all(getattr(mooncake.store, name) is getattr(facade, name)
                   for name in facade.__all__)
        import mooncake.engine, mooncaked.transfer_engine as engine
        assert mooncake.engine.TransferEngine is engine.TransferEngine
        assert sorted(mooncake.engine.__all__) == ["TransferEngine", "TransferNotify",
                                                   "TransferOpcode"]
        print(mooncake.store.__file__)
        print(importlib.metadata.version("mooncaked-mooncake-compat"))
    """).split()
    assert out[0].startswith(site_packages)  # the installed copy, not the source tree
    assert out[1] == "0.1.0"


def test_install_again_replaces_its_own_package(tmp_path):
    python, _ = make_venv(str(tmp_path / "venv"))
    assert install(python).returncode == 0
    second = install(python)
    assert second.returncode == 0, second.stdout + second.stderr


def test_refuses_when_a_real_mooncake_distribution_is_installed(tmp_path):
    python, site_packages = make_venv(str(tmp_path / "venv"))
    # What pip leaves for Mooncake's wheel (it ships the package `mooncake` too).
    dist_info = os.path.join(site_packages, "mooncake_transfer_engine_non_cuda-0.3.13.dist-info")
    os.makedirs(dist_info)
    with open(os.path.join(dist_info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: mooncake-transfer-engine-non-cuda\n"
                "Version: 0.3.13\n")
    result = install(python)
    assert result.returncode == 3
    assert "real Mooncake is installed (mooncake-transfer-engine-non-cuda)" in result.stderr
    assert "separate environment" in result.stderr  # how to proceed
    assert not os.path.exists(os.path.join(site_packages, "mooncake"))


def test_refuses_when_another_mooncake_package_is_importable(tmp_path):
    python, site_packages = make_venv(str(tmp_path / "venv"))
    package = os.path.join(site_packages, "mooncake")
    os.makedirs(package)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write('"""Mooncake public Python package."""\n')
    result = install(python)
    assert result.returncode == 3
    assert "a `mooncake` package that is not mooncaked's is importable" in result.stderr
    with open(os.path.join(package, "__init__.py")) as f:
        assert f.read() == '"""Mooncake public Python package."""\n'  # left alone
    assert not os.path.exists(os.path.join(package, "store.py"))


def test_refuses_without_mooncaked(tmp_path):
    python, site_packages = make_venv(str(tmp_path / "venv"), with_mooncaked=False)
    result = install(python)
    assert result.returncode == 4
    assert "mooncaked is not installed" in result.stderr
    assert not os.path.exists(os.path.join(site_packages, "mooncake"))

