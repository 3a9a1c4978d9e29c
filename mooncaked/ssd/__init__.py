"""The disk tier: objects kept on local SSD beyond DRAM (README, "SSD tier").

`tier.DiskTier` is the interface; the other modules are its parts: `records` (the on-disk
blocks), `layout` (the directory, its files and ssd.meta), `disk_io` (the tier's io_uring on
the event loop), `bounce` (aligned staging memory), `regions` (region states and the order
of acknowledgements), `recovery` (the scan at start).
"""

from mooncaked.ssd.tier import (DirectoryInUse, DiskCorrupt, DiskFull, DiskIOError, DiskRecord,
                                DiskTier, LayoutMismatch, Locator)

__all__ = ["DiskTier", "Locator", "DiskRecord", "DiskFull", "DiskIOError", "DiskCorrupt",
           "LayoutMismatch", "DirectoryInUse"]
