"""Fuzz target: the client protocol, through a real daemon Connection, master and segments.

One input is one client connection. Layout:

    byte 0     flags: bit 0 = the Unix socket kind (shared-memory methods allowed),
               bit 1 = run the daemon's sweep (deadlines, eviction) between chunks
    bytes 1-2  a seed (big-endian) for where the stream is split and how far the clock moves
               between chunks; 0 = the whole stream in one chunk, the clock still
    bytes 3-   what the client sends

The bytes go through `get_buffer` / `buffer_updated` as the event loop calls them, into a
`Connection` of a real `Daemon` (its master, state machine, reservations and two small
segments in a temp directory), with an in-memory transport: no sockets, no event loop.

After each input the connection is closed, and any of these is a finding (an exception):
- an exception out of the protocol, or a record at ERROR or above in the daemon's log;
- a reply byte that is not a well-formed frame, replies out of request order, a request left
  unanswered, an INTERNAL_ERROR answer, a close without a protocol_error notification (other
  than after VERSION_MISMATCH), a malformed frame not refused;
- after the close: an unfinished put, a reservation, a lease or stats entry for a name that
  does not exist, or segment space the state does not account for; then, once every deadline
  has passed and every object is removed, a segment that is not entirely free.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile

from mooncaked import config as config_module
from mooncaked.daemon import metrics
from mooncaked.daemon.connection import Connection
from mooncaked.daemon.main import Daemon
from mooncaked.daemon.segment_memory import SegmentMemory
from mooncaked.errors import ErrorCode
from mooncaked.meta import commands

from fakes import ErrorRecords, FakeTransport
from wire_oracle import Finding, decode_replies, expected_requests

CONTROL_BYTES = 3
SEGMENT_COUNT = 2
SEGMENT_BYTES = 16 * 1024
ALIGNMENT_BYTES = 64
MAX_ALLOCATIONS = 64
# Small bounds, so that small inputs reach them (and the segments' capacity, and eviction).
SERVER = {"max_header_bytes": 16 * 1024, "max_payload_bytes": 64 * 1024, "max_key_bytes": 64,
          "max_batch_keys": 32, "max_puts_in_progress": 16,
          "max_reserved_bytes_per_connection": 12 * 1024, "unix_socket": ""}
STORE = {"max_objects": 32, "lease_ttl_ms": 1000, "put_start_discard_timeout_ms": 2000,
         "put_start_release_timeout_ms": 5000, "soft_pin_ttl_ms": 5000,
         "max_soft_pin_ttl_ms": 10_000}
CHUNK_SIZES = (1, 2, 3, 7, 8, 9, 13, 64, 1000, 4096, 65536)
# Steps across the lease, discard and release timeouts above.
CLOCK_STEPS_MS = (0, 0, 1, 999, 1001, 2001, 5001)
FAR_FUTURE_MS = 10 ** 9  # past every lease, pin and deadline an input can set
START_MS = 1_000_000

class Harness:
    """The segments and log capture, made once; a fresh daemon state for every input."""

    def __init__(self) -> None:
        os.environ.pop("NOTIFY_SOCKET", None)  # a daemon per input must not open sockets
        self.shm_dir = tempfile.mkdtemp(prefix="mooncaked-fuzz-")
        self.config = config_module.from_dict({
            "node": {"name": "fuzz"}, "server": SERVER, "store": STORE,
            "segments": {"count": SEGMENT_COUNT, "size_bytes": SEGMENT_BYTES,
                         "alignment_bytes": ALIGNMENT_BYTES, "max_allocations": MAX_ALLOCATIONS,
                         "shm_dir": self.shm_dir},
            "metrics": {"enabled": False},
            # The te_* methods answer from a task on the daemon's loop (they open listeners);
            # this target has no loop, so they run here as with [transfer] off (NOT_SUPPORTED).
            "transfer": {"enabled": False}}, "<fuzz>")
        segments = self.config.segments
        self.memory = {index: SegmentMemory(index, self.shm_dir, SEGMENT_BYTES,
                                            segments.shm_mode, -1, "off", False)
                       for index in range(SEGMENT_COUNT)}
        self.errors = ErrorRecords()
        daemon_log = logging.getLogger("mooncaked")
        daemon_log.addHandler(self.errors)
        daemon_log.setLevel(logging.WARNING)  # keep INFO lines (closed connections) quiet
        daemon_log.propagate = False
        self.clock_ms = START_MS

    def close(self) -> None:
        for memory in self.memory.values():
            memory.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def new_daemon(self) -> Daemon:
        daemon = Daemon(self.config)
        daemon.master._rng.seed(0)  # the same placements for the same input
        daemon.memory = self.memory
        daemon.now_ms = lambda: self.clock_ms
        daemon.loop_name = lambda: "asyncio"  # `status` asks; no event loop runs here
        for index in range(SEGMENT_COUNT):
            daemon.master.propose(commands.MountSegment(
                index, f"fuzz/{index}", "fuzz", SEGMENT_BYTES, ALIGNMENT_BYTES, MAX_ALLOCATIONS))
        self.errors.records.clear()
        return daemon


_harness: Harness | None = None


def harness() -> Harness:
    global _harness
    if _harness is None:
        _harness = Harness()
    return _harness


def run(data: bytes) -> bytes:
    """Run one input; returns what the daemon wrote. Raises Finding on a finding."""
    if len(data) < CONTROL_BYTES:
        return b""
    h = harness()
    flags, seed, stream = data[0], int.from_bytes(data[1:3], "big"), data[CONTROL_BYTES:]
    kind = "unix" if flags & 1 else "tcp"
    daemon = h.new_daemon()
    transport = FakeTransport()
    conn = Connection(daemon, kind)
    conn.connection_made(transport)
    rng = random.Random(seed) if seed else None
    swept = False
    position = 0
    while position < len(stream) and not transport.closing and not transport.paused:
        end = len(stream) if rng is None else min(len(stream),
                                                  position + rng.choice(CHUNK_SIZES))
        while position < end and not transport.closing and not transport.paused:
            buffer = conn.get_buffer(-1)
            if not len(buffer):
                raise Finding("get_buffer returned an empty buffer (the loop would fail)")
            count = min(len(buffer), end - position)
            buffer[:count] = stream[position:position + count]
            position += count
            conn.buffer_updated(count)
        if rng is not None:
            h.clock_ms += rng.choice(CLOCK_STEPS_MS)
            if flags & 2:
                writing = _pending_puts(daemon, conn)
                daemon.sweep(h.clock_ms)
                swept = True
                if conn._incoming is not None and not transport.closing \
                        and writing - _pending_puts(daemon, conn):
                    raise Finding("the sweep revoked a put whose payload the open connection "
                                  "still receives into the freed range")
    if transport.paused and not transport.closing:
        raise Finding("reading paused with no handler running: the connection would hang")
    written = bytes(transport.written)
    conn.connection_lost(None)
    _check_log(h)
    if transport.writes_after_close:
        raise Finding(f"{transport.writes_after_close} writes after the connection was closed")
    _check_replies(daemon, stream, written, transport.closing, swept)
    _check_released(h, daemon, conn)
    _check_log(h)
    return written


def _pending_puts(daemon: Daemon, conn: Connection) -> set:
    return {key for key, entry in daemon.master.state.objects.items()
            if entry.pending is not None and entry.pending.writer_id == conn.connection_id}


def _check_log(h: Harness) -> None:
    if h.errors.records:
        record = h.errors.records[0]
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        raise Finding(f"the daemon logged an error: {text}")


def _check_replies(daemon: Daemon, stream: bytes, written: bytes, closed: bool,
                   swept: bool) -> None:
    """`swept`: the clock moved and the sweep ran, so a connection deadline may have closed
    the connection (a TIMED_OUT notification) before every request was answered."""
    sent = expected_requests(stream, daemon.max_header_bytes, daemon.max_payload_bytes)
    replies = decode_replies(written)
    notices = [r for r in replies if r.msgid is None]
    answers = [r for r in replies if r.msgid is not None]
    if notices and (len(notices) > 1 or replies[-1] is not notices[0]):
        raise Finding("frames after the protocol_error notification")
    msgids = [r.msgid for r in answers]
    if msgids != sent.msgids[:len(msgids)]:
        raise Finding(f"answers {msgids[:20]} do not follow the requests {sent.msgids[:20]}")
    for index, (reply, method) in enumerate(zip(answers, sent.methods)):
        if reply.error is not None:
            code = reply.error[0]
            if code == ErrorCode.INTERNAL_ERROR:
                raise Finding(f"{method} answered INTERNAL_ERROR: {reply.error[1]}")
            if code == ErrorCode.VERSION_MISMATCH and index != len(answers) - 1:
                raise Finding("requests answered after VERSION_MISMATCH")
            continue
        _check_result(method, reply)
    if notices and notices[0].error[0] == ErrorCode.TIMED_OUT:
        if not swept:
            raise Finding("TIMED_OUT without the clock passing a deadline")
        if not closed:
            raise Finding("TIMED_OUT sent but the connection stays open")
        return
    if notices:
        if not sent.malformed:
            raise Finding(f"protocol_error {notices[0].error!r:.200} for well-formed frames")
        if len(answers) != len(sent.msgids):
            raise Finding(f"{len(sent.msgids) - len(answers)} requests before the malformed "
                          "frame were not answered")
        if not closed:
            raise Finding("protocol_error sent but the connection stays open")
        return
    if closed:
        last = answers[-1].error if answers else None
        if last is None or last[0] != ErrorCode.VERSION_MISMATCH:
            raise Finding("the connection was closed without a protocol_error notification")
        return
    if sent.malformed:
        raise Finding("a malformed frame was not refused")
    if len(answers) != len(sent.msgids):
        raise Finding(f"{len(sent.msgids) - len(answers)} requests were not answered")


def _check_result(method: str, reply) -> None:
    if method == "get":
        if reply.result != reply.payload_length:
            raise Finding(f"get answered {reply.result!r:.50} with {reply.payload_length} bytes")
    elif method == "batch_get":
        sizes = reply.result
        if (type(sizes) is not list or any(type(s) is not int for s in sizes)
                or sum(s for s in sizes if s > 0) != reply.payload_length):
            raise Finding(f"batch_get answered {sizes!r:.100} with {reply.payload_length} bytes")
    elif reply.payload_length:
        raise Finding(f"{method} answered with a payload of {reply.payload_length} bytes")


def _check_space(daemon: Daemon, when: str) -> None:
    state = daemon.master.state
    for segment in state.segment_list:
        allocator = segment.allocator
        owned = state.owned_bytes(segment.segment_id)
        if allocator.free_bytes != segment.size_bytes - owned:
            raise Finding(f"{when}: segment {segment.segment_id} has {allocator.free_bytes} "
                          f"free bytes, the state accounts for {segment.size_bytes - owned}")


def _check_released(h: Harness, daemon: Daemon, conn: Connection) -> None:
    state = daemon.master.state
    if daemon.connections:
        raise Finding("the closed connection is still registered")
    if conn.puts_in_progress or conn.reservations or conn.reserved_bytes:
        raise Finding(f"the closed connection still holds puts {list(conn.puts_in_progress)!r:.100}"
                      f" or reservations {sorted(conn.reservations)!r:.100}")
    if len(daemon.reservations):
        raise Finding(f"{len(daemon.reservations)} reservations outlive their connection")
    if state.pending_order:
        raise Finding(f"unfinished puts outlive their connection: "
                      f"{list(state.pending_order)!r:.200}")
    try:
        state.check_invariants()
    except AssertionError as exc:
        raise Finding(f"state invariant broken: {exc}") from None
    _check_space(daemon, "after the close")
    unknown = {method for method, _ in daemon.stats.requests} - set(daemon.handlers)
    unknown.discard(metrics.UNKNOWN_METHOD)
    if unknown:
        raise Finding(f"stats keep {len(unknown)} names of methods that do not exist "
                      f"(memory that grows with each new name): {sorted(unknown)[:3]!r:.200}")
    # Every deadline passes: deferred ranges are freed, leaving exactly the live objects.
    h.clock_ms += FAR_FUTURE_MS
    daemon.sweep(h.clock_ms)
    if state.deferred_bytes or state.expiry_due(h.clock_ms):
        raise Finding(f"{state.deferred_bytes} deferred bytes left after every deadline")
    _check_space(daemon, "after every deadline")
    # Everything removed: the segments are empty and nothing is kept per key.
    daemon.master.remove_matching(None, None, True, h.clock_ms)
    h.clock_ms += FAR_FUTURE_MS
    daemon.sweep(h.clock_ms)
    if state.objects:
        raise Finding(f"objects left after removing everything: {list(state.objects)!r:.200}")
    for segment in state.segment_list:
        allocator = segment.allocator
        if allocator.free_bytes != segment.size_bytes or allocator.allocation_count:
            raise Finding(f"segment {segment.segment_id}: {allocator.allocation_count} ranges, "
                          f"{segment.size_bytes - allocator.free_bytes} bytes still allocated "
                          "with no object")
    if daemon.master.access:
        raise Finding(f"leases kept for removed objects: {list(daemon.master.access)!r:.200}")


def test_one_input(data: bytes) -> None:
    run(data)
