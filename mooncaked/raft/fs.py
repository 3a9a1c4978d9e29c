"""The file operations the Raft log store makes, behind one seam.

`LogStore` does all its file I/O through an object with the methods of `OsFileSystem`, so the
simulator can run the real store on a simulated disk (`mooncaked/sim/disk.py`
`SimFileSystem`) that loses unsynced writes on power loss and injects I/O errors.

Files are named by path and written through integer descriptors, as with `os`: a method raises
`OSError` (with its errno) where the matching system call fails. The `os` functions are looked
up at each call so that tests can patch them (`os.replace`, `os.fsync`, ...), except `write`.
"""

from __future__ import annotations

import os


class OsFileSystem:
    """The real file system: each method is one system call (or the usual short sequence)."""

    def makedirs(self, path: str) -> None:
        """Create the directory and any missing parents; an existing one is fine."""
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def read_file(self, path: str) -> bytes:
        """The whole file; `FileNotFoundError` if there is none."""
        with open(path, "rb") as file:
            return file.read()

    def open_append(self, path: str, *, create: bool) -> int:
        """A descriptor that appends to the file; with `create`, the file must not exist yet
        (`FileExistsError`) and is made with mode 0o644."""
        if create:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                           0o644)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def open_truncate(self, path: str) -> int:
        """A descriptor that writes the file from its start, creating it or emptying it."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    # write(fd, data) -> int: what the kernel took (maybe less than all). Bound straight to
    # os.write, with no Python frame in between: it is on the append hot path.
    write = staticmethod(os.write)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        # macOS has no fdatasync.
        getattr(os, "fdatasync", os.fsync)(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_directory(self, path: str) -> None:
        """Make the directory's entries (files created, renamed, removed in it) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, source: str, target: str) -> None:
        """Rename `source` over `target` atomically."""
        os.replace(source, target)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def close(self, fd: int) -> None:
        os.close(fd)
