"""A FUSE file system for fault tests: passes through to a backing directory and answers EIO
(or another errno) to chosen reads and writes.

    python tests/eio_fuse.py BACKING MOUNTPOINT FAULTS_JSON

FAULTS_JSON names a file the tests rewrite while it runs (read again on every request):
{"read": [[name, start, end], ...], "write": [[name, start, end, "ENOSPC"], ...]}; a read or
write of file `name` (relative to the root) overlapping bytes [start, end) fails with EIO, or
with the errno named as a fourth item. The mount
uses direct_io, so every request reaches this process (no page cache in between).
Needs /dev/fuse, root, libfuse2 (Debian) and fusepy (PyPI).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading

from fuse import FUSE, FuseOSError, Operations


class EioPassthrough(Operations):
    def __init__(self, backing: str, faults_path: str):
        self.backing = backing
        self.faults_path = faults_path
        self._lock = threading.Lock()

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _fail_if_faulty(self, kind: str, path: str, offset: int, size: int) -> None:
        try:
            with open(self.faults_path) as f:
                faults = json.load(f).get(kind, [])
        except (OSError, ValueError):
            return
        name = path.lstrip("/")
        for entry in faults:
            if name == entry[0] and offset < entry[2] and entry[1] < offset + size:
                raise FuseOSError(getattr(errno, entry[3]) if len(entry) > 3 else errno.EIO)

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        return {key: getattr(st, key) for key in (
            "st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size",
            "st_uid")}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._path(path))

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)

    def rmdir(self, path):
        os.rmdir(self._path(path))

    def unlink(self, path):
        os.unlink(self._path(path))

    def rename(self, old, new):
        os.replace(self._path(old), self._path(new))

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)

    def truncate(self, path, length, fh=None):
        with open(self._path(path), "r+b") as f:
            f.truncate(length)

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def open(self, path, flags):
        # The backing file is opened without O_DIRECT (the mount is direct_io already).
        flags &= ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_TRUNC)
        return os.open(self._path(path), flags)

    def read(self, path, size, offset, fh):
        self._fail_if_faulty("read", path, offset, size)
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._fail_if_faulty("write", path, offset, len(data))
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fdatasync(fh) if datasync else os.fsync(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self.backing)
        return {key: getattr(st, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}


def main() -> None:
    backing, mountpoint, faults = sys.argv[1:4]
    FUSE(EioPassthrough(backing, faults), mountpoint, foreground=True, direct_io=True,
         nothreads=False)


if __name__ == "__main__":
    main()
