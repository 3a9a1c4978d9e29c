"""One client connection: reads frames, runs handlers, writes responses.

A `BufferedProtocol`, so the kernel copies a request's payload straight into its destination:
once a put's header is read and its space allocated, `get_buffer` hands out the segment memory
itself, and the value is never copied in Python. Headers and small frames go through a scratch
buffer. Responses are written in request order. Over TLS (mooncaked/tls.py) the TLS layer sits
between: the ciphertext lands in its buffers and is decrypted into what get_buffer hands out.

What a handler returns (daemon/handlers.py):
- `Reply(result, payload)`: answer at once;
- `Incoming(targets, complete, abort)`: the request's payload goes into `targets` in order (a
  memoryview receives its length in bytes; an int N drops N bytes), then `complete()` gives the
  Reply. If the connection is lost first, `abort()` undoes what the handler started. An
  Incoming with an `abort` receives into segment ranges of an unfinished put;
- a coroutine (a cluster node's handlers, which wait for the Raft log or a peer): the
  connection reads no further request until it finishes, which keeps responses in order.
  `complete()` may return a coroutine too.

Deadlines (`check_deadlines`, run by the daemon's sweep): a connection is closed, after a
`protocol_error` TIMED_OUT notification, when it has not said hello within `hello_timeout_ms`,
when a half-received frame gets no byte for `frame_timeout_ms`, or when a payload is not
complete within `payload_timeout_ms`. A put's payload goes straight into segment ranges that
the release sweep frees `put_start_release_timeout_ms` after the put started (and a preempting
put reuses no sooner); its deadline is at most half of that, so the connection stops receiving
into the ranges (and the io_uring loop's receive in flight is cancelled) well before anything
else can be put there.

Response memory: a connection's requests are not dispatched while more than
`max_response_bytes_per_connection` of its responses is unsent (the transport's write buffer),
so a client that pipelines requests and does not read holds that much and one response more.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Callable

from mooncaked.daemon import auth
from mooncaked.errors import ErrorCode, MooncakedError, code_name
from mooncaked.proto import framing
from mooncaked.proto.scratch import ScratchBuffer

log = logging.getLogger(__name__)

INLINE_PAYLOAD_BYTES = 64 * 1024  # smaller response payloads are joined to their header


class Reply:
    __slots__ = ("result", "payload")

    def __init__(self, result: Any, payload: list | None = None) -> None:
        self.result = result
        self.payload = payload  # a list of buffers, sent in order


class Incoming:
    __slots__ = ("targets", "complete", "abort")

    def __init__(self, targets: list, complete: Callable[[], Reply],
                 abort: Callable[[], None] | None = None) -> None:
        self.targets = targets  # per piece: a memoryview to fill, or an int count to drop
        self.complete = complete
        self.abort = abort


class Connection(ScratchBuffer, asyncio.BufferedProtocol):
    # Receive buffer for headers and small requests: it starts small, so that idle connections
    # (unidentified ones, a client pool's spares) cost little, and grows while reads fill it
    # (a client that pipelines), up to max_scratch_bytes.
    scratch_bytes = 4 * 1024
    max_scratch_bytes = 256 * 1024
    discard_bytes = 256 * 1024

    def __init__(self, daemon, transport_kind: str) -> None:
        self.daemon = daemon
        self.transport_kind = transport_kind  # "tcp" or "unix"
        self.connection_id = daemon.next_connection_id()
        self.transport: asyncio.Transport | None = None
        self.namespace: str | None = None  # set by hello
        self.principal: str | None = None  # set by hello when authentication is on
        self.auth_challenge: tuple | None = None  # auth_start's, until the hello that uses it
        self.client_name = ""
        # Unfinished shared-memory puts: object key -> (replicas, size_bytes).
        self.puts_in_progress: dict = {}
        # Ranges reserved for this connection's next puts (daemon/reservations.py):
        # (segment_id, offset) pairs, and the sum of their sizes.
        self.reservations: set = set()
        self.reserved_bytes = 0
        # The segments this connection may map (set by hello, daemon.mappable_segments): every
        # shared-memory request is checked against them. The client's pid, for fd tokens.
        self.mappable_segments: frozenset = frozenset()
        self.peer_pid = 0
        self._init_scratch()
        # The request whose payload is being received.
        self._incoming: Incoming | None = None
        self._incoming_msgid = 0
        self._incoming_method = ""
        self._incoming_started_ns = 0
        self._target_index = 0
        self._target_offset = 0
        self._target_sizes: list[int] = []
        self._closing = False
        self._awaiting: asyncio.Task | None = None  # a coroutine handler still running
        # Deadlines (check_deadlines): bytes received so far, and when that count last moved.
        self._opened_ms = daemon.now_ms()
        self._received_bytes = 0
        self._received_checked = 0
        self._progress_ms = self._opened_ms
        self._payload_deadline_ms = 0
        self._writing_paused = False  # the transport's write buffer is over its high mark
        self._dispatch_paused = False  # too many response bytes unsent: requests wait

    # -- asyncio protocol -------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.daemon.connection_opened(self)

    def connection_lost(self, exc) -> None:
        if self._incoming is not None and self._incoming.abort is not None:
            try:
                self._incoming.abort()
            except Exception:
                log.exception("aborting a request of connection %d", self.connection_id)
        self._incoming = None
        self.daemon.connection_closed(self)

    def pause_writing(self) -> None:
        # The client is not reading its responses: stop reading its requests.
        self._writing_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._progress_ms = self.daemon.now_ms()  # the wait was ours, not the client's
        if self._closing:
            return
        if self._dispatch_paused:
            self._dispatch_paused = False
            try:
                self._process()
            except MooncakedError as exc:
                self._protocol_error(exc.code, exc.message)
                return
        if not self._closing and self._awaiting is None and not self._dispatch_paused:
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._incoming is not None and self._start == self._end:
            target = self._incoming.targets[self._target_index]
            remaining = self._target_sizes[self._target_index] - self._target_offset
            if type(target) is int:
                return self._discard_view()[:remaining]
            return target[self._target_offset:self._target_offset + remaining]
        if self._end == len(self._scratch):
            self._compact()
        return self._scratch_view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        self._received_bytes += nbytes
        if self._incoming is not None and self._start == self._end:
            self._target_offset += nbytes  # the kernel wrote straight into the target
            self._skip_empty_targets()
        else:
            self._end += nbytes
            if self._awaiting is not None:  # it waits in the buffer, which it may not outgrow
                self.transport.pause_reading()
            if self._end == len(self._scratch) and self.scratch_bytes < self.max_scratch_bytes:
                # The read filled the buffer: more is likely waiting. (An instance attribute
                # from now on, which _reset_if_consumed shrinks back to after a large header.)
                self.scratch_bytes = min(self.scratch_bytes * 4, self.max_scratch_bytes)
                if len(self._scratch) < self.scratch_bytes:
                    self._grow(self.scratch_bytes)
        try:
            self._process()
        except MooncakedError as exc:
            self._protocol_error(exc.code, exc.message)

    def eof_received(self):
        return False  # close our side too

    # -- frames -----------------------------------------------------------------------------

    def _process(self) -> None:
        daemon = self.daemon
        prefix = framing.PREFIX
        while not self._closing and self._awaiting is None:
            available = self._end - self._start
            if self._incoming is not None:
                if available == 0:
                    return
                taken = self._fill_from_scratch(available)
                self._start += taken
                continue
            if available < framing.PREFIX_BYTES:
                break
            if self.transport.get_write_buffer_size() > daemon.max_response_bytes:
                # resume_writing() dispatches again once the client has read enough.
                self._dispatch_paused = True
                self.transport.pause_reading()
                return
            header_length, payload_length = prefix.unpack_from(self._scratch, self._start)
            framing.check_prefix(header_length, payload_length, daemon.max_header_bytes,
                                 daemon.max_payload_bytes)
            frame_head = framing.PREFIX_BYTES + header_length
            if available < frame_head:
                if frame_head > len(self._scratch):
                    self._grow(frame_head)
                break
            header_start = self._start + framing.PREFIX_BYTES
            header = framing.unpack_header(
                self._scratch_view[header_start:header_start + header_length],
                daemon.max_header_bytes)
            self._start += frame_head
            msgid, method, params = framing.parse_request(header)
            self._dispatch(msgid, method, params, payload_length)
        self._reset_if_consumed()

    def _dispatch(self, msgid: int, method: str, params: list, payload_length: int) -> None:
        started_ns = time.perf_counter_ns()
        daemon = self.daemon
        try:
            if self.namespace is None and method not in auth.BEFORE_HELLO:
                raise MooncakedError(ErrorCode.HANDSHAKE_REQUIRED, "send hello first")
            handler = daemon.handlers.get(method)
            if handler is None:
                raise MooncakedError(ErrorCode.UNKNOWN_METHOD, f"no method {method!r}")
            if payload_length and method not in daemon.payload_methods:
                # Refused before the handler runs, so the request has no effect at all.
                raise MooncakedError(ErrorCode.INVALID_PARAMS, f"{method} takes no payload")
            if self.namespace is not None and daemon.auth is not None:
                daemon.auth.authorize(self, method, params)
            outcome = handler(self, params, payload_length)
        except MooncakedError as exc:
            outcome = exc
        except Exception as exc:  # a bug: answer it, log it, keep serving
            log.exception("handler %s failed", method)
            outcome = MooncakedError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        if type(outcome) is Incoming:
            self._begin_payload(msgid, method, outcome, payload_length, started_ns)
            return
        if payload_length:  # refused: drop the payload the request carried, then answer
            if not isinstance(outcome, MooncakedError):  # a bug: the payload was not taken
                if inspect.iscoroutine(outcome):
                    outcome.close()
                log.error("handler %s answered without taking its payload", method)
                outcome = MooncakedError(ErrorCode.INTERNAL_ERROR,
                                         f"{method} did not take its payload")
            error = outcome

            def fail() -> Reply:
                raise error
            self._begin_payload(msgid, method, Incoming([payload_length], fail), payload_length,
                                started_ns)
            return
        if inspect.iscoroutine(outcome):
            self._await(msgid, method, outcome, started_ns)
            return
        self._respond(msgid, method, outcome, started_ns)

    def _begin_payload(self, msgid: int, method: str, incoming: Incoming, payload_length: int,
                       started_ns: int) -> None:
        sizes = [t if type(t) is int else len(t) for t in incoming.targets]
        if sum(sizes) != payload_length:
            raise MooncakedError(ErrorCode.PROTOCOL_ERROR, "payload pieces do not add up")
        self._incoming = incoming
        self._incoming_msgid = msgid
        self._incoming_method = method
        self._incoming_started_ns = started_ns
        daemon = self.daemon
        # Into segment ranges (an abort): closed well before the sweep can free them.
        self._payload_deadline_ms = daemon.now_ms() + (
            daemon.put_payload_timeout_ms if incoming.abort is not None
            else daemon.payload_timeout_ms)
        self._target_sizes = sizes
        self._target_index = 0
        self._target_offset = 0
        self.daemon.stats.bytes_in += payload_length
        self._skip_empty_targets()

    def _skip_empty_targets(self) -> None:
        sizes = self._target_sizes
        while self._target_index < len(sizes) and self._target_offset == sizes[self._target_index]:
            self._target_index += 1
            self._target_offset = 0
        if self._target_index == len(sizes):
            self._finish_payload()

    def _fill_from_scratch(self, available: int) -> int:
        """Move payload bytes that arrived in the scratch buffer into the current target."""
        index = self._target_index
        target = self._incoming.targets[index]
        count = min(available, self._target_sizes[index] - self._target_offset)
        if type(target) is not int:
            target[self._target_offset:self._target_offset + count] = \
                self._scratch_view[self._start:self._start + count]
        self._target_offset += count
        self._skip_empty_targets()
        return count

    def _finish_payload(self) -> None:
        incoming, self._incoming = self._incoming, None
        try:
            outcome = incoming.complete()
        except MooncakedError as exc:
            outcome = exc
        except Exception as exc:
            log.exception("completing %s failed", self._incoming_method)
            outcome = MooncakedError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        if inspect.iscoroutine(outcome):
            self._await(self._incoming_msgid, self._incoming_method, outcome,
                        self._incoming_started_ns)
            return
        self._respond(self._incoming_msgid, self._incoming_method, outcome,
                      self._incoming_started_ns)

    def _await(self, msgid: int, method: str, coroutine, started_ns: int) -> None:
        """Run a coroutine handler; requests behind it wait in the buffer (order, bounds).

        Reading pauses only if the client sends more meanwhile (buffer_updated), so that a
        client waiting for the answer costs no pause and resume. The answer is sent from the
        handler's own task, not from a done callback a loop iteration later."""
        async def run() -> None:
            try:
                outcome = await coroutine
            except asyncio.CancelledError:
                self._handled(msgid, method, started_ns,
                              MooncakedError(ErrorCode.SHUTTING_DOWN, "the request was cancelled"))
                raise
            except MooncakedError as exc:
                outcome = exc
            except Exception as exc:
                log.error("handler %s failed", method, exc_info=exc)
                outcome = MooncakedError(ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
            self._handled(msgid, method, started_ns, outcome)

        self._awaiting = asyncio.get_running_loop().create_task(run())

    def _handled(self, msgid: int, method: str, started_ns: int, outcome) -> None:
        self._awaiting = None
        self._progress_ms = self.daemon.now_ms()  # the wait was ours, not the client's
        if self.transport is None or self.transport.is_closing():
            return
        self._respond(msgid, method, outcome, started_ns)
        if not self._closing:
            self.transport.resume_reading()
            try:
                self._process()
            except MooncakedError as exc:
                self._protocol_error(exc.code, exc.message)

    # -- responses --------------------------------------------------------------------------

    def _respond(self, msgid: int, method: str, outcome, started_ns: int) -> None:
        stats = self.daemon.stats
        transport = self.transport
        payload = None if isinstance(outcome, MooncakedError) else outcome.payload
        total = sum(len(p) for p in payload) if payload else 0
        if total > self.daemon.max_payload_bytes:  # bounded like a request's payload
            outcome = MooncakedError(ErrorCode.RESPONSE_TOO_LARGE,
                                     f"the response would carry {total} bytes, over "
                                     f"max_payload_bytes {self.daemon.max_payload_bytes}")
        if isinstance(outcome, MooncakedError):
            transport.write(framing.error_head(msgid, outcome.code, outcome.message))
            result_name = code_name(outcome.code)
            if outcome.code in (ErrorCode.VERSION_MISMATCH, ErrorCode.AUTH_FAILED):
                self._close()
        else:
            if payload:
                head = framing.response_head(msgid, outcome.result, total)
                if total <= INLINE_PAYLOAD_BYTES:
                    transport.write(b"".join((head, *payload)))
                else:
                    transport.write(head)
                    for piece in payload:
                        transport.write(piece)
                stats.bytes_out += total
            else:
                transport.write(framing.response_head(msgid, outcome.result))
            result_name = "ok"
        stats.record(method, result_name, time.perf_counter_ns() - started_ns)
        if self.daemon.draining:
            self.close_if_idle()

    def _protocol_error(self, code: int, message: str) -> None:
        self.daemon.stats.protocol_errors += 1
        log.info("connection %d: %s; closing", self.connection_id, message)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(framing.protocol_error_head(code, message))
        self._close()

    # -- deadlines --------------------------------------------------------------------------

    def check_deadlines(self, now_ms: int) -> bool:
        """Close the connection if a deadline passed. Returns True when it was receiving a
        put's payload into segment ranges (the caller lets a loop iteration pass before
        freeing ranges, so that a kernel receive into them is cancelled first)."""
        if self._closing:
            return False
        if self._received_bytes != self._received_checked:
            self._received_checked = self._received_bytes
            self._progress_ms = now_ms
        daemon = self.daemon
        incoming = self._incoming
        if self.namespace is None and now_ms - self._opened_ms >= daemon.hello_timeout_ms:
            reason = f"no hello within {daemon.hello_timeout_ms} ms"
        elif incoming is not None and now_ms >= self._payload_deadline_ms:
            reason = (f"the payload of {self._incoming_method} did not arrive in time "
                      f"({sum(self._target_sizes)} bytes)")
        elif (self._start != self._end or incoming is not None) and not self._reading_held() \
                and now_ms - self._progress_ms >= daemon.frame_timeout_ms:
            reason = f"no byte of a half-received frame for {daemon.frame_timeout_ms} ms"
        else:
            return False
        receiving_put = incoming is not None and incoming.abort is not None
        self._protocol_error(ErrorCode.TIMED_OUT, reason)
        return receiving_put

    def _reading_held(self) -> bool:
        """Whether the daemon, not the client, holds the next bytes back."""
        return self._writing_paused or self._dispatch_paused or self._awaiting is not None

    # -- lifecycle --------------------------------------------------------------------------

    def idle(self) -> bool:
        """Between requests, with no unfinished shared-memory put."""
        return (self._incoming is None and self._start == self._end
                and not self.puts_in_progress and self._awaiting is None)

    def close_if_idle(self) -> None:
        if self.idle():
            self._close()

    def _close(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()  # flushes what was written, then connection_lost

    def abort(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.abort()


class AdminConnection(Connection):
    """A Unix socket connection accepted beyond `max_connections`, in one of the
    `admin_connections` slots kept so that `mooncakectl` reaches a daemon that is full: it may
    call the administration methods only (PROTOCOL.md 5.3); others answer BUSY."""

    methods = frozenset(("hello", "auth_start", "ping", "status", "segments", "objects_list",
                         "object_stat", "config_show", "cluster_status", "quota_list"))

    def _dispatch(self, msgid: int, method: str, params: list, payload_length: int) -> None:
        if method in self.methods:
            super()._dispatch(msgid, method, params, payload_length)
            return
        error = MooncakedError(ErrorCode.BUSY,
                               f"{method!r} on an administrative connection: the daemon has "
                               "its max_connections clients")
        if payload_length:
            def fail() -> Reply:
                raise error
            self._begin_payload(msgid, method, Incoming([payload_length], fail), payload_length,
                                time.perf_counter_ns())
        else:
            self._respond(msgid, method, error, time.perf_counter_ns())
