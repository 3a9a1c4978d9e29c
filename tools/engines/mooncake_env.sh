#!/usr/bin/env bash
# Creates tools/engines/.venv-mooncake: Mooncake's own Transfer Engine wheel, alone, for the
# interoperability tests of mooncaked's transfer layer (tests/test_transfer_mooncake_interop.py
# drives it through tests/mooncake_te_driver.py). It is kept out of the project's venv, where
# the `mooncake` import name belongs to the compatibility package (compat/). Idempotent: the
# wheel is installed only when the pinned version is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=$PWD/tools/engines/.venv-mooncake
package=mooncake-transfer-engine-non-cuda
version=0.3.13.post1  # the version tools/bench/bootstrap.py uses

python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
py=$venv/bin/python

if [ "$("$py" -c 'import importlib.metadata as m; print(m.version("'$package'"))' 2>/dev/null)" \
        != "$version" ]; then
    # pip warns once per package about each configured index directory that lacks it: noise.
    "$py" -m pip install -q --disable-pip-version-check "$package==$version" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
"$py" -c 'from mooncake.engine import TransferEngine'
echo "Mooncake Transfer Engine environment ready: $venv"
