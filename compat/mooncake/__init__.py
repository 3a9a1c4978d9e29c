"""mooncaked's stand-in for Mooncake's `mooncake` package (distribution
mooncaked-mooncake-compat): `mooncake.store` is `mooncaked.mooncake_store`.

The transfer engine (`mooncake.engine`), the EP/PG modules and the allocators are not provided:
mooncaked moves bytes through its daemon, so only the store API has a meaning here.
"""

# compat/install.sh looks for this marker to tell this package from the real Mooncake.
MOONCAKED_COMPAT = True
