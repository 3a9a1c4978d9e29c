#!/usr/bin/env bash
# Installs what mooncaked needs on Debian 12 (run as root): Debian packages, a virtual
# environment in .venv with the Python dependencies, and the Cython extension built in place.
#
#   bash tools/install.sh                    # the above; then run .venv/bin/mooncaked
#   bash tools/install.sh --system           # also install it for systemd (below)
#   bash tools/install.sh --mooncake-compat  # also run compat/install.sh with .venv's python
#                                            # (the Mooncake compatibility extras, compat/)
#
# --system runs tools/systemd/install-system.sh: /usr/local/bin/mooncaked and mooncakectl
# (wrappers that exec .venv/bin/*), /etc/systemd/system/mooncaked.service, and
# /etc/mooncaked/mooncaked.toml if absent; then `systemctl enable --now mooncaked`. The
# service runs this checkout's .venv, so the checkout must stay where it is, and not under
# /tmp or /var/tmp (the unit's PrivateTmp hides them). --root DIR (with --system) installs
# those files under DIR instead of /.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
system=0
root=/
compat=0
while [ $# -gt 0 ]; do
    case "$1" in
        --system) system=1; shift ;;
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        --mooncake-compat) compat=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
if [ "$root" != / ] && [ "$system" = 0 ]; then
    echo "install.sh: --root goes with --system" >&2
    exit 2
fi

packages=(
    python3 python3-venv python3-dev gcc   # the interpreter and the extension's compiler
    liburing-dev libnuma-dev               # headers of the native core
    libmsgpack-dev                         # the C client used by the wire tests
    systemd                                # systemd-analyze, to check the unit file
    nftables                               # nft, for the partitions of the cluster fault tests
    openssl                                # makes the certificates of the TLS tests and bench
    libfuse2                               # the EIO-injecting FUSE file system of the SSD tests
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

if [ "$compat" = 1 ]; then
    # compat/install.sh is maintained with compat/; it takes the interpreter whose
    # environment it installs into.
    if [ ! -f compat/install.sh ]; then
        echo "install.sh: --mooncake-compat needs compat/install.sh, which this checkout lacks" >&2
        exit 1
    fi
    bash compat/install.sh "$PWD/.venv/bin/python"
fi
if [ "$system" = 1 ]; then
    bash tools/systemd/install-system.sh --root "$root"
fi
