"""vLLM (CPU build), unmodified, with its MooncakeStoreConnector on mooncaked: the connector
imports `mooncake.store` from mooncaked's compatibility package (compat/) and stores each full
block of KV in a real daemon started here; a later generation of the same prompt loads it.

Needs the environment of tools/engines/vllm_env.sh (vLLM, the compat package); skipped without
it. The engine runs as a subprocess with that environment's interpreter and this checkout's
mooncaked first on PYTHONPATH, so the code under test is the checkout's, not the copy installed
when the environment was made.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import pytest

from conftest import REPO, DaemonProcess
from mooncaked import BlockingClient

VENV_PYTHON = os.path.join(REPO, "tools", "engines", ".venv-vllm", "bin", "python")
ENGINES = os.path.join(REPO, "tools", "engines")
BLOCK_SIZE = 32  # vllm_kv_roundtrip.py's; the CPU attention backend needs a multiple of 32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(VENV_PYTHON),
                       reason="no vLLM environment: run `bash tools/engines/vllm_env.sh`"),
]


def run_engine(model: str, address: str, phase: str, *options: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    process = subprocess.run(
        [VENV_PYTHON, os.path.join(ENGINES, "vllm_kv_roundtrip.py"), "--model", model,
         "--master-server-address", address, "--phase", phase, *options],
        cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in process.stdout.splitlines() if line.startswith('{"phase"')]
    assert process.returncode == 0 and lines, (
        f"vllm_kv_roundtrip.py --phase {phase} exited with {process.returncode}\n"
        f"stdout:\n{process.stdout[-6000:]}\nstderr:\n{process.stderr[-6000:]}")
    return json.loads(lines[-1])


def full_blocks(prompt_tokens: int) -> int:
    """Tokens in the blocks vLLM can take from a cache: full blocks, short of the last token
    (which it always computes)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def stored_objects(address: str) -> list[dict]:
    # The connector's store uses namespace "default" (tenant_id unset).
    with BlockingClient.connect(address, namespace="default") as client:
        return client.objects_list(namespace="default")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    subprocess.run([VENV_PYTHON, os.path.join(ENGINES, "tiny_model.py"), directory],
                   check=True, capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory(prefix="mooncaked-vllm-") as workdir:
        process = DaemonProcess(workdir)
        try:
            yield process.start()
        finally:
            process.close()


@pytest.fixture(scope="module")
def first_process(model, daemon) -> tuple[dict, list[dict]]:
    """One vLLM process over the Unix socket: generate, clear vLLM's own prefix cache,
    generate again. Returns its results and the daemon's objects once it has exited."""
    result = run_engine(model, daemon.unix_address, "roundtrip")
    return result, stored_objects(daemon.unix_address)


def test_vllm_imports_mooncaked_through_the_compat_package(first_process):
    result, _ = first_process
    assert result["store_class"] == "mooncaked.mooncake_store.MooncakeDistributedStore"


def test_one_process_loads_its_kv_back_from_the_store(first_process):
    result, _ = first_process
    first, second = result["runs"]
    assert result["reset_prefix_cache"] is True  # so the second run's hits are the store's
    assert first["num_cached_tokens"] == 0
    assert first["prompt_tokens"] > 2 * BLOCK_SIZE
    assert second["num_cached_tokens"] == full_blocks(first["prompt_tokens"])
    assert second["output_token_ids"] == first["output_token_ids"]
    assert len(first["output_token_ids"]) == 16


def test_the_daemon_holds_one_object_per_full_block(first_process, model):
    result, objects = first_process
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # Per block: K and V of every layer, BLOCK_SIZE tokens x KV heads x head_dim, in bf16.
    block_bytes = (config["num_hidden_layers"] * 2 * BLOCK_SIZE
                   * config["num_key_value_heads"] * head_dim * 2)
    blocks = full_blocks(result["runs"][0]["prompt_tokens"]) // BLOCK_SIZE
    assert len(objects) == blocks
    assert all(o["state"] == "complete" and o["size_bytes"] == block_bytes for o in objects)
    assert all(os.path.basename(model) in o["key"] for o in objects)  # keys name the model


def test_a_second_process_loads_the_kv_the_first_stored(first_process, model, daemon):
    """The first process has exited: the KV comes from the daemon, here over TCP. At its end
    the second process resets the connector, which empties the store (remove_all)."""
    first_result, _ = first_process
    result = run_engine(model, daemon.tcp_address, "once", "--reset-connector")
    (run,) = result["runs"]
    first = first_result["runs"][0]
    assert run["prompt_tokens"] == first["prompt_tokens"]
    assert run["num_cached_tokens"] == full_blocks(first["prompt_tokens"])
    assert run["output_token_ids"] == first["output_token_ids"]
    assert result["reset_connector"] is True
    assert stored_objects(daemon.tcp_address) == []
