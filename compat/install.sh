#!/usr/bin/env bash
# Installs the `mooncake` compatibility package (this directory) into the environment of the
# Python interpreter given, so that engines importing `mooncake.store` use mooncaked.
#
#     bash compat/install.sh PYTHON
#
# Refuses (exit 3) an environment that has the real Mooncake: both provide the package
# `mooncake`, and whichever was installed last would silently replace the other's files.
# mooncaked must already be installed there (exit 4 otherwise).
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: bash compat/install.sh PYTHON   (the interpreter of the target environment)" >&2
    exit 2
fi
python=$(command -v "$1") || { echo "compat/install.sh: no interpreter at $1" >&2; exit 2; }
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
compat=$(cd "$(dirname "$0")" && pwd)

# Run from / so that this directory's own mooncake/ is not what the interpreter finds.
cd /
set +e
"$python" - <<'PY'
import importlib.metadata
import importlib.util
import os
import sys

def refuse(why: str) -> None:
    print(f"compat/install.sh: refusing to install into {sys.prefix}: {why}.\n"
          "The real Mooncake and mooncaked's compatibility package both provide `mooncake`.\n"
          "To proceed, use a separate environment for mooncaked (a new venv), or remove the\n"
          "real Mooncake from this one (pip uninstall mooncake-transfer-engine...) and run\n"
          "this script again.", file=sys.stderr)
    sys.exit(3)

real = sorted({dist.metadata["Name"] for dist in importlib.metadata.distributions()
               if (dist.metadata["Name"] or "").lower().replace("_", "-")
               .startswith("mooncake-transfer-engine")})
if real:
    refuse("the real Mooncake is installed (" + ", ".join(real) + ")")

spec = importlib.util.find_spec("mooncake")  # finds the package without importing it
if spec is not None:
    ours = False
    for location in spec.submodule_search_locations or []:
        try:
            with open(os.path.join(location, "__init__.py")) as f:
                ours = ours or "MOONCAKED_COMPAT = True" in f.read()
        except OSError:
            pass
    if not ours:
        where = ", ".join(spec.submodule_search_locations or [spec.origin or "?"])
        refuse(f"a `mooncake` package that is not mooncaked's is importable ({where})")

if importlib.util.find_spec("mooncaked") is None:
    print(f"compat/install.sh: mooncaked is not installed in {sys.prefix}; install it first\n"
          "(python -m pip install /path/to/the/mooncaked/checkout), then run this script again.",
          file=sys.stderr)
    sys.exit(4)
PY
status=$?
set -e
[ "$status" -eq 0 ] || exit "$status"

# An environment without pip of its own (venv --without-pip) is served by python3's pip.
if "$python" -m pip --version >/dev/null 2>&1; then
    pip=("$python" -m pip)
else
    pip=(python3 -m pip --python "$python")
fi
# Built from a copy, so that no build output is left in the checkout and two installs at once
# do not share a build directory.
source=$(mktemp -d)
trap 'rm -rf "$source"' EXIT
cp -r "$compat/pyproject.toml" "$compat/mooncake" "$source/"
"${pip[@]}" install -q --no-deps --force-reinstall "$source"

"$python" -c '
import mooncake.store, mooncaked.mooncake_store
assert mooncake.store.MooncakeDistributedStore is mooncaked.mooncake_store.MooncakeDistributedStore
'
echo "mooncake compatibility package installed for $python"
