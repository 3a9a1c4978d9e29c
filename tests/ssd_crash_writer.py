"""Child process of test_ssd_crash.py: writes records to a disk tier with many writes in
flight, printing `ACK key region offset size version` once each write has returned (is
durable), until it is killed.

    python tests/ssd_crash_writer.py DIRECTORY
"""

from __future__ import annotations

import asyncio
import itertools
import sys

from mooncaked.ssd import DiskTier
from ssd_support import MIB, crash_value_size, ssd_config, value_of

WRITERS = 48


async def main(directory: str) -> None:
    tier = await DiskTier.open(ssd_config(directory, capacity_bytes=256 * MIB,
                                          file_bytes=64 * MIB, region_bytes=4 * MIB))
    print("READY", flush=True)
    numbers = itertools.count()

    async def writer() -> None:
        for i in numbers:
            key = f"k{i}"
            size = crash_value_size(i)
            locator = await tier.write("ns", key, i, [memoryview(value_of(key, size))])
            sys.stdout.write(f"ACK {key} {locator.region} {locator.offset} {size} {i}\n")
            sys.stdout.flush()

    await asyncio.gather(*(writer() for _ in range(WRITERS)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
