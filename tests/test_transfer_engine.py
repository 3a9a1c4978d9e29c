"""mooncaked.transfer_engine.TransferEngine against a real daemon: the daemon serves each local
client's registered memory as a Mooncake TCP segment and moves its transfers, reaching the
client's memory with process_vm_readv / writev. Two client processes exchange data (this test
process and a driver subprocess), a real Mooncake process writes into and reads from a client's
memory and is written to and read from, data checked byte for byte; refusals, bad params, a
client that exits, threads sharing one engine."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from conftest import REPO, free_port
from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.transfer_engine import TransferEngine, TransferNotify, TransferOpcode
from transfer_helpers import GuardedMemory, pattern

MOONCAKE_PYTHON = os.path.join(REPO, "tools", "engines", ".venv-mooncake", "bin", "python")
OUR_DRIVER = os.path.join(REPO, "tests", "transfer_engine_driver.py")
MOONCAKE_DRIVER = os.path.join(REPO, "tests", "mooncake_te_driver.py")
OUR_BYTES = 4 << 20
THEIR_BYTES = 4 << 20


class Driver:
    """A TransferEngine process with one registered buffer (tests/mooncake_te_driver.py's
    commands): ours (mooncaked.transfer_engine, a client of the daemon) or the real wheel's."""

    def __init__(self, python: str, script: str, env: dict, buffer_bytes: int,
                 **start: str) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="te-driver-", suffix=".log",
                                                delete=False)
        self.process = subprocess.Popen([python, script], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env,
                                        text=True, cwd=tempfile.gettempdir())
        started = self.call(op="start", buffer_bytes=buffer_bytes, **start)
        assert started.get("rc") == 0, (started, self.log())
        self.segment, self.address = started["segment"], started["address"]

    def call(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(10)
            raise AssertionError(f"driver exited ({self.process.returncode}) on {command}; "
                                 f"log:\n{self.log()[-4000:]}")
        return json.loads(line)

    def fill(self, offset: int, data: bytes) -> None:
        self.call(op="fill", offset=offset, hex=data.hex())

    def dump(self, offset: int, length: int) -> bytes:
        return bytes.fromhex(self.call(op="dump", offset=offset, length=length)["hex"])

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.call(op="quit")
                self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._log.close()
            os.unlink(self._log.name)


@pytest.fixture
def engine(daemon, monkeypatch):
    monkeypatch.setenv("MOONCAKED_ADDRESS", daemon.unix_address)
    memory = GuardedMemory(OUR_BYTES)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.register_memory(memory.address, memory.length) == 0
    yield te, memory
    te.close()
    assert memory.guards_intact()


@pytest.fixture
def peer(daemon):
    """Another client process of the same daemon, with its own segment."""
    env = dict(os.environ, PYTHONPATH=REPO, MOONCAKED_ADDRESS=daemon.unix_address)
    driver = Driver(sys.executable, OUR_DRIVER, env, THEIR_BYTES)
    yield driver
    driver.close()


def daemon_segments(daemon) -> list[dict]:
    with BlockingClient.connect(daemon.unix_address, map_segments=False) as client:
        return client.call("status")["transfer"]["segments"]


def eventually(condition, attempts: int = 400) -> bool:
    """Poll `condition` (the daemon notices closed connections on its own loop)."""
    for _ in range(attempts):
        if condition():
            return True
        threading.Event().wait(0.05)
    return condition()


def test_two_client_processes_exchange_data(engine, peer, daemon):
    te, memory = engine
    assert te.get_segment_name() == f"127.0.0.1:{te.get_rpc_port()}"
    data = pattern(OUR_BYTES, 1)
    memory.write(0, data)
    # This process writes into the peer's buffer, then reads it back into another place.
    assert te.transfer_sync_write(peer.segment, memory.address, peer.address + 100,
                                  3 << 20) == 0
    assert peer.dump(100, 3 << 20) == data[:3 << 20]
    assert peer.dump(0, 100) == bytes(100)
    memory.write(0, bytes(OUR_BYTES))
    assert te.transfer_sync_read(peer.segment, memory.address + 7, peer.address + 100,
                                 3 << 20) == 0
    assert memory.read(7, 3 << 20) == data[:3 << 20]
    assert memory.read(0, 7) == bytes(7)

    # The peer process writes into and reads from this one's memory, and batches both ways.
    theirs = pattern(THEIR_BYTES, 2)
    peer.fill(0, theirs)
    assert peer.call(op="write", segment=te.get_segment_name(), offset=0,
                     remote_address=memory.address, length=THEIR_BYTES)["rc"] == 0
    assert memory.read(0, THEIR_BYTES) == theirs
    offsets = [i * 65536 for i in range(32)]
    remote = [memory.address + i * 100_000 + i for i in range(32)]
    peer.fill(0, bytes(THEIR_BYTES))
    assert peer.call(op="batch_read", segment=te.get_segment_name(), offsets=offsets,
                     remote_addresses=remote, lengths=[65536] * 32)["rc"] == 0
    got = peer.dump(0, 32 * 65536)
    for i in range(32):
        at = i * 100_000 + i
        assert got[i * 65536:(i + 1) * 65536] == theirs[at:at + 65536]

    mine = pattern(16 * 4096, 3)
    memory.write(0, mine)
    assert te.batch_transfer_sync_write(peer.segment, [memory.address + i * 4096
                                                       for i in range(16)],
                                        [peer.address + i * 8192 for i in range(16)],
                                        [4096] * 16) == 0
    for i in range(16):
        assert peer.dump(i * 8192, 4096) == mine[i * 4096:(i + 1) * 4096]
    memory.write(0, bytes(16 * 4096))
    assert te.batch_transfer_sync_read(peer.segment, [memory.address + i * 4096
                                                      for i in range(16)],
                                       [peer.address + i * 8192 for i in range(16)],
                                       [4096] * 16) == 0
    assert memory.read(0, 16 * 4096) == mine

    [ours] = [s for s in daemon_segments(daemon) if s["segment"] == te.get_segment_name()]
    assert ours["pid"] == os.getpid() and ours["buffers"] == 1
    assert ours["registered_bytes"] == OUR_BYTES
    assert ours["requests_completed"] >= 34 and ours["requests_failed"] == 0
    assert ours["served_requests"] >= 33


def test_async_batches_and_status(engine, peer):
    te, memory = engine
    data = pattern(1 << 20, 4)
    memory.write(0, data)
    batch = te.batch_transfer_async_write(peer.segment, [memory.address, memory.address + 4096],
                                          [peer.address, peer.address + 65536], [4096, 8192])
    assert batch > 0
    assert te.get_batch_transfer_status([batch]) == 0
    assert peer.dump(0, 4096) == data[:4096]
    assert peer.dump(65536, 8192) == data[4096:4096 + 8192]
    # A freed batch is unknown afterwards.
    assert te.get_batch_transfer_status([batch]) == -1

    submitted = te.transfer_submit_write(peer.segment, memory.address, peer.address + 300_000,
                                         1 << 20)
    assert submitted > 0
    while (state := te.transfer_check_status(submitted)) == 0:
        pass
    assert state == 1
    assert peer.dump(300_000, 1 << 20) == data

    memory.write(0, bytes(1 << 20))
    batch = te.batch_transfer_async(peer.segment, [memory.address], [peer.address + 300_000],
                                    [1 << 20], TransferOpcode.Read)
    assert te.get_batch_transfer_status([batch]) == 0
    assert memory.read(0, 1 << 20) == data

    # A failing request: its batch reports failure.
    bad = te.batch_transfer_async_read(peer.segment, [memory.address], [peer.address - 4096],
                                       [4096])
    assert bad > 0
    assert te.get_batch_transfer_status([bad]) == -1
    failing = te.transfer_submit_write(peer.segment, memory.address,
                                       peer.address + THEIR_BYTES, 16)
    while (state := te.transfer_check_status(failing)) == 0:
        pass
    assert state == -1


def test_notify_and_probe_and_buffers(engine, peer):
    te, memory = engine
    memory.write(0, b"hello")
    assert te.transfer_sync(peer.segment, memory.address, peer.address, 5,
                            TransferOpcode.Write, TransferNotify("req-1", "blocks 0-3")) == 0
    assert peer.dump(0, 5) == b"hello"
    assert peer.call(op="notifies")["notifies"] == [["req-1", "blocks 0-3"]]
    assert peer.call(op="write", segment=te.get_segment_name(), offset=0,
                     remote_address=memory.address, length=5,
                     notify=["peer", "done"])["rc"] == 0
    notifies = te.get_notifies()
    assert [(n.name, n.msg) for n in notifies] == [("peer", "done")]
    assert te.get_notifies() == []
    assert te.send_probe(peer.segment) == 0
    assert te.get_first_buffer_address(peer.segment) == peer.address
    assert te.get_first_buffer_address(te.get_segment_name()) == memory.address


def test_unregistered_addresses_are_refused(engine, peer):
    te, memory = engine
    memory.write(0, pattern(8192, 5))
    outside = GuardedMemory(8192)  # never registered
    # Local side: a buffer this process never registered.
    assert te.transfer_sync_write(peer.segment, outside.address, peer.address, 4096) == -1
    # Remote side: outside the peer's buffer, and straddling its end.
    assert te.transfer_sync_write(peer.segment, memory.address, peer.address + THEIR_BYTES,
                                  16) == -1
    assert te.transfer_sync_write(peer.segment, memory.address,
                                  peer.address + THEIR_BYTES - 100, 4096) == -1
    # A peer writing outside this process's registered memory is refused: nothing changes.
    peer.fill(0, pattern(8192, 6))
    before = memory.read(0, OUR_BYTES)
    for op, address in [("write", memory.address + OUR_BYTES), ("read", memory.address - 4096),
                        ("write", outside.address)]:
        assert peer.call(op=op, segment=te.get_segment_name(), offset=0,
                         remote_address=address, length=4096)["rc"] != 0, (op, address)
    assert memory.read(0, OUR_BYTES) == before
    assert outside.guards_intact() and outside.read(0, 8192) == bytes(8192)
    # After unregistering, the range is refused too; and still served after registering again.
    assert te.unregister_memory(memory.address) == 0
    assert te.unregister_memory(memory.address) == -1
    assert peer.call(op="write", segment=te.get_segment_name(), offset=0,
                     remote_address=memory.address, length=4096)["rc"] != 0
    assert te.register_memory(memory.address, memory.length) == 0
    assert peer.call(op="write", segment=te.get_segment_name(), offset=0,
                     remote_address=memory.address, length=4096)["rc"] == 0
    assert memory.read(0, 4096) == pattern(8192, 6)[:4096]


def test_managed_buffers(engine, peer):
    te, _ = engine
    address = te.allocate_managed_buffer(1 << 16)
    assert address != 0
    assert te.write_bytes_to_buffer(address, b"managed!", 8) == 0
    assert te.transfer_sync_write(peer.segment, address, peer.address, 8) == 0
    assert peer.dump(0, 8) == b"managed!"
    peer.fill(0, b"from the peer")
    assert te.transfer_sync_read(peer.segment, address + 100, peer.address, 13) == 0
    assert te.read_bytes_from_buffer(address + 100, 13) == b"from the peer"
    assert te.free_managed_buffer(address, 1 << 16) == 0
    assert te.free_managed_buffer(address, 1 << 16) == -1


def test_threads_share_one_engine(engine, peer, daemon):
    te, memory = engine
    data = pattern(OUR_BYTES, 7)
    memory.write(0, data)
    errors: list = []
    piece = OUR_BYTES // 8
    # Every thread stays alive until the attached connections are counted: a thread's first
    # call closes the connections of threads that have ended.
    done, counted = threading.Barrier(9), threading.Event()

    def work(i: int) -> None:
        at = i * piece
        if te.transfer_sync_write(peer.segment, memory.address + at, peer.address + at,
                                  piece) != 0:
            errors.append(("write", i))
        batch = te.batch_transfer_async_read(peer.segment, [memory.address + at],
                                             [peer.address + at], [piece])
        if batch == 0 or te.get_batch_transfer_status([batch]) != 0:
            errors.append(("read", i))
        done.wait(300)  # bounds a hang, asserts nothing
        counted.wait(300)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        done.wait(300)
        # Each thread has a connection of its own, attached to the one segment.
        [ours] = [s for s in daemon_segments(daemon) if s["segment"] == te.get_segment_name()]
    finally:
        counted.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert ours["attached_connections"] == 8
    assert ours["requests_completed"] == 16 and ours["requests_failed"] == 0
    assert peer.dump(0, OUR_BYTES) == data
    assert memory.read(0, OUR_BYTES) == data
    # A thread started after those ended closes their connections on its first call.
    late = threading.Thread(target=lambda: errors.append(te.send_probe(peer.segment)))
    late.start()
    late.join()
    assert errors == [0]
    assert eventually(lambda: [s["attached_connections"] for s in daemon_segments(daemon)
                               if s["segment"] == te.get_segment_name()] == [1])


def test_a_client_that_exits_releases_its_segment(daemon):
    env = dict(os.environ, PYTHONPATH=REPO, MOONCAKED_ADDRESS=daemon.unix_address)
    driver = Driver(sys.executable, OUR_DRIVER, env, 1 << 16)
    try:
        [segment] = daemon_segments(daemon)
        assert segment["segment"] == driver.segment and segment["pid"] == driver.process.pid
        driver.process.kill()  # no goodbye: the connection just closes
        driver.process.wait()
        assert eventually(lambda: daemon_segments(daemon) == [])
        host, port = driver.segment.rsplit(":", 1)
        for listener in (int(port), segment["data_port"]):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, listener), timeout=5).close()
    finally:
        driver.close()


