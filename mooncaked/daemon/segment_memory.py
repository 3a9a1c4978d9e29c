"""The memory behind a segment: a shared-memory file that local clients can map too.

A shared segment is a file in `[segments] shm_dir` (tmpfs, or hugetlbfs for huge pages),
created with `shm_mode` (never readable by other users); a namespace pool's segment is a
memfd, with no path at all. Both are mapped MAP_SHARED by the daemon and by the local clients
that receive their file descriptor (daemon/fd_handover.py, wire/PROTOCOL.md section 5.2), so
bulk bytes move between them with one memcpy. Files are named after the daemon's pid; files
left behind by a daemon that died are removed at the next start.

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

_FILE_NAME = re.compile(r"mooncaked-([0-9]+)-seg([0-9]+)")  # matched in full (fullmatch)


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
        match = _FILE_NAME.fullmatch(name)
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
    """A segment's memory. `memfd_name` set: a memfd of that name (a namespace pool), else a
    file in `shm_dir`. `fd` stays open for the daemon's life: it is what clients receive."""

    def __init__(self, segment_id: int, shm_dir: str, size_bytes: int, mode: int,
                 numa_node: int = -1, huge_pages: str = "off", prefault: bool = False,
                 memfd_name: str = "") -> None:
        self.segment_id = segment_id
        self.size_bytes = size_bytes
        if memfd_name:
            self.path = ""
            fd = _create_memfd(memfd_name, size_bytes, huge_pages)
        else:
            if huge_pages == "hugetlbfs":
                check_hugetlbfs(shm_dir, size_bytes)
            self.path = os.path.join(shm_dir, segment_file_name(os.getpid(), segment_id))
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            if self.path:
                os.fchmod(fd, mode)  # not widened or narrowed by the umask
            os.ftruncate(fd, size_bytes)
            self.mmap = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        self.fd = fd
        try:
            self.address = buffer_address(self.mmap)
            if numa_node >= 0:
                bind_to_node(self.address, size_bytes, numa_node)
            if huge_pages == "transparent":
                self.mmap.madvise(mmap.MADV_HUGEPAGE)
                warn_if_shmem_thp_off()
            self._reserve(shm_dir if self.path else "")
            if prefault:
                self._prefault()
        except BaseException:
            self.mmap.close()
            os.close(self.fd)
            self._unlink()
            raise
        self.view = memoryview(self.mmap)

    def _reserve(self, shm_dir: str) -> None:
        """Allocate the memory's pages (under the mapping's NUMA policy), or refuse: a page
        that cannot be had later would be a SIGBUS in whoever touches it."""
        try:
            os.posix_fallocate(self.fd, 0, self.size_bytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise
            if not shm_dir:  # a memfd (namespace pool): memory, not a file system's room
                raise ValueError(
                    f"segment {self.segment_id} needs {self.size_bytes} bytes of memory that "
                    f"the system cannot give ({exc.strerror}): lower its size") from None
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
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._unlink()

    def _unlink(self) -> None:
        if not self.path:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _create_memfd(name: str, size_bytes: int, huge_pages: str) -> int:
    flags = os.MFD_CLOEXEC
    if huge_pages == "hugetlbfs":
        page_bytes = huge_page_bytes()
        if size_bytes % page_bytes:
            raise ValueError(f"namespace pool {name!r}: size_bytes = {size_bytes} is not a "
                             f"multiple of the huge page size {page_bytes}")
        flags |= os.MFD_HUGETLB
    return os.memfd_create(f"mooncaked-pool-{name}", flags)


def huge_page_bytes() -> int:
    """The default huge page size (what MFD_HUGETLB allocates), from /proc/meminfo."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    raise ValueError("huge_pages = \"hugetlbfs\": this kernel reports no huge page size")


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
