# An asyncio event loop over io_uring, in the manner of uvloop over libuv.
#
# Owns: UringLoop, the scheduler (ready queue, timer heap, the one io_uring_enter per
# iteration that submits the iteration's SQEs and waits for the next completions with the
# GIL released) and the asyncio.AbstractEventLoop methods the daemon and its clients use.
# mooncaked/io/uring.py mixes it with asyncio.AbstractEventLoop so isinstance checks pass.
#
# One iteration (_run_once):
#   1. the timeout: 0 if callbacks are ready, else until the earliest timer, else forever;
#   2. flush: every IOHandle that deferred work (sends, re-armed polls) fills its SQEs;
#   3. one io_uring_enter: submit them all, wait for a completion or the timeout;
#   4. completions: each CQE goes to its owner (a transport calls its protocol directly);
#   5. due timers join the ready queue; the callbacks ready at that moment run.
#
# The other files, included below, each say what they own.

import asyncio
import collections.abc
import concurrent.futures
import errno as pyerrno
import itertools
import logging
import os
import signal
import socket
import stat
import sys
import threading
import weakref

from asyncio import events as aio_events
from asyncio import futures as aio_futures
from asyncio import tasks as aio_tasks
from asyncio import trsock as aio_trsock

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport strerror
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject

cimport includes.liburing as uring
cimport includes.system as system

aio_logger = logging.getLogger("asyncio")
aio_BufferedProtocol = asyncio.BufferedProtocol
aio_CancelledError = asyncio.CancelledError
aio_sleep = asyncio.sleep
aio_iscoroutine = asyncio.iscoroutine
aio_iscoroutinefunction = asyncio.iscoroutinefunction


cdef class UringLoop
cdef class UringServer

include "ring.pyx"
include "handles.pyx"
include "timers.pyx"
include "poll.pyx"
include "transport.pyx"
include "server.pyx"


cdef enum:
    READY_QUEUE_MIN = 64
    FLUSH_LIST_MIN = 64
    MAX_CQES_PER_ITERATION = 8192  # completions handled before the ready callbacks get a turn


def _sighandler_noop(signum, frame):
    """Python-level stand-in: the C handler's write to the wake-up fd is what matters."""


def _run_until_complete_cb(fut):
    if not fut.cancelled():
        exc = fut.exception()
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            return  # the loop is about to stop with it anyway
    aio_futures._get_loop(fut).stop()


cdef int _fileobj_to_fd(fileobj) except -1:
    if isinstance(fileobj, int):
        fd = fileobj
    else:
        try:
            fd = int(fileobj.fileno())
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"Invalid file object: {fileobj!r}") from None
    if fd < 0:
        raise ValueError(f"Invalid file descriptor: {fd}")
    return fd


def _ipaddr_info(host, port, family, type, proto):
    """getaddrinfo's answer for a numeric host, without a thread (asyncio does the same)."""
    if not hasattr(socket, "inet_pton") or type != socket.SOCK_STREAM or host is None:
        return None
    if proto not in (0, socket.IPPROTO_TCP):
        return None
    if port is None:
        port = 0
    elif isinstance(port, bytes) and port == b"":
        port = 0
    elif isinstance(port, str) and port == "":
        port = 0
    else:
        try:
            port = int(port)
        except (TypeError, ValueError):
            return None
    if family == socket.AF_UNSPEC:
        families = [socket.AF_INET, socket.AF_INET6]
    else:
        families = [family]
    if isinstance(host, bytes):
        host = host.decode("idna")
    if "%" in host:
        return None  # a scope id needs the real getaddrinfo
    for af in families:
        try:
            socket.inet_pton(af, host)
        except OSError:
            continue
        if af == socket.AF_INET6:
            return af, type, socket.IPPROTO_TCP, "", (host, port, 0, 0)
        return af, type, socket.IPPROTO_TCP, "", (host, port)
    return None


