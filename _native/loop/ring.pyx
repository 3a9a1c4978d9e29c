# The io_uring instance under one event loop: setup, probing, SQE supply, the wait.
#
# Owns: Ring (one struct io_uring, the flags it was set up with, a small batch of copied
# CQEs) and uring_probe(), which says whether this kernel and process allow such a ring.
# Nothing here knows about Python objects; loop.pyx maps CQEs back to their owners.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset, strerror
from cpython.exc cimport PyErr_CheckSignals
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cimport includes.liburing as uring
cimport includes.system as system


cdef enum:
    RING_SQ_ENTRIES = 256    # SQEs one iteration can queue before a forced submit
    RING_CQ_ENTRIES = 8192   # completions a burst (accepts, many connections) can park
    CQE_BATCH = 64           # CQEs copied out of the ring per peek

cdef struct CompletionEntry:
    uint64_t user_data
    int32_t res
    uint32_t flags


# Setups to try, best first. DEFER_TASKRUN runs completion work only inside our own
# io_uring_enter, on our thread: no inter-processor wake-ups, batches stay together (a
# cross-vCPU wake-up costs ~100 µs here). It needs SINGLE_ISSUER; R_DISABLED lets the thread
# that first runs the loop, not the one that built it, become that issuer.
cdef unsigned _RING_SETUPS[3]
_RING_SETUPS[0] = (uring.IORING_SETUP_SINGLE_ISSUER | uring.IORING_SETUP_DEFER_TASKRUN
                   | uring.IORING_SETUP_R_DISABLED)
_RING_SETUPS[1] = uring.IORING_SETUP_COOP_TASKRUN
_RING_SETUPS[2] = 0

# Ops the loop cannot run without.
_RING_REQUIRED_OPS = (
    ("RECV", uring.IORING_OP_RECV), ("SEND", uring.IORING_OP_SEND),
    ("SENDMSG", uring.IORING_OP_SENDMSG), ("ACCEPT", uring.IORING_OP_ACCEPT),
    ("POLL_ADD", uring.IORING_OP_POLL_ADD), ("POLL_REMOVE", uring.IORING_OP_POLL_REMOVE),
    ("ASYNC_CANCEL", uring.IORING_OP_ASYNC_CANCEL), ("READ", uring.IORING_OP_READ),
)


cdef object _ring_error(int err, str what):
    return OSError(err, f"{what}: {strerror(err).decode()}")


