"""The memory behind a segment: a shared-memory file that local clients can map too.

Each segment is a file in `[segments] shm_dir` (tmpfs, or hugetlbfs for huge pages), mapped
MAP_SHARED by the daemon and by local clients (wire/PROTOCOL.md section 5.2), so bulk bytes
move between them with one memcpy. Files are named after the daemon's pid; files left behind
by a daemon that died are removed at the next start.

Placement: the mapping's memory policy binds its pages to `numa_node` before any is touched
(tmpfs pages are allocated by the first touch, in the daemon or a client, and follow the
policy of the mapping that touches them; `prefault` makes that the daemon's, at start).

Reservation: the file's space is allocated at start (posix_fallocate, after the binding), so
a shm_dir with less free space than the segment refuses to start, naming the sizes. Without
it a full tmpfs is found by the first write to a page it cannot back: SIGBUS in whoever
touches it (the daemon's copies, a local client), EFAULT in a receive.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re

from mooncaked._native import bind_to_node, buffer_address

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14: fault every page in, writable, in one call
SHMEM_THP_CONTROL = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"

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
    def __init__(self, segment_id: int, shm_dir: str, size_bytes: int, mode: int,
                 numa_node: int = -1, huge_pages: str = "off", prefault: bool = False) -> None:
        self.segment_id = segment_id
        self.size_bytes = size_bytes
        if huge_pages == "hugetlbfs":
            check_hugetlbfs(shm_dir, size_bytes)
        self.path = os.path.join(shm_dir, segment_file_name(os.getpid(), segment_id))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        self.mmap = None
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
            os.ftruncate(fd, size_bytes)
            self.mmap = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self.address = buffer_address(self.mmap)
            if numa_node >= 0:
                bind_to_node(self.address, size_bytes, numa_node)
            if huge_pages == "transparent":
                self.mmap.madvise(mmap.MADV_HUGEPAGE)
                warn_if_shmem_thp_off()
            self._reserve(fd, shm_dir)
            if prefault:
                self._prefault()
        except BaseException:
            if self.mmap is not None:
                self.mmap.close()
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self.mmap)

    def _reserve(self, fd: int, shm_dir: str) -> None:
        """Allocate the file's pages (under the mapping's NUMA policy), or refuse."""
        try:
            os.posix_fallocate(fd, 0, self.size_bytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise
            stats = os.statvfs(shm_dir)
            raise ValueError(
                f"segment {self.segment_id} needs {self.size_bytes} bytes but shm_dir {shm_dir} "
                f"has {stats.f_bavail * stats.f_frsize} bytes free (of "
                f"{stats.f_blocks * stats.f_frsize}): lower [segments] size_bytes or count, or "
                f"make room ({exc.strerror})") from None

    def _prefault(self) -> None:
        try:
            self.mmap.madvise(MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: touch one byte per page
            page = mmap.PAGESIZE
            for offset in range(0, self.size_bytes, page):
                self.mmap[offset] = 0

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


def check_hugetlbfs(shm_dir: str, size_bytes: int) -> None:
    """Refuse a shm_dir that is not hugetlbfs, or a size that is not whole huge pages."""
    directory = os.path.realpath(shm_dir)
    mount_type = ""
    best = ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 3:
                point = fields[1]
                if (directory == point or directory.startswith(point.rstrip("/") + "/")) \
                        and len(point) > len(best):
                    best, mount_type = point, fields[2]
    if mount_type != "hugetlbfs":
        raise ValueError(f"huge_pages = \"hugetlbfs\" needs shm_dir on a hugetlbfs mount; "
                         f"{shm_dir} is on {mount_type or 'an unknown filesystem'}")
    page_bytes = os.statvfs(directory).f_bsize
    if size_bytes % page_bytes:
        raise ValueError(f"size_bytes = {size_bytes} is not a multiple of the huge page size "
                         f"{page_bytes} of {shm_dir}")


def warn_if_shmem_thp_off() -> None:
    try:
        with open(SHMEM_THP_CONTROL) as f:
            setting = f.read()
    except OSError:
        return
    if "[never]" in setting or "[deny]" in setting:
        log.warning("huge_pages = \"transparent\" has no effect: %s is %s (set it to advise)",
                    SHMEM_THP_CONTROL, setting.strip())