cdef class UringLoop:
    cdef:
        Ring ring
        # ready queue: a ring of owned Handle references, capacity a power of two
        PyObject **_rq
        Py_ssize_t _rq_cap, _rq_head, _rq_len
        list _timers
        Py_ssize_t _timers_cancelled
        uint64_t _timer_seq
        # owners with deferred SQEs (owned references); two arrays, swapped per iteration
        PyObject **_flush
        PyObject **_flushing
        Py_ssize_t _flush_cap, _flush_len
        Py_ssize_t _ops_inflight
        bint _stopping
        bint _closed
        bint _debug
        bint _wake_pending
        object _thread_id
        LoopWaker _waker
        SignalReader _signals
        dict _signal_handlers
        dict _pollers
        object _exception_handler
        object _task_factory
        object _default_executor
        bint _executor_shutdown_called
        bint _asyncgens_shutdown_called
        object _asyncgens
        object __weakref__
        public double slow_callback_duration

    def __cinit__(self):
        self._rq = NULL
        self.ring = Ring()
        self._timers = []
        self._signal_handlers = {}
        self._pollers = {}
        self._asyncgens = weakref.WeakSet()
        self.slow_callback_duration = 0.1
        self._debug = aio_coroutines_debug()
        self._rq = <PyObject **>malloc(READY_QUEUE_MIN * sizeof(PyObject *))
        if self._rq == NULL:
            raise MemoryError()
        self._rq_cap = READY_QUEUE_MIN
        self._flush = <PyObject **>malloc(FLUSH_LIST_MIN * sizeof(PyObject *))
        self._flushing = <PyObject **>malloc(FLUSH_LIST_MIN * sizeof(PyObject *))
        if self._flush == NULL or self._flushing == NULL:
            raise MemoryError()
        self._flush_cap = FLUSH_LIST_MIN
        self._waker = LoopWaker.new(self)
        self._waker.arm()

    def __dealloc__(self):
        while self._rq_len:
            Py_DECREF(<object>self._rq[self._rq_head])
            self._rq_head = (self._rq_head + 1) & (self._rq_cap - 1)
            self._rq_len -= 1
        if self._rq != NULL:
            free(self._rq)
        self._drop_flush_list()
        free(self._flush)
        free(self._flushing)

    def __repr__(self):
        return (f"<{type(self).__name__} running={self.is_running()} "
                f"closed={self._closed} debug={self._debug}>")

    # -- the ready queue ------------------------------------------------------------------

    cdef inline int _ready_push(self, Handle handle) except -1:
        if self._rq_len == self._rq_cap:
            self._ready_grow()
        Py_INCREF(handle)
        self._rq[(self._rq_head + self._rq_len) & (self._rq_cap - 1)] = <PyObject *>handle
        self._rq_len += 1
        return 0

    cdef int _ready_grow(self) except -1:
        cdef Py_ssize_t i, cap = self._rq_cap * 2
        cdef PyObject **grown = <PyObject **>malloc(cap * sizeof(PyObject *))
        if grown == NULL:
            raise MemoryError()
        for i in range(self._rq_len):
            grown[i] = self._rq[(self._rq_head + i) & (self._rq_cap - 1)]
        free(self._rq)
        self._rq = grown
        self._rq_cap = cap
        self._rq_head = 0
        return 0

    cdef inline Handle _ready_pop(self):
        cdef PyObject *item = self._rq[self._rq_head]
        self._rq_head = (self._rq_head + 1) & (self._rq_cap - 1)
        self._rq_len -= 1
        handle = <Handle>item  # a new reference; the queue's own is dropped next
        Py_DECREF(handle)
        return handle

    cdef int _request_flush(self, IOHandle owner) except -1:
        cdef PyObject **grown
        if owner.flush_queued:
            return 0
        if self._flush_len == self._flush_cap:
            grown = <PyObject **>realloc(self._flush, 2 * self._flush_cap * sizeof(PyObject *))
            if grown == NULL:
                raise MemoryError()
            self._flush = grown
            grown = <PyObject **>realloc(self._flushing, 2 * self._flush_cap * sizeof(PyObject *))
            if grown == NULL:
                raise MemoryError()
            self._flushing = grown
            self._flush_cap *= 2
        owner.flush_queued = True
        Py_INCREF(owner)
        self._flush[self._flush_len] = <PyObject *>owner
        self._flush_len += 1
        return 0

    cdef void _drop_flush_list(self) noexcept:
        while self._flush_len:
            self._flush_len -= 1
            (<IOHandle>self._flush[self._flush_len]).flush_queued = False
            Py_DECREF(<object>self._flush[self._flush_len])

    # -- running --------------------------------------------------------------------------

    cdef int _run_once(self) except -1:
        cdef int64_t timeout_ns = -1
        cdef TimerHandle timer
        cdef Handle handle
        cdef Py_ssize_t i, ntodo
        cdef double end_time
        cdef list timers = self._timers
        cdef Py_ssize_t count = len(timers)

        # Drop cancelled timers: all of them when they are most of the heap, else from the top.
        if count > 100 and self._timers_cancelled * 2 > count:
            kept = []
            for timer in timers:
                if timer._cancelled:
                    timer._scheduled = False
                else:
                    kept.append(timer)
            _heapify(kept)
            self._timers = timers = kept
            self._timers_cancelled = 0
        else:
            while timers and (<TimerHandle>timers[0])._cancelled:
                timer = _heap_pop(timers)
                timer._scheduled = False
                self._timers_cancelled -= 1

        if self._rq_len or self._stopping:
            timeout_ns = 0
        elif timers:
            timeout_ns = _timeout_ns((<TimerHandle>timers[0])._when - _monotonic())

        self._flush_pending()
        self.ring.wait(timeout_ns)
        self._process_completions()

        end_time = _monotonic() + 1e-9  # asyncio's clock resolution
        while timers:
            timer = timers[0]
            if timer._when >= end_time:
                break
            _heap_pop(timers)
            timer._scheduled = False
            self._ready_push(timer)

        # Only what is ready now: callbacks they schedule wait for the next iteration.
        ntodo = self._rq_len
        for i in range(ntodo):
            handle = self._ready_pop()
            if not handle._cancelled:
                handle._run()
        return 0

    cdef int _flush_pending(self) except -1:
        cdef PyObject **pending = self._flush
        cdef Py_ssize_t i, j, count = self._flush_len
        cdef IOHandle owner
        if count == 0:
            return 0
        # Swap arrays: owners queued while flushing (none today) go to the next iteration.
        self._flush, self._flushing = self._flushing, pending
        self._flush_len = 0
        for i in range(count):
            owner = <IOHandle>pending[i]  # a new reference; the array's is dropped now
            Py_DECREF(owner)
            pending[i] = NULL
            try:
                owner._flush()
            except BaseException:
                for j in range(i + 1, count):  # keep the rest for the next iteration
                    owner = <IOHandle>pending[j]
                    Py_DECREF(owner)
                    owner.flush_queued = False
                    self._request_flush(owner)
                raise
        return 0

    cdef int _process_completions(self) except -1:
        cdef Ring ring = self.ring
        cdef CompletionEntry *entry
        cdef IOHandle owner
        cdef int handled = 0
        while handled < MAX_CQES_PER_ITERATION:
            if ring.cqe_pos == ring.cqe_end:
                if ring.reap() == 0:
                    break
            entry = &ring.cqes[ring.cqe_pos]
            ring.cqe_pos += 1  # first: a raising handler must not see its CQE again
            handled += 1
            if entry.user_data == 0:
                continue  # cancel and poll-remove requests report here; nothing to do
            owner = <IOHandle><PyObject *><uintptr_t>(entry.user_data & ~(<uint64_t>OP_KIND_MASK))
            if not (entry.flags & uring.IORING_CQE_F_MORE):
                owner.inflight -= 1  # the op's last CQE: `owner` takes over its reference
                self._ops_inflight -= 1
                Py_DECREF(owner)
            owner._on_cqe(<int>(entry.user_data & OP_KIND_MASK), entry.res, entry.flags)
        return 0

    def run_forever(self):
        """Run until stop() is called."""
        self._check_closed()
        self._check_running()
        old_agen_hooks = sys.get_asyncgen_hooks()
        self._thread_id = threading.get_ident()
        sys.set_asyncgen_hooks(firstiter=self._asyncgen_firstiter_hook,
                               finalizer=self._asyncgen_finalizer_hook)
        aio_events._set_running_loop(self)
        try:
            while True:
                self._run_once()
                if self._stopping:
                    break
        finally:
            self._stopping = False
            self._thread_id = None
            aio_events._set_running_loop(None)
            sys.set_asyncgen_hooks(*old_agen_hooks)

    def run_until_complete(self, future):
        """Run until the future (or coroutine) is done; return its result."""
        self._check_closed()
        self._check_running()
        new_task = not aio_futures.isfuture(future)
        future = aio_tasks.ensure_future(future, loop=self)
        if new_task:
            future._log_destroy_pending = False  # an exception stops the loop: no warning
        future.add_done_callback(_run_until_complete_cb)
        try:
            self.run_forever()
        except:
            if new_task and future.done() and not future.cancelled():
                future.exception()  # mark it retrieved
            raise
        finally:
            future.remove_done_callback(_run_until_complete_cb)
        if not future.done():
            raise RuntimeError("Event loop stopped before Future completed.")
        return future.result()

    def stop(self):
        self._stopping = True

    def set_busy_poll(self, microseconds):
        """Before sleeping, poll for completions this long (0, the default: never).

        Pays when the loop has a vCPU to itself and its peers answer quickly: each sleep
        then costs a wake-up (~100 µs across vCPUs on these VMs) that the spin avoids. It
        costs CPU while idle, and on a vCPU shared with its peers it delays them.
        """
        if microseconds < 0:
            raise ValueError("busy poll time must be >= 0")
        self.ring.busy_poll_ns = int(microseconds * 1000)

    def get_busy_poll(self):
        return self.ring.busy_poll_ns / 1000

    def is_running(self):
        return self._thread_id is not None

    def is_closed(self):
        return self._closed

    def close(self):
        """Close the loop: signal handlers go, in-flight ops are cancelled, fds are closed.

        Transports still open stay open (as with asyncio); their sockets close when they do.
        """
        if self.is_running():
            raise RuntimeError("Cannot close a running event loop")
        if self._closed:
            return
        for sig in list(self._signal_handlers):
            self.remove_signal_handler(sig)
        self._closed = True
        while self._rq_len:
            self._ready_pop()
        for timer in self._timers:
            (<TimerHandle>timer)._scheduled = False
        self._timers = []
        self._drop_flush_list()
        executor, self._default_executor = self._default_executor, None
        if executor is not None:
            executor.shutdown(wait=False)
        self._drain_ring()
        self._waker.close()
        if self._signals is not None:
            self._signals.close()
        self.ring.close()

    cdef _drain_ring(self):
        """Cancel every op and collect its last CQE, so no buffer is left to the kernel."""
        if not self.ring.initialized:
            return
        try:
            self._drain_ring_ops()
        except (OSError, RuntimeError) as exc:
            # E.g. closed from a thread the ring does not accept: io_uring_queue_exit still
            # cancels everything in the kernel; the owners left stay alive (and leak).
            aio_logger.debug("%r: draining the ring failed: %s", self, exc)

    cdef _drain_ring_ops(self):
        cdef uring.io_uring_sqe *sqe
        cdef CompletionEntry *entry
        cdef IOHandle owner
        cdef double deadline
        # A loop that never ran still has its queued SQEs (the wake-up READ, say): they are
        # submitted here, then cancelled with the rest.
        self.ring.busy_poll_ns = 0
        sqe = self.ring.sqe()
        uring.io_uring_prep_cancel64(sqe, 0, uring.IORING_ASYNC_CANCEL_ANY
                                     | uring.IORING_ASYNC_CANCEL_ALL)
        uring.io_uring_sqe_set_data64(sqe, 0)
        deadline = _monotonic() + 2.0
        while self._ops_inflight > 0 and _monotonic() < deadline:
            self.ring.wait(100000000)
            while True:
                if self.ring.cqe_pos == self.ring.cqe_end:
                    if self.ring.reap() == 0:
                        break
                entry = &self.ring.cqes[self.ring.cqe_pos]
                self.ring.cqe_pos += 1
                if entry.user_data == 0 or (entry.flags & uring.IORING_CQE_F_MORE):
                    continue
                owner = <IOHandle><PyObject *><uintptr_t>(
                    entry.user_data & ~(<uint64_t>OP_KIND_MASK))
                owner.inflight -= 1
                self._ops_inflight -= 1
                owner._abandon(<int>(entry.user_data & OP_KIND_MASK))
                Py_DECREF(owner)
        # Whatever did not come back within the deadline keeps its owner (and buffers) alive.

    cdef _check_closed(self):
        if self._closed:
            raise RuntimeError("Event loop is closed")

    cdef _check_running(self):
        if self.is_running():
            raise RuntimeError("This event loop is already running")
        if aio_events._get_running_loop() is not None:
            raise RuntimeError("Cannot run the event loop while another loop is running")

    # -- callbacks and timers -------------------------------------------------------------

    def time(self):
        return _monotonic()

    def call_soon(self, callback, *args, context=None):
        self._check_closed()
        if self._debug:
            self._check_callback(callback, "call_soon")
        cdef Handle handle = _new_handle(self, callback, args, context)
        self._ready_push(handle)
        return handle

    def call_soon_threadsafe(self, callback, *args, context=None):
        self._check_closed()
        if self._debug:
            self._check_callback(callback, "call_soon_threadsafe")
        cdef Handle handle = _new_handle(self, callback, args, context)
        self._ready_push(handle)
        if not self._wake_pending:
            self._wake_pending = True
            self._waker.wake()
        return handle

    def call_later(self, delay, callback, *args, context=None):
        if delay is None:
            raise TypeError("delay must not be None")
        return self._call_at(_monotonic() + delay, callback, args, context)

    def call_at(self, when, callback, *args, context=None):
        if when is None:
            raise TypeError("when cannot be None")
        return self._call_at(when, callback, args, context)

    cdef TimerHandle _call_at(self, double when, callback, tuple args, context):
        self._check_closed()
        if self._debug:
            self._check_callback(callback, "call_at")
        cdef TimerHandle timer = TimerHandle.__new__(TimerHandle)
        timer.loop = self
        timer.callback = callback
        timer.args = args
        timer.context = PyContext_CopyCurrent() if context is None else context
        timer._when = when
        self._timer_seq += 1
        timer._seq = self._timer_seq
        timer._scheduled = True
        _heap_push(self._timers, timer)
        return timer

    cdef _timer_cancelled(self):
        self._timers_cancelled += 1

    cdef _check_callback(self, callback, method):
        if aio_iscoroutine(callback) or aio_iscoroutinefunction(callback):
            raise TypeError(f"coroutines cannot be used with {method}()")
        if not callable(callback):
            raise TypeError(f"a callable object was expected by {method}(), got {callback!r}")

    cdef _callback_failed(self, Handle handle, callback, exc):
        self.call_exception_handler({
            "message": f"Exception in callback {_format_callback(callback, handle.args)}",
            "exception": exc, "handle": handle})

    # -- futures and tasks ----------------------------------------------------------------

    def create_future(self):
        return aio_futures.Future(loop=self)

    def create_task(self, coro, *, name=None, context=None):
        self._check_closed()
        if self._task_factory is None:
            task = aio_tasks.Task(coro, loop=self, name=name, context=context)
        else:
            if context is None:
                task = self._task_factory(self, coro)
            else:
                task = self._task_factory(self, coro, context=context)
            if name is not None:
                try:
                    task.set_name(name)
                except AttributeError:
                    pass
        return task

    def set_task_factory(self, factory):
        if factory is not None and not callable(factory):
            raise TypeError("task factory must be a callable or None")
        self._task_factory = factory

    def get_task_factory(self):
        return self._task_factory

    def get_debug(self):
        return self._debug

    def set_debug(self, enabled):
        self._debug = bool(enabled)

    # -- errors ---------------------------------------------------------------------------

    def get_exception_handler(self):
        return self._exception_handler

    def set_exception_handler(self, handler):
        if handler is not None and not callable(handler):
            raise TypeError(f"A callable object or None is expected, got {handler!r}")
        self._exception_handler = handler

    def default_exception_handler(self, context):
        """Log the context as asyncio's default handler does."""
        message = context.get("message") or "Unhandled exception in event loop"
        exception = context.get("exception")
        exc_info = (type(exception), exception, exception.__traceback__) \
            if exception is not None else False
        lines = [message]
        for key in sorted(context):
            if key in ("message", "exception"):
                continue
            value = context[key]
            lines.append(f"{key}: {value!r}")
        aio_logger.error("\n".join(lines), exc_info=exc_info)

    def call_exception_handler(self, context):
        if self._exception_handler is None:
            try:
                self.default_exception_handler(context)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException:
                aio_logger.error("Exception in default exception handler", exc_info=True)
            return
        try:
            self._exception_handler(self, context)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            try:
                self.default_exception_handler({
                    "message": "Unhandled error in exception handler",
                    "exception": exc, "context": context})
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException:
                aio_logger.error("Exception in default exception handler while handling an "
                                 "unexpected error in custom exception handler", exc_info=True)

    # -- threads --------------------------------------------------------------------------

    def run_in_executor(self, executor, func, *args):
        self._check_closed()
        if executor is None:
            executor = self._default_executor
            if self._executor_shutdown_called:
                raise RuntimeError("Executor shutdown has been called")
            if executor is None:
                executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="asyncio")
                self._default_executor = executor
        return aio_futures.wrap_future(executor.submit(func, *args), loop=self)

    def set_default_executor(self, executor):
        if not isinstance(executor, concurrent.futures.ThreadPoolExecutor):
            raise TypeError("executor must be ThreadPoolExecutor")
        self._default_executor = executor

    async def shutdown_default_executor(self):
        self._executor_shutdown_called = True
        if self._default_executor is None:
            return
        future = self.create_future()
        thread = threading.Thread(target=self._do_shutdown, args=(future,))
        thread.start()
        try:
            await future
        finally:
            thread.join()

    def _do_shutdown(self, future):
        try:
            self._default_executor.shutdown(wait=True)
            if not self.is_closed():
                self.call_soon_threadsafe(future.set_result, None)
        except Exception as ex:
            if not self.is_closed():
                self.call_soon_threadsafe(future.set_exception, ex)

    # -- async generators -----------------------------------------------------------------

    def _asyncgen_finalizer_hook(self, agen):
        self._asyncgens.discard(agen)
        if not self.is_closed():
            self.call_soon_threadsafe(self.create_task, agen.aclose())

    def _asyncgen_firstiter_hook(self, agen):
        if self._asyncgens_shutdown_called:
            import warnings
            warnings.warn(f"asynchronous generator {agen!r} was scheduled after "
                          f"loop.shutdown_asyncgens() call", ResourceWarning, source=self)
        self._asyncgens.add(agen)

    async def shutdown_asyncgens(self):
        self._asyncgens_shutdown_called = True
        if not len(self._asyncgens):
            return
        closing_agens = list(self._asyncgens)
        self._asyncgens.clear()
        results = await asyncio.gather(*[ag.aclose() for ag in closing_agens],
                                       return_exceptions=True)
        for result, agen in zip(results, closing_agens):
            if isinstance(result, Exception):
                self.call_exception_handler({
                    "message": f"an error occurred during closing of asynchronous "
                               f"generator {agen!r}",
                    "exception": result, "asyncgen": agen})

    # -- readiness callbacks --------------------------------------------------------------

    def add_reader(self, fd, callback, *args):
        self._add_poll(fd, False, callback, args)

    def add_writer(self, fd, callback, *args):
        self._add_poll(fd, True, callback, args)

    def remove_reader(self, fd):
        return self._remove_poll(fd, False)

    def remove_writer(self, fd):
        return self._remove_poll(fd, True)

    cdef _add_poll(self, fileobj, bint writing, callback, tuple args):
        self._check_closed()
        cdef int fd = _fileobj_to_fd(fileobj)
        cdef FDPoller poller = self._pollers.get(fd)
        if poller is None:
            poller = FDPoller.new(self, fd)
            self._pollers[fd] = poller
        poller.set_callback(writing, _new_handle(self, callback, args, None))

    cdef bint _remove_poll(self, fileobj, bint writing) except -1:
        if self._closed:
            return False
        cdef int fd = _fileobj_to_fd(fileobj)
        cdef FDPoller poller = self._pollers.get(fd)
        if poller is None:
            return False
        return poller.remove_callback(writing)

    # -- signals --------------------------------------------------------------------------

    def add_signal_handler(self, sig, callback, *args):
        """Run callback(*args) in the loop when signal sig arrives (main thread only)."""
        if aio_iscoroutine(callback) or aio_iscoroutinefunction(callback):
            raise TypeError("coroutines cannot be used with add_signal_handler()")
        self._check_signal(sig)
        self._check_closed()
        if self._signals is None:
            self._signals = SignalReader.new(self)
            self._signals.arm()
        try:
            # Raises ValueError outside the main thread: a loop in another thread cannot
            # take signals over.
            signal.set_wakeup_fd(self._signals.wsock.fileno())
        except (ValueError, OSError) as exc:
            raise RuntimeError(str(exc))
        self._signal_handlers[sig] = _new_handle(self, callback, args, None)
        try:
            signal.signal(sig, _sighandler_noop)
            signal.siginterrupt(sig, False)  # SA_RESTART: fewer EINTRs elsewhere
        except OSError as exc:
            del self._signal_handlers[sig]
            if not self._signal_handlers:
                try:
                    signal.set_wakeup_fd(-1)
                except (ValueError, OSError) as nexc:
                    aio_logger.info("set_wakeup_fd(-1) failed: %s", nexc)
            if exc.errno == pyerrno.EINVAL:
                raise RuntimeError(f"sig {sig:d} cannot be caught")
            raise

    def remove_signal_handler(self, sig):
        self._check_signal(sig)
        try:
            del self._signal_handlers[sig]
        except KeyError:
            return False
        handler = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except OSError as exc:
            if exc.errno == pyerrno.EINVAL:
                raise RuntimeError(f"sig {sig:d} cannot be caught")
            raise
        if not self._signal_handlers:
            try:
                signal.set_wakeup_fd(-1)
            except (ValueError, OSError) as exc:
                aio_logger.info("set_wakeup_fd(-1) failed: %s", exc)
        return True

    cdef _check_signal(self, sig):
        if not isinstance(sig, int):
            raise TypeError(f"sig must be an int, not {sig!r}")
        if sig not in signal.valid_signals():
            raise ValueError(f"invalid signal number {sig}")

    cdef _handle_signal(self, int sig):
        if sig == 0:
            return
        handle = self._signal_handlers.get(sig)
        if handle is None:
            return  # removed meanwhile
        if (<Handle>handle)._cancelled:
            self.remove_signal_handler(sig)
        else:
            self._ready_push(<Handle>handle)

    # -- names ----------------------------------------------------------------------------

    async def getaddrinfo(self, host, port, *, family=0, type=0, proto=0, flags=0):
        return await self.run_in_executor(None, socket.getaddrinfo, host, port, family, type,
                                          proto, flags)

    async def getnameinfo(self, sockaddr, flags=0):
        return await self.run_in_executor(None, socket.getnameinfo, sockaddr, flags)

    async def _ensure_resolved(self, address, *, family=0, type=socket.SOCK_STREAM, proto=0,
                               flags=0):
        host, port = address[:2]
        info = _ipaddr_info(host, port, family, type, proto)
        if info is not None:
            return [info]
        return await self.getaddrinfo(host, port, family=family, type=type, proto=proto,
                                      flags=flags)

    # -- servers --------------------------------------------------------------------------

    async def create_server(self, protocol_factory, host=None, port=None, *,
                            family=socket.AF_UNSPEC, flags=socket.AI_PASSIVE, sock=None,
                            backlog=100, ssl=None, reuse_address=None, reuse_port=None,
                            ssl_handshake_timeout=None, ssl_shutdown_timeout=None,
                            start_serving=True):
        """A TCP server: asyncio's create_server without TLS."""
        _refuse_ssl(ssl, ssl_handshake_timeout, ssl_shutdown_timeout)
        self._check_closed()
        if host is not None or port is not None:
            if sock is not None:
                raise ValueError("host/port and sock can not be specified at the same time")
            if reuse_address is None:
                reuse_address = True
            if host == "":
                hosts = [None]
            elif isinstance(host, str) or not isinstance(host, collections.abc.Iterable):
                hosts = [host]
            else:
                hosts = host
            infos = set()
            for one_host in hosts:
                found = await self._ensure_resolved((one_host, port), family=family,
                                                    type=socket.SOCK_STREAM, flags=flags)
                if not found:
                    raise OSError(f"getaddrinfo({one_host!r}) returned empty list")
                infos.update(found)
            sockets = []
            completed = False
            try:
                for af, socktype, proto, _canonname, sa in infos:
                    try:
                        sock = socket.socket(af, socktype, proto)
                    except OSError:
                        if self._debug:
                            aio_logger.warning("create_server() failed to create socket.socket"
                                               "(%r, %r, %r)", af, socktype, proto, exc_info=True)
                        continue
                    sockets.append(sock)
                    if reuse_address:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, True)
                    if reuse_port:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    if af == socket.AF_INET6:
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
                    try:
                        sock.bind(sa)
                    except OSError as err:
                        raise OSError(err.errno, "error while attempting to bind on address "
                                      f"{sa!r}: {err.strerror.lower()}") from None
                completed = True
            finally:
                if not completed:
                    for sock in sockets:
                        sock.close()
        else:
            if sock is None:
                raise ValueError("Neither host/port nor sock were specified")
            if sock.type != socket.SOCK_STREAM:
                raise ValueError(f"A Stream Socket was expected, got {sock!r}")
            sockets = [sock]
        return await self._serve(sockets, protocol_factory, backlog, start_serving)

    async def create_unix_server(self, protocol_factory, path=None, *, sock=None, backlog=100,
                                 ssl=None, ssl_handshake_timeout=None,
                                 ssl_shutdown_timeout=None, start_serving=True):
        """A Unix socket server; a stale socket file at path is replaced (as asyncio)."""
        _refuse_ssl(ssl, ssl_handshake_timeout, ssl_shutdown_timeout)
        self._check_closed()
        if path is not None:
            if sock is not None:
                raise ValueError("path and sock can not be specified at the same time")
            path = os.fspath(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if path[0] not in (0, "\x00"):  # not an abstract socket
                try:
                    if stat.S_ISSOCK(os.stat(path).st_mode):
                        os.remove(path)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    aio_logger.error("Unable to check or remove stale UNIX socket %r: %r",
                                     path, err)
            try:
                sock.bind(path)
            except OSError as exc:
                sock.close()
                if exc.errno == pyerrno.EADDRINUSE:
                    raise OSError(pyerrno.EADDRINUSE, f"Address {path!r} is already in use") \
                        from None
                raise
            except BaseException:
                sock.close()
                raise
        else:
            if sock is None:
                raise ValueError("path was not specified, and no sock specified")
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ValueError(f"A UNIX Domain Stream Socket was expected, got {sock!r}")
        return await self._serve([sock], protocol_factory, backlog, start_serving)

    async def _serve(self, list sockets, protocol_factory, backlog, start_serving):
        for sock in sockets:
            sock.setblocking(False)
        server = UringServer.new(self, sockets, protocol_factory, backlog)
        if start_serving:
            server._start_serving()
            await aio_sleep(0)  # as asyncio: the first accepts are armed when this returns
        return server

    # -- connections ----------------------------------------------------------------------

    async def create_connection(self, protocol_factory, host=None, port=None, *, ssl=None,
                                family=0, proto=0, flags=0, sock=None, local_addr=None,
                                server_hostname=None, ssl_handshake_timeout=None,
                                ssl_shutdown_timeout=None, happy_eyeballs_delay=None,
                                interleave=None):
        """A TCP connection: asyncio's create_connection without TLS or happy eyeballs."""
        _refuse_ssl(ssl, ssl_handshake_timeout, ssl_shutdown_timeout)
        if server_hostname is not None:
            raise ValueError("server_hostname is only meaningful with ssl")
        self._check_closed()
        if host is not None or port is not None:
            if sock is not None:
                raise ValueError("host/port and sock can not be specified at the same time")
            infos = await self._ensure_resolved((host, port), family=family,
                                                type=socket.SOCK_STREAM, proto=proto,
                                                flags=flags)
            if not infos:
                raise OSError("getaddrinfo() returned empty list")
            laddr_infos = None
            if local_addr is not None:
                laddr_infos = await self._ensure_resolved(local_addr, family=family,
                                                          type=socket.SOCK_STREAM,
                                                          proto=proto, flags=flags)
                if not laddr_infos:
                    raise OSError("getaddrinfo() returned empty list")
            exceptions = []
            for af, socktype, sproto, _canonname, address in infos:
                try:
                    sock = await self._connect_sock(af, socktype, sproto, address, laddr_infos)
                    break
                except OSError as exc:
                    exceptions.append(exc)
            else:
                if len(exceptions) == 1:
                    raise exceptions[0]
                model = str(exceptions[0])
                if all(str(exc) == model for exc in exceptions):
                    raise exceptions[0]
                raise OSError("Multiple exceptions: {}".format(
                    ", ".join(str(exc) for exc in exceptions)))
        else:
            if sock is None:
                raise ValueError("host and port was not specified and no sock specified")
            if sock.type != socket.SOCK_STREAM:
                raise ValueError(f"A Stream Socket was expected, got {sock!r}")
        return self._make_connection(sock, protocol_factory)

    async def _connect_sock(self, af, socktype, proto, address, laddr_infos):
        sock = socket.socket(af, socktype, proto)
        try:
            sock.setblocking(False)
            if laddr_infos is not None:
                error = None
                for _, _, _, _, laddr in laddr_infos:
                    try:
                        sock.bind(laddr)
                        break
                    except OSError as exc:
                        error = OSError(exc.errno, f"error while attempting to bind on "
                                        f"address {laddr!r}: {exc.strerror.lower()}")
                else:
                    raise error
            await self.sock_connect(sock, address)
            return sock
        except BaseException:
            sock.close()
            raise

    async def create_unix_connection(self, protocol_factory, path=None, *, ssl=None, sock=None,
                                     server_hostname=None, ssl_handshake_timeout=None,
                                     ssl_shutdown_timeout=None):
        _refuse_ssl(ssl, ssl_handshake_timeout, ssl_shutdown_timeout)
        if server_hostname is not None:
            raise ValueError("server_hostname is only meaningful with ssl")
        self._check_closed()
        if path is not None:
            if sock is not None:
                raise ValueError("path and sock can not be specified at the same time")
            path = os.fspath(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
            try:
                sock.setblocking(False)
                await self.sock_connect(sock, path)
            except BaseException:
                sock.close()
                raise
        else:
            if sock is None:
                raise ValueError("no path and sock were specified")
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise ValueError(f"A UNIX Domain Stream Socket was expected, got {sock!r}")
        return self._make_connection(sock, protocol_factory)

    def _make_connection(self, sock, protocol_factory):
        cdef UringTransport transport
        sock.setblocking(False)
        protocol = protocol_factory()
        context = PyContext_CopyCurrent()
        transport = UringTransport.new(self, sock, protocol, None, context)
        PyContext_Enter(context)
        try:
            transport._start()
        finally:
            PyContext_Exit(context)
        return transport, protocol

    async def sock_connect(self, sock, address):
        """Connect a non-blocking socket; waits for writability on the ring if needed.

        A connect happens once per connection, so it stays readiness-based: Python's socket
        module already knows how to build every family's sockaddr.
        """
        if sock.gettimeout() != 0:
            raise ValueError("the socket must be non-blocking")
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            resolved = await self._ensure_resolved(address, family=sock.family,
                                                   type=sock.type, proto=sock.proto)
            address = resolved[0][4]
        try:
            sock.connect(address)
            return
        except (BlockingIOError, InterruptedError):
            pass
        future = self.create_future()
        fd = sock.fileno()
        self.add_writer(fd, self._sock_connect_done, future, sock, address)
        try:
            await future
        finally:
            self.remove_writer(fd)

    def _sock_connect_done(self, future, sock, address):
        if future.done():
            return
        try:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err != 0:
                raise OSError(err, f"Connect call failed {address}")
        except (BlockingIOError, InterruptedError):
            return  # spurious wake-up: the poll is re-armed
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)


cdef aio_coroutines_debug():
    return bool(os.environ.get("PYTHONASYNCIODEBUG")) and not sys.flags.ignore_environment


cdef _refuse_ssl(ssl, ssl_handshake_timeout, ssl_shutdown_timeout):
    if ssl:
        raise NotImplementedError("the io_uring loop does not do TLS; use the asyncio loop")
    if ssl_handshake_timeout is not None:
        raise ValueError("ssl_handshake_timeout is only meaningful with ssl")
    if ssl_shutdown_timeout is not None:
        raise ValueError("ssl_shutdown_timeout is only meaningful with ssl")
