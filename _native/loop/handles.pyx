# Callback handles, and the base class of everything that has ops in flight on the ring.
#
# Owns: Handle / TimerHandle (what call_soon / call_at return and the loop runs; the same
# interface as asyncio.Handle / asyncio.TimerHandle), IOHandle (an owner of ring ops: a CQE's
# user_data is the owner's address with the op kind in the low 3 bits, and every op in
# flight holds one reference to its owner) and the OP_* kinds.

from libc.stdint cimport uintptr_t
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit
from cpython.ref cimport Py_INCREF, PyObject


cdef enum:
    OP_RECV = 1
    OP_SEND = 2
    OP_ACCEPT = 3
    OP_POLL_IN = 4
    OP_POLL_OUT = 5
    OP_READ = 6
    OP_KIND_MASK = 7  # objects are at least 8-byte aligned, so 3 bits are free


cdef class Handle:
    cdef:
        object callback
        tuple args
        object context
        UringLoop loop
        bint _cancelled
        object __weakref__

    def cancel(self):
        if not self._cancelled:
            self._cancelled = True
            self.callback = None  # drop what the callback keeps alive, as asyncio does
            self.args = None

    def cancelled(self):
        return self._cancelled

    def get_context(self):
        return self.context

    cdef int _run(self) except -1:
        callback = self.callback
        context = self.context
        PyContext_Enter(context)
        try:
            callback(*self.args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            self.loop._callback_failed(self, callback, exc)
        finally:
            PyContext_Exit(context)
        return 0

    def _format(self):
        if self._cancelled:
            return "cancelled"
        return _format_callback(self.callback, self.args)

    def __repr__(self):
        return f"<{type(self).__name__} {self._format()}>"


cdef class TimerHandle(Handle):
    cdef:
        double _when
        uint64_t _seq        # order of call_at calls: equal deadlines run first-in first-out
        bint _scheduled      # in the loop's heap

    def when(self):
        return self._when

    def cancel(self):
        if not self._cancelled:
            if self._scheduled:
                self.loop._timer_cancelled()
            Handle.cancel(self)

    def __repr__(self):
        return f"<{type(self).__name__} when={self._when} {self._format()}>"


cdef inline Handle _new_handle(UringLoop loop, object callback, tuple args, object context):
    cdef Handle handle = Handle.__new__(Handle)
    handle.loop = loop
    handle.callback = callback
    handle.args = args
    handle.context = PyContext_CopyCurrent() if context is None else context
    return handle


def _format_callback(callback, args):
    try:
        from asyncio.format_helpers import _format_callback_source
        return _format_callback_source(callback, args or ())
    except Exception:  # a private helper: never let a repr fail over it
        return repr(callback)


cdef class IOHandle:
    """An owner of ring ops (transport, listener, fd poller, the loop's own wake-ups)."""
    cdef:
        UringLoop loop
        int inflight        # ops whose last CQE has not arrived yet
        bint flush_queued   # in the loop's flush list

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        return 0

    cdef int _flush(self) except -1:
        """Right before the loop enters the kernel: prepare the SQEs this owner deferred."""
        return 0

    cdef void _abandon(self, int op) noexcept:
        """The loop is closing and this op is done: free what it held, call nothing."""
        pass


cdef inline uint64_t _op_data(IOHandle owner, int op) noexcept:
    return <uint64_t><uintptr_t><PyObject *>owner | <uint64_t>op


cdef inline void _op_track(IOHandle owner, uring.io_uring_sqe *sqe, int op) noexcept:
    """Tag a filled SQE with its owner; the op keeps the owner alive until its last CQE."""
    uring.io_uring_sqe_set_data64(sqe, _op_data(owner, op))
    Py_INCREF(owner)
    owner.inflight += 1
    owner.loop._ops_inflight += 1


cdef int _op_cancel(IOHandle owner, int op) except -1:
    """Ask the kernel to cancel owner's op; its CQE then comes back with -ECANCELED."""
    cdef uring.io_uring_sqe *sqe = owner.loop.ring.sqe()
    uring.io_uring_prep_cancel64(sqe, _op_data(owner, op), 0)
    uring.io_uring_sqe_set_data64(sqe, 0)  # the cancel's own CQE is ignored
    return 0
