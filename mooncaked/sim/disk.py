"""A simulated disk: a file system for the real Raft log store.

`SimFileSystem` is an in-memory file system with the methods of `mooncaked/raft/fs.py`
`OsFileSystem`, so `LogStore(directory, fs=SimFileSystem(...))` runs unchanged on it. It holds
two images: what the running process sees (the page cache) and what is durable (what a power
loss keeps), and moves data from one to the other only where a real disk does:

- file data becomes durable at `fsync`/`fdatasync` of that file;
- a directory entry (a file created, renamed over another or removed; a directory made)
  becomes durable at `fsync_directory` of the directory that holds it, never through an fsync
  of the file;
- `crash()` (power loss) drops everything else. Given an rng, it keeps a random prefix of each
  file's unsynced tail (a torn write: the page cache had written some of it back) and a random
  prefix of each directory's unsynced entry changes (journaled in order, each one atomic), as a
  real disk may; without one it keeps nothing unsynced. No descriptor survives a crash.
  `close_all()` is a process death without power loss: descriptors close, nothing is lost.

Faults: `fail_writes(n)` / `fail_syncs(n)` make the next n writes / syncs raise
`OSError(EIO)`; a failed write stores nothing, a failed sync makes nothing durable (the data
stays in the page cache). `capacity_bytes` bounds the bytes all files hold: a write that does
not fit stores what fits and returns the short count, and the next one raises
`OSError(ENOSPC)`, as write(2) does.

Deterministic: the only randomness is the rng given to the constructor. Not thread-safe: it
runs on the simulator's one thread (whose run_in_executor runs jobs on the loop).
"""

from __future__ import annotations

import errno
import os
import posixpath
import random



class _File:
    __slots__ = ("data", "durable_length", "durable_data", "links", "opens")

    def __init__(self) -> None:
        self.data = bytearray()  # what reads see
        # What a power loss keeps: durable_data if set (the file was cut or overwritten below
        # what was synced), else the first durable_length bytes of data.
        self.durable_length = 0
        self.durable_data: bytes | None = None
        self.links = 0  # names in the current image
        self.opens = 0  # open descriptors

    def durable(self) -> bytes:
        if self.durable_data is not None:
            return self.durable_data
        return bytes(self.data[:self.durable_length])

    def keep_durable_before_change_at(self, offset: int) -> None:
        """Call before changing bytes at offset or later: keeps the durable image intact."""
        if offset < self.durable_length and self.durable_data is None:
            self.durable_data = bytes(self.data[:self.durable_length])


class _Directory:
    __slots__ = ("entries", "durable_entries", "pending")

    def __init__(self) -> None:
        self.entries: dict[str, _File | _Directory] = {}
        self.durable_entries: dict[str, _File | _Directory] = {}
        # Entry changes not yet durable, oldest first; each is one operation's changes, applied
        # whole or not at all: (name, node), node None for a removal.
        self.pending: list[tuple[tuple[str, _File | _Directory | None], ...]] = []

    def change(self, *changes: tuple[str, _File | _Directory | None]) -> None:
        for name, node in changes:
            if node is None:
                del self.entries[name]
            else:
                self.entries[name] = node
        self.pending.append(changes)


class _Descriptor:
    __slots__ = ("file", "append", "position")

    def __init__(self, file: _File, append: bool) -> None:
        self.file = file
        self.append = append
        self.position = 0


