#!/usr/bin/env bash
# Installs what mooncaked needs on Debian 12 (run as root): Debian packages, a virtual
# environment in .venv with the Python dependencies, and the Cython extension built in place.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
    python3 python3-venv python3-dev gcc   # the interpreter and the extension's compiler
    liburing-dev libnuma-dev               # headers of the native core
    libmsgpack-dev                         # the C client used by the wire tests
    systemd                                # systemd-analyze, to check the unit file
    nftables                               # nft, for the partitions of the cluster fault tests
)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${missing[@]}"
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
echo "mooncaked installed in $(pwd)/.venv"
