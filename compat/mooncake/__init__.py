"""mooncaked's stand-in for Mooncake's `mooncake` package (distribution
mooncaked-mooncake-compat): `mooncake.store` is `mooncaked.mooncake_store`, `mooncake.engine`
is `mooncaked.transfer_engine` (its TransferEngine is served by the local daemon).

The EP/PG modules and the allocators are not provided.
"""

# compat/install.sh looks for this marker to tell this package from the real Mooncake.
MOONCAKED_COMPAT = True
