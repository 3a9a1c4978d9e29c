# Raw memory copies between segment addresses, and buffer address lookup.
#
# Owns: copy_memory() (memcpy with the GIL released), new_bytes() and buffer_address()
# (the base address of a contiguous buffer-protocol object such as an mmap
# or a bytearray). Addresses are plain ints; the caller keeps the backing
# objects alive and the ranges valid for as long as it uses them.

from libc.string cimport memcpy
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE


def copy_memory(size_t target_address, size_t source_address, size_t size_bytes):
    """Copy size_bytes from source_address to target_address (non-overlapping).

    The GIL is released during the copy so large copies do not stall other
    Python threads. No bounds checks are possible here: the caller owns them.
    """
    if size_bytes == 0:
        return
    # A null address is the one misuse we can cheaply catch before crashing.
    if target_address == 0 or source_address == 0:
        raise ValueError("copy_memory: null address")
    with nogil:
        memcpy(<void*>target_address, <const void*>source_address, size_bytes)


def buffer_address(obj):
    """Return the base address (int) of a contiguous buffer-protocol object.

    Works for writable and read-only exporters (PyBUF_SIMPLE asks for no
    write access). The address stays valid only while `obj` is alive and not
    resized or closed; the buffer view is released before returning.
    """
    cdef Py_buffer view
    cdef size_t address
    PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)
    address = <size_t>view.buf
    PyBuffer_Release(&view)
    return address


from cpython.bytes cimport PyBytes_FromStringAndSize


def new_bytes(Py_ssize_t size_bytes):
    """A new bytes object of `size_bytes` whose contents are not initialised.

    For a reader that fills it before anyone else sees it (through buffer_address and
    copy_memory or a socket receive): a received value then costs no zero-fill and no second
    copy into an immutable object.
    """
    if size_bytes < 0:
        raise ValueError("new_bytes: negative size")
    return PyBytes_FromStringAndSize(NULL, size_bytes)
