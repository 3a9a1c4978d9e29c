# Stream transports (TCP and Unix sockets) with completion-based I/O on the ring.
#
# Owns: UringTransport, the asyncio.Transport interface over one connected socket.
#
# Reading: one RECV in flight at a time. A BufferedProtocol's get_buffer() is called when
# that RECV is posted and the kernel writes straight into the buffer it returned (segment
# memory, for the daemon); buffer_updated() follows the completion. A plain Protocol gets a
# bytes object copied out of a per-transport buffer. A completion that arrives while
# reading is paused is parked and handed over on resume_reading(): the socket never has
# more than one buffer's worth taken out of it ahead of the protocol.
#
# Writing: write() queues the buffer (a reference for immutable ones, a copy otherwise) and
# the loop turns a transport's queue into one SEND / SENDMSG right before it enters the
# kernel, so everything written during an iteration leaves with that iteration's single
# io_uring_enter. One send is in flight at a time (two could be reordered). The queued
# size drives pause_writing / resume_writing against the write-buffer limits.
#
# Closing: connection_lost() runs only once no op is in flight, so once a protocol hears
# of the loss the kernel no longer touches any buffer it handed out.

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_CheckBuffer, \
    PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, \
    PyBytes_GET_SIZE
from cpython.ref cimport Py_DECREF, Py_INCREF
from posix.uio cimport iovec


cdef enum:
    RECV_BUFFER_BYTES = 65536      # a plain Protocol's receive buffer (asyncio reads 256 KiB)
    SEND_IOV_MAX = 64              # queued buffers one SENDMSG takes
    INLINE_SEND_MIN_BYTES = 65536  # writable buffers this big are sent at once, not copied
    WRITE_QUEUE_MIN = 8
    DEFAULT_HIGH_WATER = 65536     # asyncio's default write-buffer limits
    LOST_WRITES_WARNING = 5


cdef struct WriteEntry:
    PyObject *obj          # a reference we own: a bytes object, or the exporter of `view`
    char *buf
    Py_ssize_t len
    bint has_view
    Py_buffer view


# SEND_ZC spares the kernel a copy of a large send, but on loopback the data is copied at
# delivery anyway; measured here (TCP loopback, 64 KiB to 8 MiB sends) it gained neither
# throughput nor sender CPU, so it is off unless set_zerocopy_threshold() turns it on.
cdef Py_ssize_t _zerocopy_min_bytes = 0  # 0: never


def set_zerocopy_threshold(Py_ssize_t nbytes):
    """Send single buffers of at least nbytes with SEND_ZC on TCP (0 turns it off)."""
    global _zerocopy_min_bytes
    _zerocopy_min_bytes = nbytes


