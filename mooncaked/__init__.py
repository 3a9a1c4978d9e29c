"""mooncaked: a KV-cache object store for LLM serving, one daemon per node.

Clients: `Client` (asyncio) and `BlockingClient`; `mooncaked.mooncake_store` offers a
`MooncakeDistributedStore` with Mooncake Store's Python API.
"""

__version__ = "0.1.0"

from mooncaked.errors import ErrorCode, MooncakedError  # noqa: E402

__all__ = ["__version__", "ErrorCode", "MooncakedError", "Client", "BlockingClient"]


def __getattr__(name: str):
    # The clients are imported on first use, so the daemon does not load them.
    if name == "Client":
        from mooncaked.client.aio import Client
        return Client
    if name == "BlockingClient":
        from mooncaked.client.blocking import BlockingClient
        return BlockingClient
    raise AttributeError(f"module 'mooncaked' has no attribute {name!r}")
