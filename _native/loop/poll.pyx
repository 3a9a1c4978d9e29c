# Readiness on the ring: add_reader / add_writer, the loop's wake-up eventfd, signals.
#
# Owns: FDPoller (one per fd with a reader or writer callback: a one-shot POLL_ADD per
# direction, re-armed after the callback ran, which gives epoll's level-triggered
# behaviour), LoopWaker (a READ on an eventfd that call_soon_threadsafe writes to) and
# SignalReader (a RECV on the socket that signal.set_wakeup_fd writes signal numbers to).
# RDMA completion channels and CUDA host-callback eventfds join the loop through FDPoller.

from posix.unistd cimport close as fd_close, write as fd_write


cdef class FDPoller(IOHandle):
    cdef:
        int fd
        Handle reader
        Handle writer
        bint in_armed, out_armed          # a POLL_ADD is in flight
        bint in_removing, out_removing    # its POLL_REMOVE is queued

    @staticmethod
    cdef FDPoller new(UringLoop loop, int fd):
        cdef FDPoller poller = FDPoller.__new__(FDPoller)
        poller.loop = loop
        poller.fd = fd
        return poller

    cdef int _flush(self) except -1:
        cdef uring.io_uring_sqe *sqe
        self.flush_queued = False
        if self.reader is not None and not self.in_armed:
            sqe = self.loop.ring.sqe()
            uring.io_uring_prep_poll_add(sqe, self.fd, system.POLLIN)
            _op_track(self, sqe, OP_POLL_IN)
            self.in_armed = True
        if self.writer is not None and not self.out_armed:
            sqe = self.loop.ring.sqe()
            uring.io_uring_prep_poll_add(sqe, self.fd, system.POLLOUT)
            _op_track(self, sqe, OP_POLL_OUT)
            self.out_armed = True
        return 0

    cdef int set_callback(self, bint writing, Handle handle) except -1:
        if writing:
            old, self.writer = self.writer, handle
        else:
            old, self.reader = self.reader, handle
        if old is not None:
            old.cancel()
        self.loop._request_flush(self)
        return 0

    cdef bint remove_callback(self, bint writing) except -1:
        cdef Handle old
        if writing:
            old, self.writer = self.writer, None
        else:
            old, self.reader = self.reader, None
        if old is None:
            return False
        old.cancel()
        if writing and self.out_armed and not self.out_removing:
            self._remove_poll(OP_POLL_OUT)
            self.out_removing = True
        elif not writing and self.in_armed and not self.in_removing:
            self._remove_poll(OP_POLL_IN)
            self.in_removing = True
        self._forget_if_idle()
        return True

    cdef _remove_poll(self, int op):
        cdef uring.io_uring_sqe *sqe = self.loop.ring.sqe()
        uring.io_uring_prep_poll_remove(sqe, _op_data(self, op))
        uring.io_uring_sqe_set_data64(sqe, 0)  # its CQE is ignored; the poll's own follows

    cdef _forget_if_idle(self):
        if self.reader is None and self.writer is None and self.inflight == 0:
            if self.loop._pollers.get(self.fd) is self:
                del self.loop._pollers[self.fd]

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        cdef Handle handle
        if op == OP_POLL_IN:
            self.in_armed = self.in_removing = False
            handle = self.reader
        else:
            self.out_armed = self.out_removing = False
            handle = self.writer
        if handle is None or self.loop._closed:
            self._forget_if_idle()
            return 0
        if res < 0 and res != -system.ECANCELED:
            # The fd itself is bad (closed under us): report it once and stop watching.
            self.remove_callback(op == OP_POLL_OUT)
            self.loop.call_exception_handler({
                "message": f"polling fd {self.fd} failed",
                "exception": OSError(-res, strerror(-res).decode()), "handle": handle})
            return 0
        if res >= 0:
            self.loop._ready_push(handle)  # runs this iteration, as with asyncio's selector
        self.loop._request_flush(self)     # re-armed only after the callback has run
        return 0


cdef class LoopWaker(IOHandle):
    """The eventfd that call_soon_threadsafe writes to, so a waiting loop wakes up."""
    cdef:
        int efd
        uint64_t value       # the READ's target
        bint armed

    @staticmethod
    cdef LoopWaker new(UringLoop loop):
        cdef LoopWaker waker = LoopWaker.__new__(LoopWaker)
        waker.loop = loop
        waker.efd = system.eventfd(0, system.EFD_NONBLOCK | system.EFD_CLOEXEC)
        if waker.efd < 0:
            raise OSError(system.errno, "eventfd: " + strerror(system.errno).decode())
        return waker

    cdef int arm(self) except -1:
        cdef uring.io_uring_sqe *sqe
        if self.armed or self.efd < 0:
            return 0
        sqe = self.loop.ring.sqe()
        uring.io_uring_prep_read(sqe, self.efd, &self.value, 8, 0)
        _op_track(self, sqe, OP_READ)
        self.armed = True
        return 0

    cdef void wake(self) noexcept:
        cdef uint64_t one = 1
        fd_write(self.efd, &one, 8)  # EAGAIN would mean the counter is full: awake anyway

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        self.armed = False
        # Cleared before the ready queue runs: a thread that queued a callback before this
        # point has it run in this iteration; one after it writes the eventfd again.
        self.loop._wake_pending = False
        if not self.loop._closed:
            self.arm()
        return 0

    cdef close(self):
        if self.efd >= 0:
            fd_close(self.efd)
            self.efd = -1


cdef class SignalReader(IOHandle):
    """Reads the signal numbers Python's C handler writes to the set_wakeup_fd socket."""
    cdef:
        object rsock, wsock
        char buf[256]
        bint armed

    @staticmethod
    cdef SignalReader new(UringLoop loop):
        cdef SignalReader reader = SignalReader.__new__(SignalReader)
        reader.loop = loop
        reader.rsock, reader.wsock = socket.socketpair()
        reader.rsock.setblocking(False)
        reader.wsock.setblocking(False)
        return reader

    cdef int arm(self) except -1:
        cdef uring.io_uring_sqe *sqe
        if self.armed or self.rsock is None:
            return 0
        sqe = self.loop.ring.sqe()
        uring.io_uring_prep_recv(sqe, self.rsock.fileno(), self.buf, sizeof(self.buf), 0)
        _op_track(self, sqe, OP_READ)
        self.armed = True
        return 0

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        cdef int i
        self.armed = False
        if self.rsock is None or self.loop._closed:
            return 0
        for i in range(res):
            self.loop._handle_signal(<unsigned char>self.buf[i])
        self.arm()
        return 0

    cdef close(self):
        if self.rsock is not None:
            self.rsock.close()
            self.wsock.close()
            self.rsock = self.wsock = None
