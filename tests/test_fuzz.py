"""The coverage-guided fuzzers (tools/fuzz/) on a fixed budget: zero findings.

Each target (client protocol, peer protocol, config loader) runs for a fixed number of inputs
with a fixed libFuzzer seed, from the committed seed corpus, in a subprocess (atheris
instruments the imported modules; that must not leak into this process). A finding (an
exception, a hang past the per-input timeout, memory past the RSS limit) makes libFuzzer exit
non-zero and write the input; the failure message says how to replay it.

Every seed is also replayed without instrumentation; the seeds include the inputs of fixed
findings (`regression-*`), so each stays fixed.

`tools/fuzz/run.py TARGET --seconds N` runs longer (tools/fuzz/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

try:
    import atheris  # noqa: F401
except ImportError:
    atheris = None

RUN = os.path.join(REPO, "tools", "fuzz", "run.py")
CORPUS = os.path.join(REPO, "tools", "fuzz", "corpus")
# About 15-25 s each on an idle core (twice that on a busy 2-core machine); --seconds caps
# a much slower one.
BUDGETS = {"client": 25_000, "peer": 10_000, "config": 30_000}
CAP_SECONDS = 240

needs_atheris = pytest.mark.skipif(atheris is None, reason="atheris is not installed "
                                   "(pip install -e '.[test]' installs it)")


def _run(*args: str, env: dict | None = None, timeout: int = CAP_SECONDS + 120):
    environment = dict(os.environ, PYTHONPATH=REPO)
    environment.update(env or {})
    return subprocess.run([sys.executable, RUN, *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)


@needs_atheris
@pytest.mark.parametrize("target", sorted(BUDGETS))
def test_fuzz_target_finds_nothing(target, tmp_path):
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    done = _run(target, "--runs", str(BUDGETS[target]), "--seconds", str(CAP_SECONDS),
                "--seed", "1", "--corpus", str(corpus), "--artifacts", str(artifacts))
    found = sorted(os.listdir(artifacts)) if artifacts.exists() else []
    findings = [name for name in found if not name.endswith(".dict")]
    assert done.returncode == 0 and not findings, (
        f"fuzz target {target} found something (exit {done.returncode}); inputs {findings} "
        f"in {artifacts}; replay one with: tools/fuzz/run.py {target} --replay FILE\n"
        + done.stdout[-3000:] + done.stderr[-6000:])
    assert "Done" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("target", sorted(BUDGETS))
def test_every_seed_replays_clean(target):
    directory = os.path.join(CORPUS, target)
    seeds = sorted(os.path.join(directory, name) for name in os.listdir(directory))
    assert seeds, f"no seeds in {directory}"
    done = _run(target, "--replay", *seeds, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