class SimFileSystem:
    def __init__(self, rng: random.Random | None = None, *,
                 capacity_bytes: int | None = None) -> None:
        """rng: torn writes at crash() (None: a crash keeps nothing unsynced);
        capacity_bytes: the disk size (None: unbounded)."""
        self.rng = rng
        self.capacity_bytes = capacity_bytes
        self._root = _Directory()  # always exists, durably
        self._descriptors: dict[int, _Descriptor] = {}
        self._next_fd = 3
        self._used_bytes = 0
        self._failing_writes = 0
        self._failing_syncs = 0
        # Counters, for tests and the simulator's reports.
        self.syncs = 0  # successful fsync, fdatasync and fsync_directory calls
        self.crashes = 0

    # -- faults ---------------------------------------------------------------------------------

    def fail_writes(self, count: int = 1) -> None:
        """The next `count` writes raise OSError(EIO) and store nothing."""
        self._failing_writes += count

    def clear_faults(self) -> None:
        """No more injected failures, and an unbounded disk (the operator fixed it)."""
        self._failing_writes = self._failing_syncs = 0
        self.capacity_bytes = None

    def fail_syncs(self, count: int = 1) -> None:
        """The next `count` fsync/fdatasync/fsync_directory calls raise OSError(EIO) and make
        nothing durable."""
        self._failing_syncs += count

    @property
    def used_bytes(self) -> int:
        """Bytes held by files that have a name or an open descriptor."""
        return self._used_bytes

    # -- power loss and process death -----------------------------------------------------------

    def crash(self) -> None:
        """Power loss: keep what is durable (and, with an rng, a random part of the rest)."""
        self.crashes += 1
        self._descriptors.clear()
        seen: set[int] = set()
        self._crash_directory(self._root, seen)
        self._recount()

    def close_all(self) -> None:
        """The process died (no power loss): its descriptors close, every write stays."""
        for fd in list(self._descriptors):
            self.close(fd)

    def _crash_directory(self, directory: _Directory, seen: set[int]) -> None:
        if self.rng is not None and directory.pending:
            for changes in directory.pending[:self.rng.randint(0, len(directory.pending))]:
                for name, node in changes:
                    if node is None:
                        directory.durable_entries.pop(name, None)
                    else:
                        directory.durable_entries[name] = node
        directory.pending.clear()
        directory.entries = dict(directory.durable_entries)
        for node in directory.entries.values():
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, _Directory):
                self._crash_directory(node, seen)
            else:
                self._crash_file(node)

    def _crash_file(self, file: _File) -> None:
        if file.durable_data is not None:
            file.data = bytearray(file.durable_data)
        else:
            keep = file.durable_length
            unsynced = len(file.data) - keep
            if self.rng is not None and unsynced > 0:
                keep += self.rng.randint(0, unsynced)
            del file.data[keep:]
        file.durable_data = None
        file.durable_length = len(file.data)

    def _recount(self) -> None:
        used = 0
        seen: set[int] = set()
        stack = [self._root]
        while stack:
            for node in stack.pop().entries.values():
                if isinstance(node, _Directory):
                    stack.append(node)
                    continue
                if id(node) not in seen:
                    seen.add(id(node))
                    node.links = node.opens = 0
                    used += len(node.data)
                node.links += 1
        self._used_bytes = used

    # -- paths ----------------------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        return [part for part in posixpath.normpath(posixpath.join("/", os.fspath(path))).split("/")
                if part]

    def _directory(self, parts: list[str], path: str) -> _Directory:
        directory = self._root
        for part in parts:
            node = directory.entries.get(part)
            if node is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            if not isinstance(node, _Directory):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            directory = node
        return directory

    def _parent(self, path: str) -> tuple[_Directory, str]:
        parts = self._parts(path)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        return self._directory(parts[:-1], path), parts[-1]

    def _file(self, path: str) -> _File:
        directory, name = self._parent(path)
        node = directory.entries.get(name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if isinstance(node, _Directory):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        return node

    def _descriptor(self, fd: int) -> _Descriptor:
        try:
            return self._descriptors[fd]
        except KeyError:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF)) from None

    def _open(self, file: _File, append: bool) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self._descriptors[fd] = _Descriptor(file, append)
        file.opens += 1
        return fd

    def _new_file(self, directory: _Directory, name: str) -> _File:
        file = _File()
        file.links = 1
        directory.change((name, file))
        return file

    def _drop_link(self, file: _File) -> None:
        file.links -= 1
        if file.links == 0 and file.opens == 0:
            self._used_bytes -= len(file.data)

    # -- the OsFileSystem interface -------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        directory = self._root
        for part in self._parts(path):
            node = directory.entries.get(part)
            if node is None:
                node = _Directory()
                directory.change((part, node))
            elif not isinstance(node, _Directory):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            directory = node

    def exists(self, path: str) -> bool:
        try:
            directory, name = self._parent(path)
        except IsADirectoryError:
            return True  # the root
        except OSError:
            return False
        return name in directory.entries

    def listdir(self, path: str) -> list[str]:
        return sorted(self._directory(self._parts(path), path).entries)

    def read_file(self, path: str) -> bytes:
        return bytes(self._file(path).data)

    def open_append(self, path: str, *, create: bool) -> int:
        if create:
            directory, name = self._parent(path)
            if name in directory.entries:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
            return self._open(self._new_file(directory, name), append=True)
        return self._open(self._file(path), append=True)

    def open_truncate(self, path: str) -> int:
        directory, name = self._parent(path)
        node = directory.entries.get(name)
        if node is None:
            return self._open(self._new_file(directory, name), append=False)
        if isinstance(node, _Directory):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        fd = self._open(node, append=False)
        self.ftruncate(fd, 0)
        return fd

    def write(self, fd: int, data: bytes | memoryview) -> int:
        descriptor = self._descriptor(fd)
        if self._failing_writes:
            self._failing_writes -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        file = descriptor.file
        offset = len(file.data) if descriptor.append else descriptor.position
        count = len(data)
        growth = max(0, offset + count - len(file.data))
        if self.capacity_bytes is not None:
            room = max(0, self.capacity_bytes - self._used_bytes)
            if growth > room:
                count -= growth - room
                growth = room
                if count <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        file.keep_durable_before_change_at(offset)
        if offset > len(file.data):
            file.data.extend(bytes(offset - len(file.data)))
        file.data[offset:offset + count] = data[:count]
        self._used_bytes += growth
        descriptor.position = offset + count
        return count

    def ftruncate(self, fd: int, length: int) -> None:
        file = self._descriptor(fd).file
        size = len(file.data)
        if length < size:
            file.keep_durable_before_change_at(length)
            del file.data[length:]
        else:
            file.data.extend(bytes(length - size))
        self._used_bytes += length - size

    def fdatasync(self, fd: int) -> None:
        self.fsync(fd)

    def fsync(self, fd: int) -> None:
        file = self._descriptor(fd).file
        if self._failing_syncs:
            self._failing_syncs -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        file.durable_data = None
        file.durable_length = len(file.data)
        self.syncs += 1

    def fsync_directory(self, path: str) -> None:
        directory = self._directory(self._parts(path), path)
        if self._failing_syncs:
            self._failing_syncs -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        directory.durable_entries = dict(directory.entries)
        directory.pending.clear()
        self.syncs += 1

    def replace(self, source: str, target: str) -> None:
        source_directory, source_name = self._parent(source)
        target_directory, target_name = self._parent(target)
        node = source_directory.entries.get(source_name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), source)
        replaced = target_directory.entries.get(target_name)
        if replaced is node:
            return
        if isinstance(replaced, _Directory) or isinstance(node, _Directory):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
        if source_directory is target_directory:
            target_directory.change((target_name, node), (source_name, None))
        else:
            target_directory.change((target_name, node))
            source_directory.change((source_name, None))
        if replaced is not None:
            self._drop_link(replaced)

    def unlink(self, path: str) -> None:
        file = self._file(path)
        directory, name = self._parent(path)
        directory.change((name, None))
        self._drop_link(file)

    def close(self, fd: int) -> None:
        file = self._descriptor(fd).file
        del self._descriptors[fd]
        file.opens -= 1
        if file.links == 0 and file.opens == 0:
            self._used_bytes -= len(file.data)