cdef class UringTransport(IOHandle):
    cdef:
        object _sock
        int _fd
        object _protocol
        object _context
        UringServer _server
        dict _extra
        object _sock_wrapper
        bint _is_tcp
        bint _buffered
        object _get_buffer, _buffer_updated, _data_received  # bound once, called per read

        # life cycle
        bint _protocol_connected
        bint _closing          # no more reads: close(), abort(), EOF or a fatal error
        bint _lost_scheduled   # connection_lost is due once no op is in flight
        bint _lost_called
        object _lost_exc
        int _lost_writes

        # reading
        bint _reading_paused
        bint _eof
        bint _recv_inflight
        bint _recv_cancelled
        bint _parked           # a completion waits for resume_reading
        int _parked_res
        bint _want_recv        # post a RECV at the next flush
        Py_buffer _recv_view
        bint _recv_has_view
        char *_rbuf

        # writing
        WriteEntry *_wq
        Py_ssize_t _wq_cap, _wq_head, _wq_count
        Py_ssize_t _wq_offset   # bytes of the head entry already sent
        Py_ssize_t _write_size  # bytes queued, the one in flight included
        Py_ssize_t _high_water, _low_water
        bint _writing_paused
        bint _send_inflight
        bint _send_cancelled
        bint _write_eof
        bint _eof_sent
        int _send_entries       # entries the send in flight covers
        list _zc_hold           # objects of zero-copy sends awaiting their notification
        iovec _iov[SEND_IOV_MAX]
        system.msghdr _msg

    @staticmethod
    cdef UringTransport new(UringLoop loop, object sock, object protocol, UringServer server,
                            object context):
        cdef UringTransport t = UringTransport.__new__(UringTransport)
        t.loop = loop
        t._sock = sock
        t._fd = sock.fileno()
        t._server = server
        t._context = context
        t._extra = {}
        t._is_tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        t._high_water = DEFAULT_HIGH_WATER
        t._low_water = DEFAULT_HIGH_WATER // 4
        if t._is_tcp:
            # As asyncio does for every TCP transport: small responses must not wait for Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t._set_protocol(protocol)
        if server is not None:
            server._attach()
        return t

    def __dealloc__(self):
        # No op can be in flight here (each holds a reference), so the kernel is done with
        # every buffer below.
        if self._recv_has_view:
            PyBuffer_Release(&self._recv_view)
        self._release_writes()
        if self._wq != NULL:
            free(self._wq)
        if self._rbuf != NULL:
            free(self._rbuf)

    def __repr__(self):
        state = "closed" if self._sock is None else ("closing" if self._closing else "open")
        return f"<UringTransport fd={self._fd} {state} write_size={self._write_size}>"

    # -- asyncio.BaseTransport ------------------------------------------------------------

    def get_extra_info(self, name, default=None):
        if name == "socket":
            if self._sock_wrapper is None and self._sock is not None:
                self._sock_wrapper = aio_trsock.TransportSocket(self._sock)
            return self._sock_wrapper
        if name in ("peername", "sockname") and name not in self._extra:
            self._fill_names()
        return self._extra.get(name, default)

    cdef _fill_names(self):
        # Looked up on first use rather than per connection: two syscalls most never need.
        if self._sock is None:
            return
        for name, get in (("peername", self._sock.getpeername),
                          ("sockname", self._sock.getsockname)):
            try:
                self._extra[name] = get()
            except OSError:
                self._extra[name] = None

    def is_closing(self):
        return self._closing

    def close(self):
        if self._closing:
            return
        self._closing = True
        self._stop_recv()
        if self._write_size == 0:
            self._schedule_lost(None)

    def set_protocol(self, protocol):
        self._set_protocol(protocol)

    def get_protocol(self):
        return self._protocol

    cdef _set_protocol(self, protocol):
        self._protocol = protocol
        self._buffered = isinstance(protocol, aio_BufferedProtocol)
        if self._buffered:
            self._get_buffer = protocol.get_buffer
            self._buffer_updated = protocol.buffer_updated
            self._data_received = None
        else:
            self._data_received = protocol.data_received
            self._get_buffer = self._buffer_updated = None

    # -- asyncio.ReadTransport ------------------------------------------------------------

    def is_reading(self):
        return not self._reading_paused and not self._closing

    def pause_reading(self):
        if self._closing or self._reading_paused:
            return
        self._reading_paused = True  # a RECV in flight stays; its result gets parked

    def resume_reading(self):
        if self._closing or not self._reading_paused:
            return
        self._reading_paused = False
        if self._parked:
            self.loop._ready_push(_new_handle(self.loop, self._deliver_parked, (), self._context))
        else:
            self._want_recv = True
            self.loop._request_flush(self)

    def _deliver_parked(self):
        if not self._parked or self._reading_paused or self._closing:
            return  # paused again, or closed, before this ran
        self._parked = False
        self._deliver(self._parked_res)

    # -- asyncio.WriteTransport -----------------------------------------------------------

    def write(self, data):
        self._write(data)

    def writelines(self, list_of_data):
        for data in list_of_data:
            self._write(data)

    def write_eof(self):
        if self._closing or self._write_eof:
            return
        self._write_eof = True
        if self._write_size == 0:
            self._shutdown_write()

    def can_write_eof(self):
        return True

    def abort(self):
        self._force_close(None)

    def set_write_buffer_limits(self, high=None, low=None):
        if high is None:
            high = 4 * low if low is not None else DEFAULT_HIGH_WATER
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high_water = high
        self._low_water = low
        self._maybe_pause_protocol()

    def get_write_buffer_limits(self):
        return (self._low_water, self._high_water)

    def get_write_buffer_size(self):
        return self._write_size

    # -- writing --------------------------------------------------------------------------

    cdef int _write(self, object data) except -1:
        cdef WriteEntry *entry
        cdef Py_ssize_t n
        if self._write_eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._lost_scheduled:
            if self._lost_writes >= LOST_WRITES_WARNING:
                aio_logger.warning("socket.send() raised exception.")
            self._lost_writes += 1
            return 0
        if PyBytes_CheckExact(data):
            n = PyBytes_GET_SIZE(data)
            if n == 0:
                return 0
            entry = self._wq_push()
            Py_INCREF(data)
            entry.obj = <PyObject *>data
            entry.buf = PyBytes_AS_STRING(data)
            entry.len = n
            entry.has_view = False
        else:
            n = self._write_buffer(data)
            if n <= 0:
                return 0
        self._write_size += n
        if not self._send_inflight:
            self.loop._request_flush(self)
        if self._write_size > self._high_water:
            self._maybe_pause_protocol()
        return 0

    cdef Py_ssize_t _write_buffer(self, object data) except -1:
        """Queue a non-bytes buffer; returns how many bytes were queued."""
        cdef Py_buffer view
        cdef WriteEntry *entry
        cdef Py_ssize_t sent = 0, n
        if not PyObject_CheckBuffer(data):
            raise TypeError(f"data argument must be a bytes-like object, "
                            f"not {type(data).__name__!r}")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        n = view.len
        if n == 0:
            PyBuffer_Release(&view)
            return 0
        if view.readonly:
            # Nobody can change it: send from it, holding the export until it is sent.
            entry = self._wq_push()
            entry.view = view
            entry.has_view = True
            entry.obj = <PyObject *>view.obj
            Py_INCREF(view.obj)  # PyBuffer_Release drops the view's own reference
            entry.buf = <char *>view.buf
            entry.len = n
            return n
        # A writable buffer may change (or be resized) once write() returns, so it must not
        # be held: send as much as the socket takes now, copy the rest. Copying a large one
        # would cost as much as sending it, hence the inline attempt (what asyncio always does).
        try:
            if n >= INLINE_SEND_MIN_BYTES and not self._send_inflight:
                sent = self._send_inline(<char *>view.buf, n)
                if sent < 0:
                    return 0  # a fatal error closed the transport
            if sent < n:
                copy = PyBytes_FromStringAndSize(<char *>view.buf + sent, n - sent)
                entry = self._wq_push()
                Py_INCREF(copy)
                entry.obj = <PyObject *>copy
                entry.buf = PyBytes_AS_STRING(copy)
                entry.len = n - sent
                entry.has_view = False
        finally:
            PyBuffer_Release(&view)
        return n - sent

    cdef Py_ssize_t _send_inline(self, char *buf, Py_ssize_t n) except -2:
        """sendmsg(MSG_DONTWAIT) of the queue plus buf; returns how much of buf was sent."""
        cdef int count = self._fill_iov()
        cdef Py_ssize_t queued = 0, done
        cdef int i
        for i in range(count):
            queued += self._iov[i].iov_len
        if count == SEND_IOV_MAX or queued < self._write_size:
            return 0  # the queue does not fit in one call: keep the order, copy buf
        self._iov[count].iov_base = buf
        self._iov[count].iov_len = n
        self._msg.msg_iov = self._iov
        self._msg.msg_iovlen = count + 1
        done = system.sendmsg(self._fd, &self._msg, system.MSG_DONTWAIT | system.MSG_NOSIGNAL)
        if done < 0:
            if system.errno == system.EAGAIN or system.errno == system.EINTR:
                return 0
            self._fatal_error(OSError(system.errno, strerror(system.errno).decode()),
                              "Fatal write error on socket transport")
            return -1
        if done <= queued:
            self._consume(done)
            return 0
        self._consume(queued)
        return done - queued

    cdef inline WriteEntry *_wq_push(self) except NULL:
        cdef Py_ssize_t new_cap, i, j
        cdef WriteEntry *grown
        if self._wq_count == self._wq_cap:
            new_cap = self._wq_cap * 2 if self._wq_cap else WRITE_QUEUE_MIN
            grown = <WriteEntry *>malloc(new_cap * sizeof(WriteEntry))
            if grown == NULL:
                raise MemoryError()
            for i in range(self._wq_count):  # unwrap the ring while copying
                j = (self._wq_head + i) & (self._wq_cap - 1)
                memcpy(&grown[i], &self._wq[j], sizeof(WriteEntry))
            free(self._wq)
            self._wq = grown
            self._wq_cap = new_cap
            self._wq_head = 0
        i = (self._wq_head + self._wq_count) & (self._wq_cap - 1)
        self._wq_count += 1
        return &self._wq[i]

    cdef inline void _wq_release_head(self) noexcept:
        cdef WriteEntry *entry = &self._wq[self._wq_head]
        if entry.has_view:
            PyBuffer_Release(&entry.view)
            entry.has_view = False
        Py_DECREF(<object>entry.obj)
        entry.obj = NULL
        self._wq_head = (self._wq_head + 1) & (self._wq_cap - 1)
        self._wq_count -= 1
        self._wq_offset = 0

    cdef void _release_writes(self) noexcept:
        while self._wq_count:
            self._wq_release_head()
        self._write_size = 0

    cdef int _fill_iov(self) noexcept:
        """Point _iov at the queue (the head entry from _wq_offset on)."""
        cdef int count = 0
        cdef Py_ssize_t i, j
        cdef WriteEntry *entry
        for i in range(min(self._wq_count, SEND_IOV_MAX)):
            j = (self._wq_head + i) & (self._wq_cap - 1)
            entry = &self._wq[j]
            if i == 0:
                self._iov[0].iov_base = entry.buf + self._wq_offset
                self._iov[0].iov_len = entry.len - self._wq_offset
            else:
                self._iov[i].iov_base = entry.buf
                self._iov[i].iov_len = entry.len
            count += 1
        return count

    cdef void _consume(self, Py_ssize_t nbytes) noexcept:
        """Drop nbytes sent from the front of the queue."""
        cdef WriteEntry *entry
        cdef Py_ssize_t left
        self._write_size -= nbytes
        while nbytes > 0 and self._wq_count:
            entry = &self._wq[self._wq_head]
            left = entry.len - self._wq_offset
            if nbytes < left:
                self._wq_offset += nbytes
                return
            nbytes -= left
            self._wq_release_head()

    cdef int _flush(self) except -1:
        cdef uring.io_uring_sqe *sqe
        cdef int count
        cdef WriteEntry *entry
        self.flush_queued = False
        if self._want_recv:
            self._want_recv = False
            if not self._recv_inflight and not self._parked:
                self._enter_and_start_recv()
        if self._send_inflight or self._wq_count == 0 or self._lost_scheduled:
            return 0
        count = self._fill_iov()
        sqe = self.loop.ring.sqe()
        if count == 1:
            entry = &self._wq[self._wq_head]
            if (_zerocopy_min_bytes and self._is_tcp and not entry.has_view
                    and self._iov[0].iov_len >= _zerocopy_min_bytes and self.loop.ring.send_zc):
                uring.io_uring_prep_send_zc(sqe, self._fd, self._iov[0].iov_base,
                                            self._iov[0].iov_len, system.MSG_NOSIGNAL, 0)
            else:
                uring.io_uring_prep_send(sqe, self._fd, self._iov[0].iov_base,
                                         self._iov[0].iov_len, system.MSG_NOSIGNAL)
        else:
            self._msg.msg_iov = self._iov
            self._msg.msg_iovlen = count
            uring.io_uring_prep_sendmsg(sqe, self._fd, &self._msg, system.MSG_NOSIGNAL)
        _op_track(self, sqe, OP_SEND)
        self._send_inflight = True
        self._send_entries = count
        return 0

    cdef int _on_send(self, int res, uint32_t flags) except -1:
        if flags & uring.IORING_CQE_F_NOTIF:
            # The kernel is done with a zero-copy send's pages.
            del self._zc_hold[0]
            self._maybe_finish_lost()
            return 0
        self._send_inflight = False
        if flags & uring.IORING_CQE_F_MORE:
            # A zero-copy send: its buffer must outlive the notification still to come.
            if self._zc_hold is None:
                self._zc_hold = []
            self._zc_hold.append(<object>self._wq[self._wq_head].obj)
        if self._lost_scheduled:
            self._release_writes()  # aborted: nothing more goes out
            self._maybe_finish_lost()
            return 0
        if res < 0:
            self._fatal_error(OSError(-res, strerror(-res).decode()),
                              "Fatal write error on socket transport")
            return 0
        self._consume(res)
        if self._wq_count:
            self.loop._request_flush(self)
        elif self._closing:
            self._schedule_lost(None)
            return 0
        elif self._write_eof and not self._eof_sent:
            self._shutdown_write()
        if self._writing_paused and self._write_size <= self._low_water:
            self._writing_paused = False
            try:
                self._protocol.resume_writing()
            except Exception as exc:
                self.loop.call_exception_handler({
                    "message": "protocol.resume_writing() failed", "exception": exc,
                    "transport": self, "protocol": self._protocol})
        return 0

    cdef _shutdown_write(self):
        self._eof_sent = True
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self._fatal_error(exc, "Fatal error on write_eof()")

    cdef _maybe_pause_protocol(self):
        if self._write_size <= self._high_water or self._writing_paused:
            return
        self._writing_paused = True
        try:
            self._protocol.pause_writing()
        except Exception as exc:
            self.loop.call_exception_handler({
                "message": "protocol.pause_writing() failed", "exception": exc,
                "transport": self, "protocol": self._protocol})

    # -- reading --------------------------------------------------------------------------

    cdef int _start(self) except -1:
        """connection_made, then the first RECV (the caller has entered self._context)."""
        self._protocol_connected = True
        try:
            self._protocol.connection_made(self)
        except Exception as exc:
            self._fatal_error(exc, "Fatal error: protocol.connection_made() call failed.")
            return 0
        self._start_recv()
        return 0

    def _start_cb(self):
        self._start()

    cdef int _enter_and_start_recv(self) except -1:
        PyContext_Enter(self._context)  # get_buffer is protocol code
        try:
            self._start_recv()
        finally:
            PyContext_Exit(self._context)
        return 0

    cdef int _start_recv(self) except -1:
        cdef uring.io_uring_sqe *sqe
        cdef object buf
        if (self._recv_inflight or self._parked or self._closing or self._reading_paused
                or self._eof):
            return 0
        if self._buffered:
            # Ask first, then take the SQE: once taken, an SQE is submitted no matter what.
            try:
                buf = self._get_buffer(-1)
                PyObject_GetBuffer(buf, &self._recv_view, PyBUF_WRITABLE)
            except Exception as exc:
                self._fatal_error(exc, "Fatal error: protocol.get_buffer() call failed.")
                return 0
            if self._recv_view.len == 0:
                PyBuffer_Release(&self._recv_view)
                self._fatal_error(RuntimeError("get_buffer() returned an empty buffer"),
                                  "Fatal error: protocol.get_buffer() call failed.")
                return 0
            self._recv_has_view = True
            sqe = self.loop.ring.sqe()
            uring.io_uring_prep_recv(sqe, self._fd, self._recv_view.buf, self._recv_view.len, 0)
        else:
            if self._rbuf == NULL:
                self._rbuf = <char *>malloc(RECV_BUFFER_BYTES)
                if self._rbuf == NULL:
                    raise MemoryError()
            sqe = self.loop.ring.sqe()
            uring.io_uring_prep_recv(sqe, self._fd, self._rbuf, RECV_BUFFER_BYTES, 0)
        _op_track(self, sqe, OP_RECV)
        self._recv_inflight = True
        self._recv_cancelled = False
        return 0

    cdef _stop_recv(self):
        if self._recv_inflight and not self._recv_cancelled:
            _op_cancel(self, OP_RECV)
            self._recv_cancelled = True
        self._parked = False

    cdef int _on_recv(self, int res) except -1:
        self._recv_inflight = False
        if self._recv_has_view:
            PyBuffer_Release(&self._recv_view)
            self._recv_has_view = False
        if self._closing:
            self._maybe_finish_lost()  # whatever came in is dropped, as asyncio stops reading
            return 0
        if res < 0:
            self._fatal_error(OSError(-res, strerror(-res).decode()),
                              "Fatal read error on socket transport")
            return 0
        if self._reading_paused:
            self._parked = True
            self._parked_res = res
            return 0
        self._deliver(res)
        return 0

    cdef int _deliver(self, int res) except -1:
        if res == 0:
            self._on_eof()
            return 0
        try:
            if self._buffered:
                self._buffer_updated(res)
            else:
                self._data_received(PyBytes_FromStringAndSize(self._rbuf, res))
        except Exception as exc:
            self._fatal_error(exc, "Fatal error: protocol.buffer_updated() call failed."
                              if self._buffered else
                              "Fatal error: protocol.data_received() call failed.")
            return 0
        self._start_recv()
        return 0

    cdef _on_eof(self):
        self._eof = True
        try:
            keep_open = self._protocol.eof_received()
        except Exception as exc:
            self._fatal_error(exc, "Fatal error: protocol.eof_received() call failed.")
            return
        if not keep_open:
            self.close()

    # -- completions ----------------------------------------------------------------------

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        PyContext_Enter(self._context)
        try:
            if op == OP_RECV:
                self._on_recv(res)
            else:
                self._on_send(res, flags)
        finally:
            PyContext_Exit(self._context)
        return 0

    cdef void _abandon(self, int op) noexcept:
        if op == OP_RECV:
            self._recv_inflight = False
            if self._recv_has_view:
                PyBuffer_Release(&self._recv_view)
                self._recv_has_view = False
        else:
            self._send_inflight = False

    # -- closing --------------------------------------------------------------------------

    cdef _fatal_error(self, exc, message):
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            if self.loop._debug:
                aio_logger.debug("%r: %s", self, message, exc_info=True)
        else:
            self.loop.call_exception_handler({
                "message": message, "exception": exc, "transport": self,
                "protocol": self._protocol})
        self._force_close(exc)

    cdef _force_close(self, exc):
        if self._lost_scheduled:
            return
        if not self._send_inflight:
            self._release_writes()
        self._closing = True
        self._schedule_lost(exc)

    cdef _schedule_lost(self, exc):
        if self._lost_scheduled:
            return
        self._lost_scheduled = True
        self._closing = True
        self._lost_exc = exc
        self._stop_recv()
        if self._send_inflight and not self._send_cancelled:
            _op_cancel(self, OP_SEND)
            self._send_cancelled = True
        self._maybe_finish_lost()

    cdef _maybe_finish_lost(self):
        if self._lost_scheduled and not self._lost_called and self.inflight == 0:
            self._lost_called = True
            self.loop._ready_push(_new_handle(self.loop, self._call_connection_lost,
                                              (self._lost_exc,), self._context))

    def _call_connection_lost(self, exc):
        try:
            if self._protocol_connected:
                self._protocol.connection_lost(exc)
        finally:
            self._release_writes()
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._protocol = None
            self._get_buffer = self._buffer_updated = self._data_received = None
            if self._rbuf != NULL:
                free(self._rbuf)
                self._rbuf = NULL
            server, self._server = self._server, None
            if server is not None:
                server._detach()
