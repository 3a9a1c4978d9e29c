"""Slow, stalled and greedy clients against a real daemon: what it bounds, and what it keeps.

Each test starts a real `mooncaked` (conftest's `make_daemon`) on each event loop
(`[server] loop`), misbehaves over raw sockets (tests/wire_helpers.py), then checks the bytes
another client reads back, the answers the misbehaving client gets (PROTOCOL.md: a
`protocol_error` notification with a code, then close), and the daemon's own accounting
(`status`: used bytes, buffered response bytes). Waiting is always bounded and polled; no
assertion is about time.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

import wire_helpers
from mooncaked.errors import ErrorCode
from mooncaked.proto import framing
from wire_helpers import read_frame, request_frame

IO_TIMEOUT_S = 10.0  # a bound on waiting for the daemon, never an assertion
POLL_TIMEOUT_S = 30.0  # how long a condition may take to hold (a sweep, a timeout)

LOOPS = ["asyncio", "uring"]


def loop_usable(name: str) -> bool:
    if name == "asyncio":
        return True
    try:
        from mooncaked.io import uring
    except ImportError:
        return False
    return uring.usable()[0]


@pytest.fixture(params=LOOPS)
def loop_name(request) -> str:
    if not loop_usable(request.param):
        pytest.skip(f"the {request.param} loop is not usable here")
    return request.param


# -- helpers ------------------------------------------------------------------------------------

def connect(daemon, kind: str = "tcp") -> socket.socket:
    return wire_helpers.connect(daemon, kind, IO_TIMEOUT_S, nodelay=True)


def call(sock: socket.socket, msgid: int, method: str, params: list, payload: bytes = b""):
    """Send one request and read its response: (error, result, payload)."""
    sock.sendall(request_frame(msgid, method, params, payload))
    header, response_payload = read_frame(sock)
    assert header[0] == framing.RESPONSE and header[1] == msgid, header
    return header[2], header[3], response_payload


def hello(sock: socket.socket) -> dict:
    error, result, _ = call(sock, 0, "hello", [{"protocol": 1, "client_name": "overload"}])
    assert error is None, error
    return result


def read_until_closed(sock: socket.socket) -> bytes:
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return bytes(data)
        if not chunk:
            return bytes(data)
        data += chunk


def protocol_error_code(data: bytes) -> int:
    """The code of the protocol_error notification that `data` (all the daemon sent) ends with."""
    frames = wire_helpers.split_frames(data)
    assert frames, "the daemon closed without a protocol_error notification"
    header, _ = frames[-1]
    assert header[0] == framing.NOTIFICATION and header[1] == "protocol_error", header
    return header[2][0]


def poll(condition, what: str, timeout_s: float = POLL_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout_s} s")
        time.sleep(0.05)


def status(daemon) -> dict:
    with connect(daemon) as sock:
        hello(sock)
        error, result, _ = call(sock, 1, "status", [])
        assert error is None, error
        return result


def used_bytes(daemon) -> int:
    return status(daemon)["used_bytes"]


# -- 1. a revoked put never writes into another object's range ------------------------------

VALUE_BYTES = 3 << 20  # in a 4 MiB segment, one value fits at a time: a new put must reuse it


def test_stalled_put_cannot_overwrite_the_range_that_replaced_it(make_daemon, loop_name):
    daemon = make_daemon(
        server={"loop": loop_name},
        segments={"size_bytes": 4 << 20},
        store={"put_start_release_timeout_ms": 1000, "put_start_discard_timeout_ms": 1000,
               "eviction_interval_ms": 20, "eviction_high_watermark_ratio": 1.0})
    stalled = connect(daemon)
    hello(stalled)
    head = framing.request_head(1, "put", ["stalled"], VALUE_BYTES)
    stalled.sendall(head + b"\xee" * (VALUE_BYTES // 2))

    # Another client's put of the same size fits only once the stalled put's range is free.
    value = os.urandom(VALUE_BYTES)
    with connect(daemon) as other:
        hello(other)

        def stored() -> bool:
            error, result, _ = call(other, 2, "put", ["fresh"], value)
            if error is not None:
                assert error[0] == ErrorCode.NO_AVAILABLE_HANDLE, error
                return False
            assert result is True
            return True
        poll(stored, "room for a second put")

        # The stalled client sends the rest of its payload: it must land nowhere.
        try:
            stalled.sendall(b"\xff" * (VALUE_BYTES - VALUE_BYTES // 2))
        except OSError:
            pass  # the daemon closed the stalled connection: its bytes land nowhere either
        time.sleep(0.2)  # time for the bytes to land, were they to land anywhere

        error, size, payload = call(other, 3, "get", ["fresh"])
        assert error is None, error
        assert size == VALUE_BYTES
        assert payload == value, "the stalled client's bytes overwrote another object"
        error, _, _ = call(other, 4, "get", ["stalled"])
        assert error[0] == ErrorCode.OBJECT_NOT_FOUND
    data = read_until_closed(stalled)
    stalled.close()
    assert protocol_error_code(data) == ErrorCode.TIMED_OUT


PIECE_BYTES = 5 << 18  # 1.25 MiB: three fit in a 4 MiB segment, a fourth does not
PINNED = {"with_hard_pin": True}  # never evicted to make room: only a freed range makes it


def test_a_preempted_put_cannot_overwrite_the_range_that_replaced_it(make_daemon, loop_name):
    daemon = make_daemon(
        server={"loop": loop_name},
        segments={"size_bytes": 4 << 20},
        store={"put_start_release_timeout_ms": 1000, "put_start_discard_timeout_ms": 1000,
               "eviction_interval_ms": 20, "eviction_high_watermark_ratio": 1.0})
    stalled = connect(daemon)
    hello(stalled)
    stalled.sendall(framing.request_head(1, "put", ["key"], PIECE_BYTES)
                    + b"\xee" * (PIECE_BYTES // 2))
    replacement, filler, fresh = (os.urandom(PIECE_BYTES) for _ in range(3))
    with connect(daemon) as other:
        hello(other)
        # An upsert preempts the stalled put (its range waits for the release timeout) ...
        assert call(other, 2, "upsert", ["key"], replacement)[0] is None
        assert call(other, 5, "get", ["key"])[2] == replacement  # a read lease: not evicted
        assert call(other, 3, "put", ["filler", PINNED], filler)[0] is None

        # ... and a third value fits only once that range is free.
        def stored() -> bool:
            error, result, _ = call(other, 4, "put", ["fresh", PINNED], fresh)
            if error is not None:
                assert error[0] == ErrorCode.NO_AVAILABLE_HANDLE, error
                return False
            return result is True
        poll(stored, "room for the third value")
        try:
            stalled.sendall(b"\xff" * (PIECE_BYTES - PIECE_BYTES // 2))
        except OSError:
            pass
        time.sleep(0.2)  # time for the bytes to land, were they to land anywhere
        for msgid, (key, value) in enumerate((("key", replacement), ("filler", filler),
                                              ("fresh", fresh)), 10):
            error, _, payload = call(other, msgid, "get", [key])
            assert error is None and payload == value, f"{key} was overwritten"
    data = read_until_closed(stalled)
    stalled.close()
    assert protocol_error_code(data) == ErrorCode.TIMED_OUT


# -- 3. deadlines: hello, a frame's progress, a payload -------------------------------------

def test_a_connection_that_never_says_hello_is_closed(make_daemon, loop_name):
    daemon = make_daemon(server={"loop": loop_name, "hello_timeout_ms": 300})
    silent = connect(daemon)
    greeted = connect(daemon)
    hello(greeted)
    data = read_until_closed(silent)
    silent.close()
    assert protocol_error_code(data) == ErrorCode.TIMED_OUT
    # The hello timeout is for the hello only: a connection that said it stays open.
    time.sleep(0.5)
    error, result, _ = call(greeted, 1, "ping", [])
    assert error is None and result == "pong"
    greeted.close()


@pytest.mark.parametrize("part", ["prefix", "header", "payload"])
def test_a_half_sent_frame_is_closed_and_frees_its_space(make_daemon, loop_name, part):
    daemon = make_daemon(server={"loop": loop_name, "frame_timeout_ms": 300})
    baseline = used_bytes(daemon)
    frame = request_frame(1, "put", [f"half-{part}"], b"v" * 100_000)
    prefix_end = framing.PREFIX_BYTES
    header_end = len(framing.request_head(1, "put", [f"half-{part}"], 100_000))
    cut = {"prefix": prefix_end // 2, "header": (prefix_end + header_end) // 2,
           "payload": header_end + 50_000}[part]
    with connect(daemon) as sock:
        hello(sock)
        sock.sendall(frame[:cut])
        data = read_until_closed(sock)
    assert protocol_error_code(data) == ErrorCode.TIMED_OUT
    poll(lambda: used_bytes(daemon) == baseline, "back to the used bytes before the put")
    with connect(daemon) as sock:  # the daemon still serves
        hello(sock)
        error, result, _ = call(sock, 1, "put", ["after"], b"x")
        assert error is None and result is True


def test_a_trickled_put_cannot_hold_its_space(make_daemon, loop_name):
    daemon = make_daemon(server={"loop": loop_name, "payload_timeout_ms": 500,
                                 "frame_timeout_ms": 60_000})
    baseline = used_bytes(daemon)
    size = 1 << 20
    with connect(daemon) as sock:
        hello(sock)
        sock.sendall(framing.request_head(1, "put", ["trickled"], size))
        sent = 0
        try:
            while sent < size:  # a byte now and then: the frame progresses, the put does not
                sock.sendall(b"t")
                sent += 1
                time.sleep(0.02)
                if sent % 10 == 0 and used_bytes(daemon) == baseline:
                    break
        except OSError:
            pass  # closed by the daemon
        data = read_until_closed(sock)
    assert sent < size
    assert protocol_error_code(data) == ErrorCode.TIMED_OUT
    poll(lambda: used_bytes(daemon) == baseline, "back to the used bytes before the put")


# -- 2. response memory per connection ---------------------------------------------------------

MIB = 1 << 20


def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def test_a_client_that_pipelines_and_never_reads_holds_a_bounded_amount(make_daemon, loop_name):
    bound = 4 * MIB
    daemon = make_daemon(server={"loop": loop_name, "max_response_bytes_per_connection": bound})
    value = os.urandom(MIB)
    with connect(daemon) as writer:
        hello(writer)
        assert call(writer, 1, "put", ["big"], value)[0] is None
    count = 300  # 300 MiB of responses, were they all buffered
    greedy = connect(daemon)
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    hello(greedy)
    rss_before = rss_anon_bytes(daemon.process.pid)
    greedy.sendall(b"".join(request_frame(10 + i, "get", ["big"]) for i in range(count)))

    # The daemon stops dispatching: what it holds unsent stays within the bound + one response.
    time.sleep(1.0)
    unsent = poll(lambda: status(daemon)["unsent_response_bytes"] or None, "any unsent bytes")
    assert unsent <= bound + MIB + 64 * 1024
    assert rss_anon_bytes(daemon.process.pid) - rss_before < 64 * MIB

    # Another client is answered meanwhile.
    with connect(daemon) as other:
        hello(other)
        error, size, payload = call(other, 1, "get", ["big"])
        assert error is None and payload == value

    # Nothing was dropped: the greedy client reads every answer, in order.
    for i in range(count):
        header, payload = read_frame(greedy)
        assert header[:3] == [framing.RESPONSE, 10 + i, None], header[:3]
        assert payload == value
    greedy.close()


def test_a_batch_get_over_max_payload_bytes_is_refused_and_the_connection_stays(make_daemon,
                                                                             loop_name):
    daemon = make_daemon(server={"loop": loop_name, "max_payload_bytes": 4 * MIB})
    with connect(daemon) as sock:
        hello(sock)
        keys = [f"k{i}" for i in range(5)]
        for i, key in enumerate(keys):
            assert call(sock, 1 + i, "put", [key], os.urandom(MIB))[0] is None
        error, result, payload = call(sock, 10, "batch_get", [keys])
        assert error[0] == ErrorCode.RESPONSE_TOO_LARGE, error
        assert result is None and payload == b""
        # No lease was granted by the refused batch: a plain remove succeeds.
        assert call(sock, 11, "remove", [keys[0]])[0] is None
        error, sizes, payload = call(sock, 12, "batch_get", [keys[1:]])
        assert error is None and sizes == [MIB] * 4 and len(payload) == 4 * MIB


def test_a_batch_get_whose_response_exceeds_32_bits_is_refused(make_daemon, loop_name):
    """8,192 x 1 MiB: over 4 GiB, more than a frame's length field can say."""
    daemon = make_daemon(server={"loop": loop_name})
    with connect(daemon) as sock:
        hello(sock)
        assert call(sock, 1, "put", ["one"], os.urandom(MIB))[0] is None
        error, _, _ = call(sock, 2, "batch_get", [["one"] * 8192])
        assert error[0] == ErrorCode.RESPONSE_TOO_LARGE, error
        assert call(sock, 3, "ping", [])[1] == "pong"


