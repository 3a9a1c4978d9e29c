"""The shared client core and the thread-safe client.

- `operations` (client/operations.py): the gather/scatter calls over the Unix socket (shared
  memory) and over TCP (the socket), run by the blocking and the asyncio client alike;
- `ClientPool`: many threads on one client object, every value verified; the connection bound;
  a daemon restart under load; a lost connection re-sent for reads and reported for writes.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import socket
import threading
import time

import msgpack
import pytest

from mooncaked import BlockingClient, Client, ErrorCode, MooncakedError
from mooncaked.client.pool import ClientPool
from mooncaked.proto import framing


def _buffer(data: bytes):
    buffer = ctypes.create_string_buffer(data, len(data))
    return buffer, ctypes.addressof(buffer)


@pytest.fixture(params=["unix", "tcp"])
def address(request, daemon) -> str:
    return daemon.unix_address if request.param == "unix" else daemon.tcp_address


# -- gather and scatter -------------------------------------------------------------------------

def test_put_from_ranges_gathers_pieces_and_get_into_ranges_scatters(address):
    with BlockingClient.connect(address, namespace="ranges") as client:
        head, head_address = _buffer(b"A" * 100_000)
        tail, tail_address = _buffer(b"B" * 50_000)
        sizes = [150_000, 150_000, 10]
        ranges = [
            [(0, head_address, 100_000), (100_000, tail_address, 50_000)],  # in order
            [(50_000, head_address, 100_000), (0, tail_address, 50_000)],    # out of order
            [(5, head_address, 6)],                                           # outside: invalid
        ]
        codes = client.batch_put_from_ranges(["in-order", "reordered", "bad"], sizes, ranges)
        assert codes == [0, 0, int(ErrorCode.INVALID_PARAMS)]
        assert client.get("in-order") == b"A" * 100_000 + b"B" * 50_000
        assert client.get("reordered") == b"B" * 50_000 + b"A" * 100_000
        assert not client.exists("bad")
        # Written again: the key exists, its value is kept.
        assert client.batch_put_from_ranges(["in-order"], [150_000],
                                            [[(0, tail_address, 50_000),
                                              (50_000, head_address, 100_000)]]) == [1]

        out = ctypes.create_string_buffer(200_000)
        base = ctypes.addressof(out)
        results = client.batch_get_into_ranges(
            ["in-order", "missing", "in-order"],
            [[(99_990, base, 20)], [(0, base + 100, 10)],
             [(149_995, base + 1_000, 100), (200_000, base + 2_000, 10)]])
        assert results == [150_000, int(ErrorCode.OBJECT_NOT_FOUND), 150_000]
        assert out.raw[:20] == b"A" * 10 + b"B" * 10
        assert out.raw[100:110] == b"\0" * 10  # a miss copies nothing
        assert out.raw[1_000:1_005] == b"B" * 5 and out.raw[1_005:1_100] == b"\0" * 95  # clipped


def test_batch_get_into_refuses_a_value_larger_than_its_buffer(address):
    with BlockingClient.connect(address, namespace="capacity") as client:
        client.put("big", b"x" * 4096)
        client.put("small", b"y" * 16)
        out = ctypes.create_string_buffer(64)
        base = ctypes.addressof(out)
        assert client.batch_get_into(["big", "small"], [base, base + 32], [32, 32]) == \
            [int(ErrorCode.INVALID_PARAMS), 16]
        assert out.raw[:32] == b"\0" * 32 and out.raw[32:48] == b"y" * 16


def test_asyncio_and_blocking_clients_run_the_same_operations(address):
    data, data_address = _buffer(bytes(range(256)) * 512)  # 128 KiB: shared memory if local

    async def main():
        async with await Client.connect(address, namespace="same-core") as client:
            codes = await client.batch_put_from_ranges(
                ["aio"], [len(data) - 1], [[(0, data_address + 1, len(data) - 1)]])
            out = ctypes.create_string_buffer(len(data))
            sizes = await client.batch_get_into(["aio"], [ctypes.addressof(out)], [len(data)])
            return codes, sizes, out.raw[:len(data) - 1]

    codes, sizes, raw = asyncio.run(main())
    assert codes == [0] and sizes == [len(data) - 1] and raw == data.raw[1:]
    with BlockingClient.connect(address, namespace="same-core") as client:
        assert client.get("aio") == data.raw[1:]


# -- many threads, one client -------------------------------------------------------------------

def _value(thread: int, index: int, size: int) -> bytes:
    stamp = f"{thread}:{index}:".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


def _worker(pool: ClientPool, thread: int, rounds: int, errors: list) -> None:
    rng = random.Random(thread)
    try:
        for index in range(rounds):
            size = rng.choice([1, 100, 4096, 70_000, 300_000])
            key = f"t{thread}-{index}"
            value = _value(thread, index, size)
            kind = index % 3
            if kind == 0:
                assert pool.put(key, value) is True
            elif kind == 1:
                buffer, buffer_address = _buffer(value)
                assert pool.batch_put_from([key], [buffer_address], [size]) == [0]
            else:
                half = size // 2
                first, first_address = _buffer(value[:half])
                second, second_address = _buffer(value[half:])
                assert pool.batch_put_from_ranges(
                    [key], [size], [[(0, first_address, half),
                                     (half, second_address, size - half)]]) == [0]
            assert pool.get(key) == value
            out = ctypes.create_string_buffer(size)
            assert pool.get_into_address(key, ctypes.addressof(out), size) == size
            assert out.raw == value
            assert pool.batch_exists([key, key + "-missing"]) == [True, False]
            if index % 5 == 4:
                pool.remove(key, force=True)  # our own reads hold a lease on it
                assert not pool.exists(key)
    except BaseException as exc:  # reported by the test, with the thread that failed
        errors.append((thread, repr(exc)))


def test_eight_threads_share_one_client_and_every_value_is_exact(address):
    with ClientPool.connect(address, namespace="threads", max_connections=8) as pool:
        errors: list = []
        threads = [threading.Thread(target=_worker, args=(pool, t, 60, errors))
                   for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert 1 <= pool._open_count <= 8
        status = pool.status()
        assert status["puts_in_progress"] == 0
        assert status["objects"] == 8 * (60 - 60 // 5)


def test_connections_are_bounded_and_a_waiting_call_gets_one_back(daemon):
    pool = ClientPool.connect(daemon.unix_address, max_connections=2)
    try:
        first, second = pool._borrow(), pool._borrow()
        assert first is not second
        answered = threading.Event()

        def third_call():
            pool.put("waited", b"v")
            answered.set()

        thread = threading.Thread(target=third_call)
        thread.start()
        assert not answered.wait(0.3)  # both connections are out
        pool._give_back(first, broken=False)
        assert answered.wait(10)
        thread.join()
        pool._give_back(second, broken=False)
        assert pool._open_count == 2
        assert pool.get("waited") == b"v"
    finally:
        pool.close()


def test_close_from_two_threads_and_calls_after_close(daemon):
    pool = ClientPool.connect(daemon.unix_address)
    pool.put("k", b"v" * 100_000)
    barrier = threading.Barrier(2)
    errors: list = []

    def close():
        barrier.wait()
        try:
            pool.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert pool.segments is None
    with pytest.raises(MooncakedError) as raised:
        pool.get("k")
    assert raised.value.code == ErrorCode.RPC_FAIL


# -- failures -----------------------------------------------------------------------------------

def test_a_daemon_restart_under_load(make_daemon):
    # Short leases: removed values free their memory soon (at the next sweep after the lease).
    daemon = make_daemon(store={"lease_ttl_ms": 200}, segments={"size_bytes": 256 << 20})
    pool = ClientPool.connect(daemon.unix_address, namespace="restart", max_connections=4)
    stop = threading.Event()
    outcomes: list = []

    def load(thread: int):
        index = 0
        while not stop.is_set():
            key, value = f"r{thread}-{index}", _value(thread, index, 80_000)
            try:
                pool.put(key, value)
                outcomes.append(("ok", pool.get(key) == value))
                pool.remove(key, force=True)  # keeps the store from filling up
            except MooncakedError as exc:
                outcomes.append(("error", exc.code))
            except BaseException as exc:
                outcomes.append(("raised", repr(exc)))
            index += 1

    threads = [threading.Thread(target=load, args=(t,)) for t in range(4)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        daemon.terminate()
        time.sleep(0.3)
        daemon.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                o == ("ok", True) for o in outcomes[-20:]):
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not [o for o in outcomes if o[0] == "raised"]
    assert ("ok", False) not in outcomes  # no wrong bytes, before or after
    errors = {o[1] for o in outcomes if o[0] == "error"}
    # RPC_FAIL: a write the restart cut off. The store's own answers under this load: a value
    # evicted before it was read, no space while removed values wait for their lease to end.
    assert errors <= {int(ErrorCode.RPC_FAIL), int(ErrorCode.SHUTTING_DOWN),
                      int(ErrorCode.OBJECT_NOT_FOUND), int(ErrorCode.NO_AVAILABLE_HANDLE)}
    assert int(ErrorCode.RPC_FAIL) in errors or int(ErrorCode.SHUTTING_DOWN) in errors
    assert outcomes[-1] == ("ok", True)
    assert pool.reconnects >= 1
    # The new daemon's segments are mapped: values move through shared memory again.
    value = b"z" * 200_000
    assert pool.put("after", value) and pool.get("after") == value
    pool.close()


class _FlakyDaemon:
    """A fake daemon on a Unix socket. It answers hello; then its first connection closes on
    its first request (a connection lost mid-request); later connections answer the methods in
    `answers` and close on any other."""

    def __init__(self, path: str, answers: dict) -> None:
        self.path = path
        self.answers = answers
        self.requests: list[str] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read(self, sock) -> tuple[int, str, list]:
        prefix = sock.recv(8, socket.MSG_WAITALL)
        if len(prefix) < 8:
            raise ConnectionError
        header_length, payload_length = framing.PREFIX.unpack(prefix)
        header = msgpack.unpackb(sock.recv(header_length, socket.MSG_WAITALL))
        if payload_length:
            sock.recv(payload_length, socket.MSG_WAITALL)
        return header[1], header[2], header[3]

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with sock:
                try:
                    msgid, _, _ = self._read(sock)
                    sock.sendall(framing.response_head(msgid, {"protocol": 1, "segments": [],
                                                               "lease_ttl_ms": 5000}))
                    while True:
                        msgid, method, _ = self._read(sock)
                        self.requests.append(method)
                        if self.connections == 1 or method not in self.answers:
                            break
                        sock.sendall(framing.response_head(msgid, self.answers[method]))
                except ConnectionError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_a_lost_read_is_sent_again_and_a_lost_write_reports_rpc_fail(tmp_path):
    fake = _FlakyDaemon(str(tmp_path / "fake.sock"), {"exists": True})
    try:
        pool = ClientPool.connect("unix:" + fake.path, max_connections=1)
        # The first connection closes on the read: it is sent again on a second one.
        assert pool.exists("k") is True
        assert fake.requests == ["exists", "exists"]
        # A write on a connection that is lost after sending: outcome unknown, RPC_FAIL.
        with pytest.raises(MooncakedError) as raised:
            pool.remove("k")
        assert raised.value.code == ErrorCode.RPC_FAIL
        assert fake.requests == ["exists", "exists", "remove"]
        pool.close()
    finally:
        fake.close()
