"""mooncaked._native: the daemon's C-speed helpers, built as one extension.

Owns: OffsetAllocator (mem/offset_allocator.pyx), the raw memory helpers
copy_memory / buffer_address (mem/memcopy.pyx) and NUMA placement (mem/numa.pyx), the
disk tier's io_uring (disk/disk_ring.pyx) and CRC32C (disk/crc32c.pyx).
This file is only the include list, so every topic compiles into a single shared
object with one import.
"""

include "mem/offset_allocator.pyx"
include "mem/memcopy.pyx"
include "mem/numa.pyx"
include "loop/loop.pyx"  # UringLoop: the io_uring event loop (loop/*.pyx)
include "disk/crc32c.pyx"
include "disk/disk_ring.pyx"