# -- 4. idle connections cost little; a full daemon still answers mooncakectl -------------------

def test_idle_connections_hold_small_buffers(make_daemon, loop_name):
    daemon = make_daemon(server={"loop": loop_name})
    count = 400
    with connect(daemon) as first:  # the daemon's own start-up allocations are done
        hello(first)
    before = rss_anon_bytes(daemon.process.pid)
    sockets = [connect(daemon) for _ in range(count)]
    try:
        poll(lambda: status(daemon)["connections"] >= count, f"{count} connections open")
        grown = rss_anon_bytes(daemon.process.pid) - before
        # A 256 KiB receive buffer each would be 100 MiB; a small one and the connection's own
        # objects are a few KiB.
        assert grown < count * 64 * 1024, grown
        for sock in sockets[:3]:  # they still work, with values larger than the buffer
            hello(sock)
            value = os.urandom(300_000)
            assert call(sock, 1, "put", [f"v{sock.fileno()}"], value)[0] is None
            assert call(sock, 2, "get", [f"v{sock.fileno()}"])[2] == value
    finally:
        for sock in sockets:
            sock.close()


def test_a_full_daemon_keeps_administrative_slots_on_the_unix_socket(make_daemon, loop_name):
    daemon = make_daemon(server={"loop": loop_name, "max_connections": 2,
                                 "admin_connections": 1})
    clients = [connect(daemon, "unix"), connect(daemon)]
    for sock in clients:
        hello(sock)
    try:
        # Over TCP, a third client is refused.
        with connect(daemon) as refused:
            assert protocol_error_code(read_until_closed(refused)) == ErrorCode.BUSY
        # On the Unix socket, one more connection may administer, and only that.
        admin = connect(daemon, "unix")
        hello(admin)
        error, result, _ = call(admin, 1, "status", [])
        assert error is None and result["connections"] == 3
        error, _, _ = call(admin, 2, "put", ["not-here"], b"value")
        assert error[0] == ErrorCode.BUSY
        error, _, _ = call(admin, 3, "get", ["not-here"])
        assert error[0] == ErrorCode.BUSY
        # mooncakectl itself gets through only while the slot is free.
        assert ctl_status(daemon).returncode != 0
        admin.close()
        done = poll(lambda: (lambda d: d if d.returncode == 0 else None)(ctl_status(daemon)),
                    "mooncakectl status answered")
        assert "connections" in done.stdout
        # Every slot counts again once clients leave: a regular client gets in.
        clients.pop().close()
        poll(lambda: status_via_unix_ok(daemon), "a regular connection accepted")
    finally:
        for sock in clients:
            sock.close()


