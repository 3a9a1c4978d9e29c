"""Registered memory that lives in another process: a local client's tensors and buffers,
reached with process_vm_readv / process_vm_writev (Linux 3.2+).

The daemon serves a client's registered memory to peers and moves it for the client's own
transfers without the client mapping anything: the client registers (address, length) of its
own memory, and the daemon copies through the kernel, one copy between the two address spaces.
The pid comes from the Unix socket's SO_PEERCRED, never from the client's word.

Permission: the same as ptrace attach (PTRACE_MODE_ATTACH_REALCREDS): the daemon must run as
the client's user (or hold CAP_SYS_PTRACE), and with Yama's ptrace_scope = 1 the client must
name the daemon as its tracer (prctl(PR_SET_PTRACER, daemon_pid); mooncaked.transfer_engine
does it); ptrace_scope >= 2 needs CAP_SYS_PTRACE. register() probes one byte at each end of
the range, so a missing permission or an unmapped range fails at registration, not later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from .descriptors import RegisteredMemory


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
for _name in ("process_vm_readv", "process_vm_writev"):
    _function = getattr(_libc, _name)
    _function.restype = ctypes.c_ssize_t
    _function.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


class ProcessMemoryError(OSError):
    """A copy to or from the client failed (it exited, unmapped the range, or the daemon may
    not reach it)."""


def permission_hint(code: int) -> str:
    if code == errno.EPERM:
        return ("the daemon may not read this process's memory: run the daemon as the same "
                "user (or give it CAP_SYS_PTRACE); with kernel.yama.ptrace_scope = 1 the "
                "client must allow it with prctl(PR_SET_PTRACER, daemon_pid); "
                "ptrace_scope >= 2 needs CAP_SYS_PTRACE")
    if code == errno.ESRCH:
        return "the process has exited"
    if code == errno.EFAULT:
        return "the range is not mapped in the process"
    return os.strerror(code)


def _copy(function, pid: int, local_address: int, remote_address: int, length: int) -> None:
    """Copy `length` bytes between this process and `pid`, looping over partial copies."""
    done = 0
    while done < length:
        local = _IoVec(local_address + done, length - done)
        remote = _IoVec(remote_address + done, length - done)
        moved = function(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if moved < 0:
            code = ctypes.get_errno()
            raise ProcessMemoryError(code, f"pid {pid} [{remote_address + done:#x}, "
                                     f"+{length - done}): {permission_hint(code)}")
        if moved == 0:
            raise ProcessMemoryError(errno.EFAULT, f"pid {pid} [{remote_address + done:#x}, "
                                     f"+{length - done}): {permission_hint(errno.EFAULT)}")
        done += moved


def _address_of(buffer) -> int:
    """The address of a writable buffer (bytearray, writable memoryview)."""
    view = memoryview(buffer).cast("B")
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


def read_from(pid: int, remote_address: int, into) -> None:
    """Fill the writable buffer `into` from pid's [remote_address, +len(into))."""
    view = memoryview(into).cast("B")
    if len(view):
        _copy(_libc.process_vm_readv, pid, _address_of(view), remote_address, len(view))


def write_to(pid: int, remote_address: int, data) -> None:
    """Copy the buffer `data` into pid's [remote_address, +len(data))."""
    view = memoryview(data).cast("B")
    if not len(view):
        return
    if view.readonly:
        view = memoryview(bytearray(view))
    _copy(_libc.process_vm_writev, pid, _address_of(view), remote_address, len(view))


class ProcessRange:
    """[address, address + length) of process `pid`, inside one of its registered buffers."""
    __slots__ = ("pid", "address", "length")

    def __init__(self, pid: int, address: int, length: int) -> None:
        self.pid = pid
        self.address = address
        self.length = length

    def __len__(self) -> int:
        return self.length

    def read_into(self, offset: int, into) -> None:
        read_from(self.pid, self.address + offset, into)

    def write_from(self, offset: int, data) -> None:
        write_to(self.pid, self.address + offset, data)


class ProcessMemory(RegisteredMemory):
    """The registered buffers of one client process: RegisteredMemory's ranges and checks,
    but view() hands out ProcessRanges (copied through the kernel) instead of memoryviews,
    and registration probes that the daemon may reach the memory."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def _attach(self, address: int, length: int) -> None:
        probe = bytearray(1)
        for end in {address, address + length - 1}:  # raises ProcessMemoryError
            read_from(self.pid, end, probe)

    def _range(self, handle, start: int, offset: int, length: int) -> ProcessRange:
        return ProcessRange(self.pid, start + offset, length)
