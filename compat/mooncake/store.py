"""`mooncake.store` for engines written for Mooncake Store: every public name of
mooncaked.mooncake_store, whose `MooncakeDistributedStore.setup` connects to the mooncaked
daemon at `master_server_addr` (`unix:PATH`, `/PATH` or `HOST:PORT`) or at $MOONCAKED_ADDRESS.
"""

from mooncaked.mooncake_store import *  # noqa: F401,F403
from mooncaked.mooncake_store import __all__  # noqa: F401