cdef class Ring:
    cdef:
        uring.io_uring ring
        bint initialized
        bint enabled          # R_DISABLED rings start on the first wait
        readonly unsigned setup_flags
        readonly bint send_zc         # IORING_OP_SEND_ZC is known to this kernel
        public bint multishot_accept  # cleared if the kernel turns it down
        public int64_t busy_poll_ns   # spin this long for completions before sleeping
        CompletionEntry cqes[CQE_BATCH]
        int cqe_pos                   # cqes[cqe_pos:cqe_end] are copied, not yet handled
        int cqe_end

    def __cinit__(self):
        cdef uring.io_uring_params params
        cdef int ret = -1
        cdef int i
        for i in range(3):
            memset(&params, 0, sizeof(params))
            params.flags = _RING_SETUPS[i] | uring.IORING_SETUP_CQSIZE
            params.cq_entries = RING_CQ_ENTRIES
            ret = uring.io_uring_queue_init_params(RING_SQ_ENTRIES, &self.ring, &params)
            if ret != -system.EINVAL:
                break  # only EINVAL means "this kernel does not know a flag": try the next
        if ret < 0:
            raise _ring_error(-ret, "io_uring_queue_init")
        self.initialized = True
        self.setup_flags = _RING_SETUPS[i]
        self.enabled = not (self.setup_flags & uring.IORING_SETUP_R_DISABLED)
        self.multishot_accept = True
        self._probe_ops()

    def __dealloc__(self):
        if self.initialized:
            uring.io_uring_queue_exit(&self.ring)

    cdef _probe_ops(self):
        cdef uring.io_uring_probe *probe = uring.io_uring_get_probe_ring(&self.ring)
        if probe == NULL:
            return
        try:
            self.send_zc = uring.io_uring_opcode_supported(probe, uring.IORING_OP_SEND_ZC)
            missing = [name for name, op in _RING_REQUIRED_OPS
                       if not uring.io_uring_opcode_supported(probe, op)]
        finally:
            uring.io_uring_free_probe(probe)
        if missing:
            self.close()
            raise OSError(system.EINVAL, "io_uring lacks ops " + ", ".join(missing))

    @property
    def mode(self):
        if self.setup_flags & uring.IORING_SETUP_DEFER_TASKRUN:
            return "defer_taskrun"
        if self.setup_flags & uring.IORING_SETUP_COOP_TASKRUN:
            return "coop_taskrun"
        return "plain"

    @property
    def fd(self):
        return self.ring.ring_fd if self.initialized else -1

    cdef close(self):
        if self.initialized:
            self.initialized = False
            uring.io_uring_queue_exit(&self.ring)

    cdef int _enable(self) except -1:
        cdef int ret = uring.io_uring_register(self.ring.ring_fd,
                                               uring.IORING_REGISTER_ENABLE_RINGS, NULL, 0)
        if ret < 0:
            raise _ring_error(-ret, "io_uring_enable_rings")
        self.enabled = True
        return 0

    cdef inline uring.io_uring_sqe *sqe(self) except NULL:
        """A free SQE; the caller must fill it completely before calling any Python code."""
        cdef uring.io_uring_sqe *sqe = uring.io_uring_get_sqe(&self.ring)
        if sqe == NULL:
            self.submit()  # the SQ is full: hand the kernel what we have
            sqe = uring.io_uring_get_sqe(&self.ring)
            if sqe == NULL:
                raise RuntimeError("io_uring submission queue stays full")
        return sqe

    cdef int submit(self) except -1:
        cdef int ret
        if not self.enabled:
            self._enable()
        ret = uring.io_uring_submit(&self.ring)
        if ret < 0 and ret != -system.EBUSY and ret != -system.EAGAIN:
            self._raise_enter(ret)
        return 0

    cdef int wait(self, int64_t timeout_ns) except -1:
        """Submit what is queued, then wait up to timeout_ns (-1: forever) for a completion.

        The GIL is released for any wait, so other threads (executor, metrics) run meanwhile.
        """
        cdef uring.__kernel_timespec ts
        cdef uring.io_uring_cqe *cqe = NULL
        cdef int ret
        if not self.enabled:
            self._enable()
        if timeout_ns == 0:
            # Still one io_uring_enter: with DEFER_TASKRUN completions are only posted there.
            ret = uring.io_uring_submit_and_get_events(&self.ring)
        else:
            with nogil:
                ret = 0
                if self.busy_poll_ns > 0:
                    ret = _busy_poll(&self.ring, self.busy_poll_ns if timeout_ns < 0 else
                                     min(self.busy_poll_ns, timeout_ns))
                    if ret == 0 and timeout_ns > 0:
                        timeout_ns = max(timeout_ns - self.busy_poll_ns, 1)
                if ret == 0 and timeout_ns < 0:
                    ret = uring.io_uring_submit_and_wait_timeout(&self.ring, &cqe, 1, NULL, NULL)
                elif ret == 0:
                    ts.tv_sec = timeout_ns // 1000000000
                    ts.tv_nsec = timeout_ns % 1000000000
                    ret = uring.io_uring_submit_and_wait_timeout(&self.ring, &cqe, 1, &ts, NULL)
        if ret >= 0 or ret == -system.ETIME or ret == -system.EAGAIN or ret == -system.EBUSY:
            return 0
        if ret == -system.EINTR:
            PyErr_CheckSignals()  # a signal: run Python's handlers now (KeyboardInterrupt)
            return 0
        self._raise_enter(ret)

    cdef int _raise_enter(self, int ret) except -1:
        if ret == -system.EEXIST:
            raise RuntimeError("the io_uring loop was first run by another thread; a ring set "
                               "up with SINGLE_ISSUER only accepts that thread's submissions")
        raise _ring_error(-ret, "io_uring_enter")

    cdef int reap(self) noexcept:
        """Copy up to CQE_BATCH completions out of the CQ (and free their slots)."""
        cdef uring.io_uring_cqe *ptrs[CQE_BATCH]
        cdef unsigned n = uring.io_uring_peek_batch_cqe(&self.ring, ptrs, CQE_BATCH)
        cdef unsigned i
        for i in range(n):
            self.cqes[i].user_data = ptrs[i].user_data
            self.cqes[i].res = ptrs[i].res
            self.cqes[i].flags = ptrs[i].flags
        if n:
            uring.io_uring_cq_advance(&self.ring, n)
        self.cqe_pos = 0
        self.cqe_end = n
        return n


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int _busy_poll(uring.io_uring *ring, int64_t budget_ns) noexcept nogil:
    """Poll for completions for up to budget_ns before sleeping: 1 if some arrived, 0 if
    not, or -errno. Sleeping costs a wake-up when the next request comes, and a wake-up
    across vCPUs costs ~100 µs on these VMs; a short spin answers a ping-pong peer first."""
    cdef int64_t deadline = _now_ns() + budget_ns
    cdef int ret = uring.io_uring_submit_and_get_events(ring)
    while True:
        if ret < 0 and ret != -system.EAGAIN and ret != -system.EBUSY and ret != -system.EINTR:
            return ret
        if uring.io_uring_cq_ready(ring):
            return 1
        if _now_ns() >= deadline:
            return 0
        ret = uring.io_uring_get_events(ring)


def uring_probe():
    """(usable, reason): can this process run the io_uring loop?

    Sets up a ring the way the loop does, runs one NOP through it and tears it down. The
    reason names the failing step (disabled by sysctl or seccomp, too old a kernel, memlock).
    """
    cdef Ring ring
    cdef uring.io_uring_sqe *sqe
    try:
        ring = Ring()
    except OSError as exc:
        return False, _probe_hint(exc)
    try:
        sqe = ring.sqe()
        uring.io_uring_prep_nop(sqe)
        uring.io_uring_sqe_set_data64(sqe, 0)
        ring.wait(1000000000)
        if ring.reap() != 1:
            return False, "io_uring: a NOP did not complete"
    except OSError as exc:
        return False, _probe_hint(exc)
    finally:
        ring.close()
    return True, f"io_uring ({ring.mode}{', send_zc' if ring.send_zc else ''})"


cdef str _probe_hint(exc):
    hint = ""
    if exc.errno == system.ENOSYS:
        hint = " (kernel built without io_uring, or too old)"
    elif exc.errno == system.EPERM:
        hint = " (disabled by sysctl kernel.io_uring_disabled or a seccomp filter)"
    elif exc.errno == system.ENOMEM:
        hint = " (RLIMIT_MEMLOCK too small for the rings)"
    return f"{exc.strerror or exc}{hint} [errno {exc.errno}]"
