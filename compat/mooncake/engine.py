"""`mooncake.engine` for engines written for Mooncake's Transfer Engine: every public name of
mooncaked.transfer_engine, whose `TransferEngine` is served by the local mooncaked daemon
(README "Transfer layer").
"""

from mooncaked.transfer_engine import *  # noqa: F401,F403
from mooncaked.transfer_engine import __all__  # noqa: F401