def ctl_status(daemon):
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("MOONCAKED_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", daemon.unix_address,
                           "-o", "json", "status"], env=env, capture_output=True, text=True,
                          timeout=60)


def status_via_unix_ok(daemon) -> bool:
    with connect(daemon, "unix") as sock:
        hello(sock)
        return call(sock, 1, "put", ["regular"], b"v")[0] is None


# -- 5. a shm_dir too small for the segments -------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs of its own (mounting needs root)."""
    import subprocess
    mount_point = tmp_path / "small-shm"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "mooncaked-test",
                           str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def start_refused(tmp_path, shm_dir: str, segments: dict):
    import subprocess
    import sys
    from conftest import REPO, free_port, write_config
    config = tmp_path / "refused.toml"
    write_config(str(config), {
        "server": {"tcp_port": free_port(), "unix_socket": str(tmp_path / "refused.sock")},
        "segments": {"shm_dir": shm_dir, **segments},
        "metrics": {"enabled": False}})
    return subprocess.run([sys.executable, "-m", "mooncaked", "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))


@pytest.mark.parametrize("prefault", [False, True])
def test_a_segment_larger_than_the_free_space_is_refused_at_start(tmp_path, small_tmpfs,
                                                                  prefault):
    result = start_refused(tmp_path, small_tmpfs, {"size_bytes": 16 << 20,
                                                   "prefault": prefault})
    assert result.returncode == 1, (result.returncode, result.stderr)  # not -SIGBUS
    assert "needs 16777216 bytes" in result.stderr and small_tmpfs in result.stderr
    assert "bytes free" in result.stderr
    assert os.listdir(small_tmpfs) == []  # nothing left behind


def test_the_second_segment_that_does_not_fit_refuses_and_removes_the_first(tmp_path,
                                                                            small_tmpfs):
    result = start_refused(tmp_path, small_tmpfs, {"size_bytes": 5 << 20, "count": 2})
    assert result.returncode == 1, result.stderr
    assert "segment 1 needs 5242880 bytes" in result.stderr
    assert os.listdir(small_tmpfs) == []


def test_a_full_shm_dir_cannot_take_the_segments_memory_away(small_tmpfs, make_daemon,
                                                             loop_name):
    from mooncaked import BlockingClient
    daemon = make_daemon(server={"loop": loop_name},
                         segments={"size_bytes": 4 << 20, "shm_dir": small_tmpfs})
    # Another user of the file system takes every byte left.
    with open(os.path.join(small_tmpfs, "filler"), "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass
    value = os.urandom(2 << 20)
    with connect(daemon) as sock:  # over TCP: received into the segment by the daemon
        hello(sock)
        assert call(sock, 1, "put", ["tcp"], value)[0] is None
        assert call(sock, 2, "get", ["tcp"])[2] == value
    with BlockingClient.connect(daemon.unix_address) as client:  # shared memory
        assert client.put("shm", value[:1 << 20])
        assert client.get("shm") == value[:1 << 20]
    assert daemon.process.poll() is None


# -- 6. overload: many connections, many clients that do not read -------------------------------

def test_thousands_of_connections_are_bounded_and_the_daemon_keeps_answering(make_daemon,
                                                                              loop_name):
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    total = min(2000, soft // 2 - 64)  # the daemon (a child) has the same limit
    if total < 200:
        pytest.skip(f"the fd limit ({soft}) is too low for this test")
    accepted = total * 3 // 4
    daemon = make_daemon(server={"loop": loop_name, "max_connections": accepted,
                                 "hello_timeout_ms": 600_000})
    with connect(daemon) as first:
        hello(first)
    before = rss_anon_bytes(daemon.process.pid)
    sockets = []
    try:
        for _ in range(total):
            sockets.append(connect(daemon))
        # Past max_connections: a BUSY notification and a closed connection, not a bigger
        # daemon. Which ones is the daemon's choice (the order it accepts them in).
        working, refused = [], 0
        for sock in sockets:
            sock.sendall(request_frame(0, "hello", [{"protocol": 1}]))
            header, _ = read_frame(sock)
            if header[0] == framing.NOTIFICATION:
                assert header[1] == "protocol_error" and header[2][0] == ErrorCode.BUSY, header
                refused += 1
            else:
                assert header[2] is None, header
                working.append(sock)
        assert len(working) == accepted and refused == total - accepted
        error, result, _ = call(working[0], 1, "status", [])
        assert result["connections"] == accepted
        assert rss_anon_bytes(daemon.process.pid) - before < accepted * 64 * 1024
        # Accepted connections still work.
        for index, sock in enumerate(working[::max(1, accepted // 20)]):
            value = os.urandom(1000 + index)
            assert call(sock, 2, "put", [f"c{index}"], value)[0] is None
            assert call(sock, 3, "get", [f"c{index}"])[2] == value
    finally:
        for sock in sockets:
            sock.close()


def test_many_clients_that_never_read_hold_bounded_memory(make_daemon, loop_name):
    bound = 2 * MIB
    readers = 16
    daemon = make_daemon(server={"loop": loop_name, "max_response_bytes_per_connection": bound})
    value = os.urandom(MIB)
    with connect(daemon) as writer:
        hello(writer)
        assert call(writer, 1, "put", ["big"], value)[0] is None
    before = rss_anon_bytes(daemon.process.pid)
    greedy = []
    try:
        for index in range(readers):
            sock = connect(daemon)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            greedy.append(sock)
            hello(sock)
            # 64 MiB of answers asked for by each, none read.
            sock.sendall(b"".join(request_frame(i, "get", ["big"]) for i in range(64)))
        # Another client is answered, and the daemon holds at most bound + one response each.
        with connect(daemon) as other:
            hello(other)
            for i in range(5):
                error, _, payload = call(other, 10 + i, "get", ["big"])
                assert error is None and payload == value
        unsent = status(daemon)["unsent_response_bytes"]
        assert unsent <= readers * (bound + MIB + 64 * 1024), unsent
        assert rss_anon_bytes(daemon.process.pid) - before < readers * (bound + 2 * MIB), \
            "the daemon grew with the responses nobody reads"
    finally:
        for sock in greedy:
            sock.close()
    # Closing them frees their leases and buffers: the value can be removed without force.
    with connect(daemon) as sock:
        hello(sock)
        poll(lambda: status(daemon)["unsent_response_bytes"] == 0, "no unsent responses")
