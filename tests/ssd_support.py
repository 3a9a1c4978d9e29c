"""Helpers of the disk tier tests: configs, values that say which key they belong to, running
a coroutine on either loop, and the skip where the kernel refuses io_uring."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from mooncaked.config import SsdConfig

MIB = 1 << 20


def ssd_config(directory, **overrides) -> SsdConfig:
    """A small tier: 1 MiB regions in 4 MiB files, 8 MiB in all."""
    values = dict(enabled=True, directory=str(directory), capacity_bytes=8 * MIB,
                  file_bytes=4 * MIB, region_bytes=MIB, block_bytes=4096, queue_depth=32,
                  bounce_bytes=2 * MIB, reclaim_free_regions=2)
    values.update(overrides)
    return SsdConfig(**values)


def value_of(key: str, size: int) -> bytes:
    """Bytes that differ for every key (and size)."""
    return hashlib.shake_256(f"{key}/{size}".encode()).digest(size) if size else b""


def require_io_uring() -> None:
    from mooncaked._native import DiskRing
    try:
        DiskRing(4).close()
    except OSError as exc:
        pytest.skip(f"the kernel refuses io_uring here: {exc}")


def run(coro, loop_kind: str = "asyncio"):
    """Run coro to completion on a new loop of the kind named."""
    if loop_kind == "uring":
        from mooncaked.io import uring
        ok, reason = uring.usable()
        if not ok:
            pytest.skip(f"io_uring loop not usable here: {reason}")
        loop = uring.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def file_system_type(path) -> str:
    """The type (ext4, tmpfs, ...) of the mount holding path, from /proc/self/mounts."""
    path = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mountpoint = fields[1].replace("\\040", " ")
            if (path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")) \
                    and len(mountpoint) >= len(best):
                best, kind = mountpoint, fields[2]
    return kind


def crash_value_size(number: int) -> int:
    """Value size of record k<number> in the kill -9 test: 1 byte to ~64 KiB, varied."""
    return 1 + number * 7919 % 65_000
