"""The disk tier's directory: data files, their regions, and ssd.meta.

`[ssd] directory` holds ssd-0000.data, ssd-0001.data, ... (each preallocated, cut into
regions of region_bytes) and ssd.meta, a small JSON file written once the files are made,
which records the sizes the directory was formatted with and a random instance id. A
directory whose ssd.meta disagrees with the configuration is refused (LayoutMismatch) unless
the caller asks for a reformat; one without ssd.meta (new, or a format cut short) is
formatted.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
from dataclasses import dataclass

from mooncaked.ssd.records import FORMAT_VERSION

log = logging.getLogger("mooncaked.ssd")

META_NAME = "ssd.meta"
DATA_NAME = "ssd-{:04d}.data"
_META_KEYS = ("format", "block_bytes", "region_bytes", "file_bytes", "files", "regions")


class LayoutMismatch(Exception):
    """The directory was formatted with other sizes than the configuration's."""


class DirectoryInUse(Exception):
    """Another open tier (this process or another) holds the directory."""


class LayoutFull(Exception):
    """The file system has no room for the data files (ENOSPC, EDQUOT)."""


@dataclass(frozen=True)
class Layout:
    block_bytes: int
    region_bytes: int
    file_bytes: int
    regions: int

    @property
    def regions_per_file(self) -> int:
        return self.file_bytes // self.region_bytes

    @property
    def files(self) -> int:
        return -(-self.regions // self.regions_per_file)

    @property
    def capacity_bytes(self) -> int:
        return self.regions * self.region_bytes

    def file_size(self, file_index: int) -> int:
        regions = min(self.regions_per_file, self.regions - file_index * self.regions_per_file)
        return regions * self.region_bytes

    def region_place(self, region: int) -> tuple[int, int]:
        """(file index, byte offset of the region in that file)."""
        file_index, within = divmod(region, self.regions_per_file)
        return file_index, within * self.region_bytes

    def meta(self) -> dict:
        return {"format": FORMAT_VERSION, "block_bytes": self.block_bytes,
                "region_bytes": self.region_bytes, "file_bytes": self.file_bytes,
                "files": self.files, "regions": self.regions}


@dataclass
class OpenedFiles:
    fds: list[int]
    instance_id: int
    formatted: bool           # made anew by this start
    direct_io: bool
    direct_io_reason: str     # why O_DIRECT is off; "" when on
    lock_fd: int = -1         # the directory, flock()ed while the tier is open

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # releases the lock
            self.lock_fd = -1


def open_directory(directory: str, layout: Layout, reformat_on_mismatch: bool) -> OpenedFiles:
    """Lock the directory, format it (if needed) and open the tier's files. Raises
    DirectoryInUse, LayoutMismatch, LayoutFull or OSError."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    lock_fd = _lock_directory(directory)
    try:
        files = _open_locked(directory, layout, reformat_on_mismatch)
    except BaseException:
        os.close(lock_fd)
        raise
    files.lock_fd = lock_fd
    return files


def _lock_directory(directory: str) -> int:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(f"the disk tier directory {directory} is in use by another "
                             "daemon (or another tier of this one)") from None
    return fd


def _open_locked(directory: str, layout: Layout, reformat_on_mismatch: bool) -> OpenedFiles:
    meta_path = os.path.join(directory, META_NAME)
    meta = _read_meta(meta_path)
    formatted = False
    if meta is not None:
        problem = _mismatch(directory, meta, layout)
        if problem and not reformat_on_mismatch:
            raise LayoutMismatch(problem + "; set [ssd] reformat_on_mismatch = true to erase "
                                 "it and format anew, or configure the sizes it was made with")
        if problem:
            log.warning("ssd: %s; erasing it and formatting anew (reformat_on_mismatch)",
                        problem)
            _erase(directory, meta_path)
            meta = None
    if meta is None:
        meta = _format(directory, meta_path, layout)
        formatted = True
    fds: list[int] = []
    direct_io, reason = True, ""
    try:
        for index in range(layout.files):
            fd, why = _open_data_file(os.path.join(directory, DATA_NAME.format(index)),
                                      layout.block_bytes, direct_io)
            fds.append(fd)
            if why:
                direct_io, reason = False, why
                # The earlier files were opened with O_DIRECT: reopen them without it too.
                for earlier in range(index):
                    os.close(fds[earlier])
                    fds[earlier], _ = _open_data_file(
                        os.path.join(directory, DATA_NAME.format(earlier)),
                        layout.block_bytes, False)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return OpenedFiles(fds, int(meta["instance_id"]), formatted, direct_io, reason)


def _read_meta(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LayoutMismatch(f"{path} cannot be read as the tier's metadata ({exc}); "
                             "it is not a disk tier directory, or a damaged one") from None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int)
                                             for k in _META_KEYS + ("instance_id",)):
        raise LayoutMismatch(f"{path} is not the tier's metadata (keys {', '.join(_META_KEYS)}, "
                             "instance_id)")
    return meta


def _mismatch(directory: str, meta: dict, layout: Layout) -> str:
    wanted = layout.meta()
    differ = [f"{k}={meta[k]} (configured: {wanted[k]})" for k in _META_KEYS
              if meta[k] != wanted[k]]
    if differ:
        return (f"the disk tier directory {directory} was formatted with "
                + ", ".join(differ))
    for index in range(layout.files):
        path = os.path.join(directory, DATA_NAME.format(index))
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return f"the disk tier directory {directory} lacks its data file {path}"
        if size != layout.file_size(index):
            return (f"the disk tier data file {path} is {size} bytes, not "
                    f"{layout.file_size(index)}")
    return ""


def _erase(directory: str, meta_path: str) -> None:
    os.unlink(meta_path)
    _fsync_directory(directory)
    for name in sorted(os.listdir(directory)):
        if name.startswith("ssd-") and name.endswith(".data"):
            os.unlink(os.path.join(directory, name))


def _format(directory: str, meta_path: str, layout: Layout) -> dict:
    """Make every data file at its full size (zeros), then write ssd.meta: a directory
    without ssd.meta was never completely formatted."""
    for index in range(layout.files):
        path = os.path.join(directory, DATA_NAME.format(index))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, layout.file_size(index))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise LayoutFull(f"no room for the disk tier's data file {path} "
                                     f"({layout.file_size(index)} bytes): "
                                     f"{os.strerror(exc.errno)}") from None
                raise
            os.fsync(fd)
        finally:
            os.close(fd)
    meta = dict(layout.meta(), instance_id=secrets.randbits(63))
    temporary = meta_path + ".tmp"
    with open(temporary, "w") as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, meta_path)
    _fsync_directory(directory)
    return meta


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_data_file(path: str, block_bytes: int, direct: bool) -> tuple[int, str]:
    """(fd, reason O_DIRECT is off or ""). O_DIRECT is tried first; a file system that
    refuses it (tmpfs: EINVAL at open, some others at the first read) gets a plain open."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return os.open(path, flags), f"O_DIRECT refused at open of {path}: {exc.strerror}"
        probe = mmap.mmap(-1, block_bytes)  # page-aligned
        try:
            os.preadv(fd, [probe], 0)
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EINVAL:
                raise
            return (os.open(path, flags),
                    f"O_DIRECT refused at the first read of {path}: {exc.strerror}")
        finally:
            probe.close()
        return fd, ""
    return os.open(path, flags), ""
