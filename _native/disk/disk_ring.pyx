# The disk tier's own io_uring instance: file reads, writes and datasyncs.
#
# Owns: DiskRing. It is separate from the event loop's ring so that it works under any loop:
# the kernel signals an eventfd for every completion, the owner registers that eventfd with
# loop.add_reader and calls reap() when it is readable. Requests are queued with prep_*()
# and handed to the kernel together by one submit(); the caller bounds how many are queued
# and in flight (the ring has `entries` submission slots). Memory addresses are plain ints:
# the caller keeps the buffers alive until their request completes.

from libc.stdint cimport int32_t, uint64_t
from libc.string cimport memset, strerror
from posix.unistd cimport close as posix_close, read as posix_read

cimport includes.liburing as disk_uring
cimport includes.system as disk_system


cdef object _disk_ring_error(int err, str what):
    return OSError(err, f"{what}: {strerror(err).decode()}")


cdef class DiskRing:
    """A plain io_uring (no DEFER/COOP_TASKRUN: completions are posted, and the eventfd
    signalled, without waiting for this thread to enter the kernel)."""

    cdef:
        disk_uring.io_uring ring
        bint initialized
        int efd
        readonly unsigned entries
        readonly unsigned queued     # prepared, not yet submitted

    def __cinit__(self, unsigned entries):
        cdef int ret
        self.efd = -1
        ret = disk_uring.io_uring_queue_init(entries, &self.ring, 0)
        if ret < 0:
            raise _disk_ring_error(-ret, "io_uring_queue_init (disk ring)")
        self.initialized = True
        self.entries = self.ring.sq.ring_entries
        self.efd = disk_system.eventfd(0, disk_system.EFD_NONBLOCK | disk_system.EFD_CLOEXEC)
        if self.efd < 0:
            err = disk_system.errno
            self.close()
            raise _disk_ring_error(err, "eventfd")
        ret = disk_uring.io_uring_register_eventfd(&self.ring, self.efd)
        if ret < 0:
            self.close()
            raise _disk_ring_error(-ret, "io_uring_register_eventfd")

    def __dealloc__(self):
        self.close()

    @property
    def eventfd(self):
        """The descriptor that becomes readable when completions are waiting."""
        return self.efd

    def close(self):
        if self.initialized:
            self.initialized = False
            disk_uring.io_uring_queue_exit(&self.ring)
        if self.efd >= 0:
            posix_close(self.efd)
            self.efd = -1

    cdef disk_uring.io_uring_sqe *_sqe(self) except NULL:
        cdef disk_uring.io_uring_sqe *sqe
        if not self.initialized:
            raise ValueError("the disk ring is closed")
        sqe = disk_uring.io_uring_get_sqe(&self.ring)
        if sqe == NULL:
            raise BufferError("the disk ring's submission queue is full; submit() first")
        self.queued += 1
        return sqe

    def prep_read(self, int fd, size_t address, unsigned size_bytes, uint64_t offset,
                  uint64_t token):
        """Queue a read of size_bytes at file offset into memory at address."""
        cdef disk_uring.io_uring_sqe *sqe = self._sqe()
        disk_uring.io_uring_prep_read(sqe, fd, <void *>address, size_bytes, offset)
        disk_uring.io_uring_sqe_set_data64(sqe, token)

    def prep_write(self, int fd, size_t address, unsigned size_bytes, uint64_t offset,
                   uint64_t token):
        """Queue a write of size_bytes from memory at address to file offset."""
        cdef disk_uring.io_uring_sqe *sqe = self._sqe()
        disk_uring.io_uring_prep_write(sqe, fd, <const void *>address, size_bytes, offset)
        disk_uring.io_uring_sqe_set_data64(sqe, token)

    def prep_fsync(self, int fd, bint datasync, uint64_t token):
        """Queue an fsync (fdatasync when datasync) of fd."""
        cdef disk_uring.io_uring_sqe *sqe = self._sqe()
        disk_uring.io_uring_prep_fsync(sqe, fd,
                                       disk_uring.IORING_FSYNC_DATASYNC if datasync else 0)
        disk_uring.io_uring_sqe_set_data64(sqe, token)

    def submit(self):
        """Hand every queued request to the kernel in one call; returns how many went."""
        cdef int ret
        if not self.initialized:
            raise ValueError("the disk ring is closed")
        if self.queued == 0:
            return 0
        while True:
            ret = disk_uring.io_uring_submit(&self.ring)
            if ret != -disk_system.EINTR:
                break
        if ret < 0:
            raise _disk_ring_error(-ret, "io_uring_submit (disk ring)")
        self.queued -= min(<unsigned>ret, self.queued)
        return ret

    def reap(self):
        """Clear the eventfd and take every waiting completion: a list of (token, result),
        result being bytes moved or -errno."""
        cdef uint64_t counter
        cdef disk_uring.io_uring_cqe *cqes[64]
        cdef unsigned n, i
        if not self.initialized:
            return []
        # Clear first: a completion posted after this read signals the eventfd again.
        posix_read(self.efd, &counter, sizeof(counter))
        done = []
        while True:
            n = disk_uring.io_uring_peek_batch_cqe(&self.ring, cqes, 64)
            if n == 0:
                break
            for i in range(n):
                done.append((cqes[i].user_data, cqes[i].res))
            disk_uring.io_uring_cq_advance(&self.ring, n)
        return done
