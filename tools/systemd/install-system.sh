#!/usr/bin/env bash
# Installs mooncaked for systemd from this checkout's virtual environment (.venv, made by
# tools/install.sh, which runs this script for `--system`):
#   /usr/local/bin/mooncaked, /usr/local/bin/mooncakectl   wrappers that exec .venv's entry points
#   /etc/systemd/system/mooncaked.service                  tools/systemd/mooncaked.service
#   /etc/mooncaked/mooncaked.toml                           mooncaked.toml, only if absent
#
#   bash tools/systemd/install-system.sh [--root DIR]
#
# --root DIR installs under DIR instead of / (a staging or test root; tests/test_systemd_unit.py
# verifies the unit installed there with `systemd-analyze verify --root DIR`). The service reads
# this checkout at run time: keep it where the unit's sandbox shows it (not under /tmp or
# /var/tmp, which PrivateTmp=yes replaces with empty directories).
set -euo pipefail
root=/
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install-system.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
# The physical path: the wrappers must name where the files really are.
repo="$(cd "$(dirname "$0")/../.." && pwd -P)"
venv="$repo/.venv"
for tool in mooncaked mooncakectl; do
    if [ ! -x "$venv/bin/$tool" ]; then
        echo "install-system.sh: $venv/bin/$tool is missing: run bash tools/install.sh first" >&2
        exit 1
    fi
done
case "$repo/" in
    /tmp/*|/var/tmp/*)
        message="this checkout is in $repo, which the service cannot see (the unit has"
        message="$message PrivateTmp=yes): move it, e.g. to /opt/mooncaked, and install there"
        # A staging root (packaging, tests) may be used elsewhere: warn only.
        if [ "$root" != / ]; then
            echo "install-system.sh: warning: $message" >&2
        else
            echo "install-system.sh: $message" >&2
            exit 1
        fi ;;
esac
case "$repo" in
    *"'"*) echo "install-system.sh: the checkout's path contains a quote: $repo" >&2; exit 1 ;;
esac

install -d -m 0755 "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/mooncaked"
# Wrappers, not symlinks: `exec` keeps the PID (systemd's main process, which sends READY=1),
# and they resolve the same whether the root is / or a staging directory.
for tool in mooncaked mooncakectl; do
    printf '#!/bin/sh\n# Installed by %s/tools/install.sh --system.\nexec '"'"'%s'"'"' "$@"\n' \
        "$repo" "$venv/bin/$tool" >"$root/usr/local/bin/$tool.new"
    chmod 0755 "$root/usr/local/bin/$tool.new"
    mv -f "$root/usr/local/bin/$tool.new" "$root/usr/local/bin/$tool"
done
install -m 0644 "$repo/tools/systemd/mooncaked.service" "$root/etc/systemd/system/mooncaked.service"
if [ -e "$root/etc/mooncaked/mooncaked.toml" ]; then
    echo "kept $root/etc/mooncaked/mooncaked.toml (compare with $repo/mooncaked.toml)"
else
    install -m 0644 "$repo/mooncaked.toml" "$root/etc/mooncaked/mooncaked.toml"
fi
root_shown="${root%/}"
echo "installed ${root_shown}/usr/local/bin/mooncaked and mooncakectl (running $venv)," \
     "${root_shown}/etc/systemd/system/mooncaked.service, ${root_shown}/etc/mooncaked/mooncaked.toml"
if [ "$root" = / ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "start it: systemctl enable --now mooncaked; logs: journalctl -u mooncaked"
elif [ "$root" = / ]; then
    echo "systemd is not running here (no /run/systemd/system): the unit is installed for" \
         "when it does; run /usr/local/bin/mooncaked by hand meanwhile"
fi