def test_bad_params_get_clear_errors(daemon, monkeypatch):
    with BlockingClient.connect(daemon.unix_address, map_segments=False) as client:
        with pytest.raises(MooncakedError) as failure:
            client.call("te_submit", [[1, 4096, "127.0.0.1:1", 4096, 16]])
        assert failure.value.code == ErrorCode.SEGMENT_NOT_FOUND
        for options, code, words in [
                ({"local_hostname": "127.0.0.1", "protocol": "rdma"}, ErrorCode.NOT_SUPPORTED,
                 "only \"tcp\""),
                ({"local_hostname": "127.0.0.1", "metadata_server": "etcd://h:2379"},
                 ErrorCode.NOT_SUPPORTED, "P2PHANDSHAKE"),
                ({"local_hostname": ""}, ErrorCode.INVALID_PARAMS, "local_hostname"),
                ({"local_hostname": "no-such-host.invalid"}, ErrorCode.INVALID_PARAMS,
                 "cannot listen on no-such-host.invalid"),
                ({"local_hostname": "127.0.0.1", "colour": 1}, ErrorCode.INVALID_PARAMS,
                 "colour")]:
            with pytest.raises(MooncakedError) as failure:
                client.call("te_open", options)
            assert failure.value.code == code and words in failure.value.message, options
        opened = client.call("te_open", {"local_hostname": "127.0.0.1"})
        assert opened["daemon_pid"] == daemon.process.pid
        with BlockingClient.connect(daemon.unix_address, map_segments=False) as other:
            with pytest.raises(MooncakedError) as failure:
                other.call("te_attach", opened["segment"], "0" * 32)
            assert failure.value.code == ErrorCode.SEGMENT_NOT_FOUND
            with pytest.raises(MooncakedError) as failure:
                other.call("te_wait", 1)
            assert failure.value.code == ErrorCode.SEGMENT_NOT_FOUND
            other.call("te_attach", opened["segment"], opened["attach_token"])
            with pytest.raises(MooncakedError) as failure:
                other.call("te_wait", 1)
            assert failure.value.code == ErrorCode.INVALID_PARAMS  # attached: no such batch
        with pytest.raises(MooncakedError) as failure:
            client.call("te_open", {"local_hostname": "127.0.0.1"})
        assert failure.value.code == ErrorCode.SEGMENT_ALREADY_EXISTS
        # Memory this process has not mapped: refused at registration, saying why.
        with pytest.raises(MooncakedError) as failure:
            client.call("te_register", [[4096, 4096]])
        assert failure.value.code == ErrorCode.INVALID_PARAMS
        assert "not mapped" in failure.value.message
        memory = GuardedMemory(8192)
        client.call("te_register", [[memory.address, 8192]])
        with pytest.raises(MooncakedError) as failure:  # overlaps
            client.call("te_register", [[memory.address + 4096, 8192]])
        assert "overlaps" in failure.value.message
        for requests, words in [([[2, memory.address, "x:1", 0, 1]], "opcode"),
                                ([[1, -1, "x:1", 0, 1]], "local_address"),
                                ([[1, memory.address, "", 0, 1]], "segment"),
                                ([], "non-empty")]:
            with pytest.raises(MooncakedError) as failure:
                client.call("te_submit", requests)
            assert failure.value.code == ErrorCode.INVALID_PARAMS
            assert words in failure.value.message, requests
        with pytest.raises(MooncakedError) as failure:
            client.call("te_wait", 12345)
        assert failure.value.code == ErrorCode.INVALID_PARAMS
        # A segment name that is not host:port fails its request, not the call.
        batch = client.call("te_submit", [[1, memory.address, "nohost", 0, 1]])
        [[state, moved, error]] = client.call("te_wait", batch)
        assert state == 6 and moved == 0 and "host:rpc_port" in error
    # Over TCP: the daemon cannot know the client's pid, so no segment.
    with BlockingClient.connect(daemon.tcp_address, map_segments=False) as client:
        with pytest.raises(MooncakedError) as failure:
            client.call("te_open", {"local_hostname": "127.0.0.1"})
        assert failure.value.code == ErrorCode.NOT_SUPPORTED and "Unix" in failure.value.message
    # The client API answers Mooncake's codes.
    monkeypatch.setenv("MOONCAKED_ADDRESS", daemon.tcp_address)
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    te = TransferEngine()
    assert te.register_memory(memory.address, 8192) == -1  # not initialized
    assert te.batch_transfer_async_write("127.0.0.1:1", [1], [1], [1]) == 0


