"""The memory behind a segment: a shared-memory file that local clients can map too.

Each segment is a file in `[segments] shm_dir` (tmpfs), mapped MAP_SHARED by the daemon and by
local clients (wire/PROTOCOL.md section 5.2), so bulk bytes move between them with one memcpy.
Files are named after the daemon's pid; files left behind by a daemon that died are removed at
the next start.
"""

from __future__ import annotations

import logging
import mmap
import os
import re

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^mooncaked-(\d+)-seg(\d+)$")


def segment_file_name(pid: int, segment_id: int) -> str:
    return f"mooncaked-{pid}-seg{segment_id}"


def remove_stale_files(shm_dir: str) -> int:
    """Unlink segment files whose daemon is no longer running."""
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        match = _FILE_NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SegmentMemory:
    def __init__(self, segment_id: int, shm_dir: str, size_bytes: int, mode: int) -> None:
        self.segment_id = segment_id
        self.size_bytes = size_bytes
        self.path = os.path.join(shm_dir, segment_file_name(os.getpid(), segment_id))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
            os.ftruncate(fd, size_bytes)
            self.mmap = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.view = memoryview(self.mmap)

    def slice(self, offset: int, size_bytes: int) -> memoryview:
        return self.view[offset:offset + size_bytes]

    def close(self) -> None:
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:  # a view is still exported; the mapping goes with the process
            log.warning("segment %d still has views at close", self.segment_id)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
