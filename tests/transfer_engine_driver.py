"""tests/mooncake_te_driver.py's commands, answered by mooncaked.transfer_engine instead of
the Mooncake wheel: a local client process of a mooncaked (found at $MOONCAKED_ADDRESS) for
the TransferEngine tests. Same stdin/stdout JSON lines."""

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mooncaked import transfer_engine  # noqa: E402

# mooncake_te_driver imports `mooncake.engine`: let it be ours.
package = types.ModuleType("mooncake")
package.engine = transfer_engine
sys.modules["mooncake"] = package
sys.modules["mooncake.engine"] = transfer_engine

import mooncake_te_driver  # noqa: E402

if __name__ == "__main__":
    mooncake_te_driver.main()