def test_transfer_engine_can_be_turned_off(make_daemon, monkeypatch):
    daemon = make_daemon(transfer={"enabled": False})
    with BlockingClient.connect(daemon.unix_address, map_segments=False) as client:
        with pytest.raises(MooncakedError) as failure:
            client.call("te_open", {"local_hostname": "127.0.0.1"})
        assert failure.value.code == ErrorCode.NOT_SUPPORTED and "enabled" in failure.value.message
        assert client.call("status")["transfer"] is None


@pytest.mark.skipif(not os.path.exists(MOONCAKE_PYTHON),
                    reason="no Mooncake Transfer Engine environment: run "
                    "`bash tools/engines/mooncake_env.sh`")
def test_real_mooncake_and_a_mooncaked_client(engine):
    te, memory = engine
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    env.pop("PYTHONPATH", None)  # the wheel's `mooncake`, not compat/'s
    mooncake = Driver(MOONCAKE_PYTHON, MOONCAKE_DRIVER, env, THEIR_BYTES)
    try:
        # Mooncake writes into and reads from this client's registered memory.
        theirs = pattern(THEIR_BYTES, 8)
        mooncake.fill(0, theirs)
        assert mooncake.call(op="write", segment=te.get_segment_name(), offset=0,
                             remote_address=memory.address + 4096, length=3 << 20)["rc"] == 0
        assert memory.read(4096, 3 << 20) == theirs[:3 << 20]
        assert memory.read(0, 4096) == bytes(4096)
        served = pattern(OUR_BYTES, 9)
        memory.write(0, served)
        assert mooncake.call(op="read", segment=te.get_segment_name(), offset=100,
                             remote_address=memory.address + 5, length=2 << 20)["rc"] == 0
        assert mooncake.dump(100, 2 << 20) == served[5:5 + (2 << 20)]
        offsets = [i * 4096 for i in range(16)]
        remote = [memory.address + i * 65536 for i in range(16)]
        mooncake.fill(0, bytes(16 * 4096))
        assert mooncake.call(op="batch_read", segment=te.get_segment_name(), offsets=offsets,
                             remote_addresses=remote, lengths=[4096] * 16)["rc"] == 0
        got = mooncake.dump(0, 16 * 4096)
        for i in range(16):
            assert got[i * 4096:(i + 1) * 4096] == served[i * 65536:i * 65536 + 4096]
        # And this client writes into and reads from Mooncake's buffer.
        assert te.transfer_sync_write(mooncake.segment, memory.address, mooncake.address + 1,
                                      3 << 20) == 0
        assert mooncake.dump(1, 3 << 20) == served[:3 << 20]
        memory.write(0, bytes(OUR_BYTES))
        assert te.batch_transfer_sync_read(mooncake.segment,
                                           [memory.address, memory.address + (2 << 20)],
                                           [mooncake.address + 1, mooncake.address + 4096],
                                           [1 << 20, 65536]) == 0
        assert memory.read(0, 1 << 20) == served[:1 << 20]
        assert memory.read(2 << 20, 65536) == served[4095:4095 + 65536]
        # Outside Mooncake's buffer: refused by it, reported as a failure here.
        assert te.transfer_sync_write(mooncake.segment, memory.address,
                                      mooncake.address + THEIR_BYTES, 4096) == -1
    finally:
        mooncake.close()


