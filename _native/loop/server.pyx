# Listening sockets: accepting on the ring, and the asyncio.Server interface over them.
#
# Owns: UringListener (one listening socket: a multishot ACCEPT that yields non-blocking,
# close-on-exec sockets, falling back to one-shot ACCEPTs where the kernel refuses
# multishot) and UringServer (what create_server returns: sockets, close, wait_closed,
# serve_forever, start_serving; it counts its live connections as asyncio's Server does).

from posix.unistd cimport close as fd_close


cdef double ACCEPT_RETRY_DELAY = 1.0  # seconds, after EMFILE and friends (as asyncio)


cdef class UringListener(IOHandle):
    cdef:
        object sock
        int fd
        UringServer server
        int family, type, proto
        bint armed
        bint cancelled
        bint closed

    @staticmethod
    cdef UringListener new(UringServer server, object sock):
        cdef UringListener listener = UringListener.__new__(UringListener)
        listener.loop = server._loop
        listener.server = server
        listener.sock = sock
        listener.fd = sock.fileno()
        listener.family = sock.family
        listener.type = sock.type
        listener.proto = sock.proto
        return listener

    cdef int arm(self) except -1:
        cdef uring.io_uring_sqe *sqe
        if self.armed or self.closed:
            return 0
        sqe = self.loop.ring.sqe()
        if self.loop.ring.multishot_accept:
            uring.io_uring_prep_multishot_accept(sqe, self.fd, NULL, NULL,
                                                 socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        else:
            uring.io_uring_prep_accept(sqe, self.fd, NULL, NULL,
                                       socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        _op_track(self, sqe, OP_ACCEPT)
        self.armed = True
        self.cancelled = False
        return 0

    def _rearm(self):
        self.arm()

    cdef close(self):
        """Stop accepting and close the socket now.

        The ACCEPT in flight holds its own reference to the socket until its cancellation
        completes, an iteration later; shutdown() stops the listening at once, so the port
        (or path) is free when close() returns, as with asyncio.
        """
        if self.closed:
            return
        self.closed = True
        if self.armed:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if not self.cancelled:
                _op_cancel(self, OP_ACCEPT)
                self.cancelled = True
        self.sock.close()

    cdef int _on_cqe(self, int op, int res, uint32_t flags) except -1:
        if not (flags & uring.IORING_CQE_F_MORE):
            self.armed = False
        if res >= 0:
            if self.closed or self.loop._closed:
                fd_close(res)
            else:
                self.server._accepted(self, res)
        elif res == -system.ECANCELED:
            return 0
        elif res == -system.EINVAL and self.loop.ring.multishot_accept and not self.closed:
            self.loop.ring.multishot_accept = False  # an older kernel: one ACCEPT at a time
        elif res in (-system.EMFILE, -system.ENFILE, -system.ENOBUFS, -system.ENOMEM):
            # Out of fds or memory: say so, and let the backlog wait a moment (as asyncio).
            self.loop.call_exception_handler({
                "message": "socket.accept() out of system resource",
                "exception": OSError(-res, strerror(-res).decode()),
                "socket": aio_trsock.TransportSocket(self.sock)})
            if not self.armed and not self.closed:
                self.loop.call_later(ACCEPT_RETRY_DELAY, self._rearm)
            return 0
        # Anything else (ECONNABORTED: the peer left the backlog) only costs that connection.
        if not self.armed and not self.closed and self.server._serving:
            self.arm()
        return 0


cdef class UringServer:
    cdef:
        UringLoop _loop
        list _sockets          # None once closed
        list _listeners
        object _protocol_factory
        int _backlog
        int _active_count
        list _waiters          # None once woken
        bint _serving
        object _serving_forever_fut
        object __weakref__

    @staticmethod
    cdef UringServer new(UringLoop loop, list sockets, object protocol_factory, int backlog):
        cdef UringServer server = UringServer.__new__(UringServer)
        server._loop = loop
        server._sockets = sockets
        server._listeners = []
        server._protocol_factory = protocol_factory
        server._backlog = backlog
        server._waiters = []
        return server

    def __repr__(self):
        return f"<UringServer sockets={self.sockets!r}>"

    cdef _accepted(self, UringListener listener, int fd):
        """A connection came in: socket, protocol and transport; connection_made is queued."""
        cdef UringTransport transport
        try:
            sock = socket.socket(listener.family, listener.type | socket.SOCK_NONBLOCK,
                                 listener.proto, fd)
        except OSError:
            fd_close(fd)
            raise
        try:
            protocol = self._protocol_factory()
            context = PyContext_CopyCurrent()
            transport = UringTransport.new(self._loop, sock, protocol, self, context)
        except Exception as exc:
            sock.close()
            self._loop.call_exception_handler({
                "message": "Error on transport creation for incoming connection",
                "exception": exc})
            return
        self._loop._ready_push(_new_handle(self._loop, transport._start_cb, (), context))

    cdef _attach(self):
        self._active_count += 1

    cdef _detach(self):
        self._active_count -= 1
        if self._active_count == 0 and self._sockets is None:
            self._wakeup()

    cdef _wakeup(self):
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def _start_serving(self):
        cdef UringListener listener
        if self._serving or self._sockets is None:
            return
        self._serving = True
        for sock in self._sockets:
            sock.listen(self._backlog)
            listener = UringListener.new(self, sock)
            self._listeners.append(listener)
            listener.arm()

    def get_loop(self):
        return self._loop

    def is_serving(self):
        return self._serving

    @property
    def sockets(self):
        if self._sockets is None:
            return ()
        return tuple(aio_trsock.TransportSocket(s) for s in self._sockets)

    def close(self):
        cdef UringListener listener
        sockets = self._sockets
        if sockets is None:
            return
        self._sockets = None
        for listener in self._listeners:
            listener.close()
        for sock in sockets:  # never served: no listener closed them
            sock.close()
        self._listeners = []
        self._serving = False
        if self._serving_forever_fut is not None and not self._serving_forever_fut.done():
            self._serving_forever_fut.cancel()
            self._serving_forever_fut = None
        if self._active_count == 0:
            self._wakeup()

    async def start_serving(self):
        self._start_serving()
        await aio_sleep(0)

    async def serve_forever(self):
        if self._serving_forever_fut is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if self._sockets is None:
            raise RuntimeError(f"server {self!r} is closed")
        self._start_serving()
        self._serving_forever_fut = self._loop.create_future()
        try:
            await self._serving_forever_fut
        except aio_CancelledError:
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serving_forever_fut = None

    async def wait_closed(self):
        # Python 3.11's semantics: returns at once if already closed, else waits for close()
        # and for the last connection to go.
        if self._sockets is None or self._waiters is None:
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
        await self.wait_closed()