@pytest.fixture
def metadata_server():
    """Mooncake's own HTTP metadata server (from the wheel): its URL."""
    if not os.path.exists(MOONCAKE_PYTHON):
        pytest.skip("no Mooncake Transfer Engine environment: run "
                    "`bash tools/engines/mooncake_env.sh`")
    port = free_port()
    process = subprocess.Popen(
        [os.path.join(os.path.dirname(MOONCAKE_PYTHON), "mooncake_http_metadata_server"),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, "mooncake_http_metadata_server exited"
                threading.Event().wait(0.1)
        yield f"http://127.0.0.1:{port}/metadata"
    finally:
        process.kill()
        process.wait()


def test_http_metadata_mode_with_real_mooncake(make_daemon, monkeypatch, metadata_server):
    daemon = make_daemon(transfer={"bind_host": "127.0.0.1"})
    monkeypatch.setenv("MOONCAKED_ADDRESS", daemon.unix_address)
    memory = GuardedMemory(1 << 20)
    te = TransferEngine()
    # A free-form segment name (not resolvable): the daemon advertises its bind_host.
    assert te.initialize("mooncaked-client", metadata_server, "tcp", "") == 0
    assert te.get_segment_name() == "mooncaked-client"
    assert te.register_memory(memory.address, memory.length) == 0
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    env.pop("PYTHONPATH", None)
    mooncake = Driver(MOONCAKE_PYTHON, MOONCAKE_DRIVER, env, THEIR_BYTES,
                      metadata=metadata_server, name="mooncake-node")
    try:
        data = pattern(100_000, 11)
        mooncake.fill(0, data)
        assert mooncake.call(op="write", segment="mooncaked-client", offset=0,
                             remote_address=memory.address + 9, length=len(data))["rc"] == 0
        assert memory.read(9, len(data)) == data
        memory.write(0, pattern(1 << 20, 12))
        assert te.transfer_sync_write("mooncake-node", memory.address, mooncake.address + 1,
                                      1 << 20) == 0
        assert mooncake.dump(1, 1 << 20) == pattern(1 << 20, 12)
    finally:
        mooncake.close()
        te.close()
    assert memory.guards_intact()


def test_small_staging_buffers_and_odd_lengths(make_daemon, monkeypatch):
    """Requests many staging buffers long, not a multiple of one, both directions."""
    daemon = make_daemon(transfer={"staging_bytes": 4096})
    monkeypatch.setenv("MOONCAKED_ADDRESS", daemon.unix_address)
    memory = GuardedMemory(1 << 20)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.register_memory(memory.address, memory.length) == 0
    env = dict(os.environ, PYTHONPATH=REPO, MOONCAKED_ADDRESS=daemon.unix_address)
    peer = Driver(sys.executable, OUR_DRIVER, env, 1 << 20)
    try:
        data = pattern(1 << 20, 21)
        memory.write(0, data)
        assert te.transfer_sync_write(peer.segment, memory.address + 3, peer.address + 5,
                                      100_003) == 0
        assert peer.dump(0, 5) == bytes(5)
        assert peer.dump(5, 100_003) == data[3:100_006]
        assert peer.dump(100_008, 10) == bytes(10)
        memory.write(0, bytes(1 << 20))
        assert te.transfer_sync_read(peer.segment, memory.address + 11, peer.address + 5,
                                     100_003) == 0
        assert memory.read(11, 100_003) == data[3:100_006]
        assert memory.read(0, 11) == bytes(11)
        theirs = pattern(1 << 20, 22)
        peer.fill(0, theirs)
        assert peer.call(op="write", segment=te.get_segment_name(), offset=1,
                         remote_address=memory.address + 7, length=65_537)["rc"] == 0
        assert memory.read(7, 65_537) == theirs[1:65_538]
        memory.write(0, data)
        assert peer.call(op="read", segment=te.get_segment_name(), offset=0,
                         remote_address=memory.address + 9, length=77_777)["rc"] == 0
        assert peer.dump(0, 77_777) == data[9:9 + 77_777]
    finally:
        peer.close()
        te.close()
    assert memory.guards_intact()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root and setpriv to run a reader without ptrace rights")
def test_memory_the_daemon_may_not_read_is_refused_at_registration_saying_why():
    """A reader without the right to ptrace this process (another user, no CAP_SYS_PTRACE),
    as a daemon would be that runs as another user than its client: EPERM, and the message
    says what is needed."""
    memory = GuardedMemory(4096)
    # The reader runs as nobody, who may not read the checkout (a CI clone in a mode-700 temp
    # directory): it gets a readable copy of the two modules it needs, as a package of its own.
    readable = tempfile.mkdtemp()
    os.chmod(readable, 0o755)
    package = os.path.join(readable, "reader_pkg")
    os.mkdir(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    for name in ("process_memory.py", "descriptors.py"):
        shutil.copy(os.path.join(REPO, "mooncaked", "transfer", name), package)
    os.chmod(package, 0o755)
    reader = ("import sys\n"
              "from reader_pkg.process_memory import ProcessMemory, "
              "ProcessMemoryError\n"
              "try:\n"
              "    ProcessMemory(int(sys.argv[1])).register(int(sys.argv[2]), 4096)\n"
              "    print('registered')\n"
              "except ProcessMemoryError as e:\n"
              "    print(e.errno, e.strerror)\n")
    result = subprocess.run(
        ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "--inh-caps=-all", sys.executable, "-c", reader, str(os.getpid()),
         str(memory.address)],
        env=dict(os.environ, PYTHONPATH=readable), capture_output=True, text=True, timeout=60,
        cwd=tempfile.gettempdir())
    shutil.rmtree(readable)
    code, _, message = result.stdout.strip().partition(" ")
    assert code == "1", result  # EPERM
    assert "CAP_SYS_PTRACE" in message and "same user" in message and "PR_SET_PTRACER" in message


def test_max_segments_is_enforced(make_daemon):
    daemon = make_daemon(transfer={"max_segments": 1})
    with BlockingClient.connect(daemon.unix_address, map_segments=False) as first, \
            BlockingClient.connect(daemon.unix_address, map_segments=False) as second:
        first.call("te_open", {"local_hostname": "127.0.0.1"})
        with pytest.raises(MooncakedError) as failure:
            second.call("te_open", {"local_hostname": "127.0.0.1"})
        assert failure.value.code == ErrorCode.BUSY and "max_segments" in failure.value.message
        first.call("te_close")
        second.call("te_open", {"local_hostname": "127.0.0.1"})
