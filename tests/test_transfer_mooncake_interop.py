"""mooncaked's transfer layer against a real Mooncake Transfer Engine (the
mooncake-transfer-engine-non-cuda wheel, in P2PHANDSHAKE mode over tcp), both directions, data
checked byte for byte: Mooncake writes into and reads from memory registered here, and this
side's initiator writes into and reads from Mooncake's registered buffer; refusals, probe and
notify, and the v1 framing (MC_TCP_PROTO=1) as well.

The wheel lives in tools/engines/.venv-mooncake (tools/engines/mooncake_env.sh), never in the
project's venv, where `mooncake` is the compatibility package: the Mooncake side is a
subprocess of that venv's interpreter running tests/mooncake_te_driver.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import REPO, free_port
from mooncaked.transfer import (READ, WRITE, TransferEndpoint, TransferRequest,
                                TransferState)
from mooncaked.transfer.metadata import HttpMetadata
from mooncaked.transfer.mooncake_tcp import TcpInitiator, TransferFailed, TransferTarget
from transfer_helpers import LOOP_KINDS, GuardedMemory, LoopThread, loop_usable, pattern

MOONCAKE_PYTHON = os.path.join(REPO, "tools", "engines", ".venv-mooncake", "bin", "python")
DRIVER = os.path.join(REPO, "tests", "mooncake_te_driver.py")
OUR_BYTES = 1 << 20
THEIR_BYTES = 2 << 20

pytestmark = pytest.mark.skipif(
    not os.path.exists(MOONCAKE_PYTHON),
    reason="no Mooncake Transfer Engine environment: run `bash tools/engines/mooncake_env.sh`")


class Mooncake:
    """One real Mooncake TransferEngine process with one registered buffer."""

    def __init__(self, buffer_bytes: int, metadata: dict | None = None, **env: str) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-te-", suffix=".log",
                                                delete=False)
        environment = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", **env)
        environment.pop("PYTHONPATH", None)  # the wheel's `mooncake`, not compat/'s
        self.process = subprocess.Popen(
            [MOONCAKE_PYTHON, DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=environment, text=True, cwd=tempfile.gettempdir())
        started = self.call(op="start", buffer_bytes=buffer_bytes, **(metadata or {}))
        assert started.get("rc") == 0, started
        self.segment, self.address = started["segment"], started["address"]

    def call(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(10)
            raise AssertionError(f"Mooncake driver exited ({self.process.returncode}) on "
                                 f"{command}; log:\n{self.log()[-4000:]}")
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
            self.call(op="quit")
            self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._log.close()
            os.unlink(self._log.name)


@pytest.fixture(params=LOOP_KINDS)
def loop(request):
    usable, why = loop_usable(request.param)
    if not usable:
        pytest.skip(f"the io_uring loop cannot run here: {why}")
    thread = LoopThread(request.param)
    yield thread
    thread.close()


def start_endpoint(loop: LoopThread, memory: GuardedMemory, **options) -> TransferEndpoint:
    async def start():
        endpoint = TransferEndpoint("127.0.0.1", **options)
        await endpoint.start()
        await endpoint.register_memory(memory.address, memory.length)
        return endpoint
    return loop.run(start())


@pytest.fixture
def ours(loop):
    memory = GuardedMemory(OUR_BYTES)
    endpoint = start_endpoint(loop, memory)
    yield endpoint, memory
    loop.run(endpoint.close())
    assert memory.guards_intact()


@pytest.fixture
def mooncake():
    process = Mooncake(THEIR_BYTES)
    yield process
    process.close()


def test_mooncake_writes_and_reads_our_memory(ours, mooncake):
    endpoint, memory = ours
    data = pattern(64 * 1024, 1)
    mooncake.fill(0, data)
    assert mooncake.call(op="write", segment=endpoint.name, offset=0,
                         remote_address=memory.address + 4096, length=len(data))["rc"] == 0
    assert memory.read(4096, len(data)) == data
    assert memory.read(0, 4096) == bytes(4096)  # nothing before the target range

    served = pattern(OUR_BYTES, 2)
    memory.write(0, served)
    assert mooncake.call(op="read", segment=endpoint.name, offset=8192,
                         remote_address=memory.address + 100, length=300_000)["rc"] == 0
    assert mooncake.dump(8192, 300_000) == served[100:100 + 300_000]

    # A batch: 16 requests of 4 KiB, to scattered offsets, written then read back.
    offsets = [i * 4096 for i in range(16)]
    remote = [memory.address + 65536 * i + 17 * i for i in range(16)]
    mooncake.fill(0, pattern(16 * 4096, 3))
    assert mooncake.call(op="batch_write", segment=endpoint.name, offsets=offsets,
                         remote_addresses=remote, lengths=[4096] * 16)["rc"] == 0
    expected = pattern(16 * 4096, 3)
    for i in range(16):
        at = 65536 * i + 17 * i
        assert memory.read(at, 4096) == expected[i * 4096:(i + 1) * 4096]
    mooncake.fill(0, bytes(16 * 4096))
    assert mooncake.call(op="batch_read", segment=endpoint.name, offsets=offsets,
                         remote_addresses=remote, lengths=[4096] * 16)["rc"] == 0
    assert mooncake.dump(0, 16 * 4096) == expected
    assert endpoint._data.served_requests[2] >= 34 and endpoint._data.served_requests[1] == 0


def test_mooncake_write_outside_our_buffers_is_refused(ours, mooncake):
    endpoint, memory = ours
    mooncake.fill(0, pattern(8192, 4))
    before = memory.read(0, OUR_BYTES)
    # Just past the registered buffer (the guard band), straddling its end, and a READ from
    # before it: each refused with status 1, which Mooncake reports as a failed transfer.
    for op, address, length in [("write", memory.address + OUR_BYTES, 4096),
                                ("write", memory.address + OUR_BYTES - 100, 4096),
                                ("read", memory.address - 4096, 4096)]:
        assert mooncake.call(op=op, segment=endpoint.name, offset=0, remote_address=address,
                             length=length)["rc"] != 0, (op, address, length)
    assert memory.read(0, OUR_BYTES) == before
    assert memory.guards_intact()
    assert endpoint._data.rejected_requests >= 3
    # The endpoint still serves good requests afterwards.
    assert mooncake.call(op="write", segment=endpoint.name, offset=0,
                         remote_address=memory.address, length=8192)["rc"] == 0
    assert memory.read(0, 8192) == pattern(8192, 4)


def test_our_initiator_writes_and_reads_mooncake_memory(loop, ours, mooncake):
    endpoint, memory = ours
    data = pattern(OUR_BYTES, 5)
    memory.write(0, data)
    statuses = loop.run(endpoint.transfer([
        TransferRequest(WRITE, memory.address, mooncake.segment, mooncake.address + 1000,
                        OUR_BYTES)]))
    assert [s.state for s in statuses] == [TransferState.COMPLETED]
    assert statuses[0].transferred_bytes == OUR_BYTES
    assert mooncake.dump(1000, OUR_BYTES) == data
    assert mooncake.dump(0, 1000) == bytes(1000)

    theirs = pattern(THEIR_BYTES, 6)
    mooncake.fill(0, theirs)
    memory.write(0, bytes(OUR_BYTES))
    # 64 requests of 16 KiB in one batch, more than the connections per peer: they queue
    # and reuse connections.
    requests = [TransferRequest(READ, memory.address + i * 16384, mooncake.segment,
                                mooncake.address + 2 * i * 16384 + i, 16384) for i in range(64)]
    statuses = loop.run(endpoint.transfer(requests))
    assert [s for s in statuses if s.state != TransferState.COMPLETED] == []
    for i in range(64):
        at = 2 * i * 16384 + i
        assert memory.read(i * 16384, 16384) == theirs[at:at + 16384]
    assert endpoint._initiator.connections_opened <= endpoint._initiator.connections_per_peer


def test_mooncake_refuses_our_write_outside_its_buffers(loop, ours, mooncake):
    endpoint, memory = ours
    memory.write(0, pattern(4096, 7))
    # The endpoint checks the peer's descriptor first: nothing is sent.
    statuses = loop.run(endpoint.transfer([
        TransferRequest(WRITE, memory.address, mooncake.segment,
                        mooncake.address + THEIR_BYTES - 10, 4096)]))
    assert statuses[0].state == TransferState.INVALID
    # Sent anyway, below the endpoint: Mooncake answers status 1.
    descriptor = loop.run(endpoint.open_segment(mooncake.segment))
    target = TransferTarget(descriptor.tcp_data_host, descriptor.tcp_data_port, 2)

    async def send(opcode, address):
        initiator = TcpInitiator()
        try:
            await initiator.transfer(opcode, memory.view(0, 4096), target, address)
        finally:
            await initiator.close()
    for opcode in (WRITE, READ):
        with pytest.raises(TransferFailed, match="refused"):
            loop.run(send(opcode, mooncake.address + THEIR_BYTES - 10))
    assert mooncake.dump(THEIR_BYTES - 4096, 4096) == bytes(4096)
    assert "not within any registered buffer" in mooncake.log()


def test_probe_and_notify_both_ways(loop, ours, mooncake):
    endpoint, memory = ours
    assert mooncake.call(op="probe", segment=endpoint.name)["rc"] == 0
    mooncake.fill(0, pattern(4096, 8))
    assert mooncake.call(op="write", segment=endpoint.name, offset=0,
                         remote_address=memory.address, length=4096,
                         notify=["prefill-0", "blocks 1-3 ready"])["rc"] == 0
    assert memory.read(0, 4096) == pattern(4096, 8)
    notifies = endpoint.take_notifies()
    assert [(n.name, n.message) for n in notifies] == [("prefill-0", "blocks 1-3 ready")]

    assert loop.run(endpoint.probe(mooncake.segment)) is True
    loop.run(endpoint.send_notify(mooncake.segment, "decode-1", "done"))
    assert mooncake.call(op="notifies")["notifies"] == [["decode-1", "done"]]


def test_v1_framing_both_ways(loop):
    # Mooncake with MC_TCP_PROTO=1 sends v1 requests (no status frames) to our server.
    memory = GuardedMemory(OUR_BYTES)
    endpoint = start_endpoint(loop, memory, proto_version=1, connections_per_peer=1)
    mooncake = Mooncake(THEIR_BYTES, MC_TCP_PROTO="1")
    try:
        data = pattern(200_000, 9)
        mooncake.fill(0, data)
        assert mooncake.call(op="write", segment=endpoint.name, offset=0,
                             remote_address=memory.address + 5, length=len(data))["rc"] == 0
        # v1 has no acknowledgement: a READ on the same connection comes after the WRITE.
        mooncake.fill(0, bytes(len(data)))
        assert mooncake.call(op="read", segment=endpoint.name, offset=0,
                             remote_address=memory.address + 5, length=len(data))["rc"] == 0
        assert mooncake.dump(0, len(data)) == data
        assert memory.read(5, len(data)) == data
        assert endpoint._data.served_requests[1] >= 2
        assert endpoint._data.served_requests[2] == 0

        # Our initiator in v1 (proto_version=1) against Mooncake's server.
        ours = pattern(300_000, 10)
        memory.write(0, ours)
        statuses = loop.run(endpoint.transfer([
            TransferRequest(WRITE, memory.address, mooncake.segment, mooncake.address + 7,
                            len(ours))]))
        assert statuses[0].state == TransferState.COMPLETED
        # One connection per peer: this READ is answered after the WRITE landed.
        statuses = loop.run(endpoint.transfer([
            TransferRequest(READ, memory.address + 400_000, mooncake.segment,
                            mooncake.address + 7, len(ours))]))
        assert statuses[0].state == TransferState.COMPLETED
        assert memory.read(400_000, len(ours)) == ours
        assert mooncake.dump(7, len(ours)) == ours
        assert memory.guards_intact()
    finally:
        mooncake.close()
        loop.run(endpoint.close())


@pytest.fixture
def metadata_server():
    """Mooncake's own HTTP metadata server (from the wheel): its URL."""
    port = free_port()
    process = subprocess.Popen(
        [os.path.join(os.path.dirname(MOONCAKE_PYTHON), "mooncake_http_metadata_server"),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, \
                "mooncake_http_metadata_server did not start"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/metadata"
    process.kill()
    process.wait()


def test_http_metadata_mode_both_ways(loop, metadata_server):
    memory = GuardedMemory(OUR_BYTES)
    endpoint = start_endpoint(loop, memory, metadata_server=metadata_server,
                              segment_name="mooncaked-node")
    mooncake = Mooncake(THEIR_BYTES, metadata={"metadata": metadata_server,
                                               "name": "mooncake-node"})
    try:
        assert endpoint.name == "mooncaked-node" and mooncake.segment == "mooncake-node"
        # Mooncake finds this segment by name in the metadata server, and writes and reads.
        data = pattern(100_000, 11)
        mooncake.fill(0, data)
        assert mooncake.call(op="write", segment=endpoint.name, offset=0,
                             remote_address=memory.address + 9, length=len(data),
                             notify=["mooncake-node", "written"])["rc"] == 0
        assert memory.read(9, len(data)) == data
        assert [(n.name, n.message) for n in endpoint.take_notifies()] == \
            [("mooncake-node", "written")]
        memory.write(0, pattern(OUR_BYTES, 12))
        assert mooncake.call(op="read", segment=endpoint.name, offset=0,
                             remote_address=memory.address, length=OUR_BYTES)["rc"] == 0
        assert mooncake.dump(0, OUR_BYTES) == pattern(OUR_BYTES, 12)

        # And this side finds Mooncake's.
        ours = pattern(50_000, 13)
        memory.write(0, ours)
        statuses = loop.run(endpoint.transfer([
            TransferRequest(WRITE, memory.address, "mooncake-node", mooncake.address + 1,
                            len(ours))]))
        assert statuses[0].state == TransferState.COMPLETED
        assert mooncake.dump(1, len(ours)) == ours
        mooncake.fill(0, pattern(THEIR_BYTES, 14))
        statuses = loop.run(endpoint.transfer([
            TransferRequest(READ, memory.address + 500_000, "mooncake-node",
                            mooncake.address + 3, 400_000)]))
        assert statuses[0].state == TransferState.COMPLETED
        assert memory.read(500_000, 400_000) == pattern(THEIR_BYTES, 14)[3:400_003]
        assert loop.run(endpoint.probe("mooncake-node")) is True
        loop.run(endpoint.send_notify("mooncake-node", "mooncaked-node", "hi"))
        assert mooncake.call(op="notifies")["notifies"] == [["mooncaked-node", "hi"]]
    finally:
        mooncake.close()
        loop.run(endpoint.close())
    # Closing withdraws both keys, as Mooncake does at shutdown.
    store = HttpMetadata(metadata_server)
    assert loop.run(store.get("mooncake/ram/mooncaked-node")) is None
    assert loop.run(store.get("mooncake/rpc_meta/mooncaked-node")) is None
    assert loop.run(store.get("mooncake/ram/mooncake-node")) is None
    assert memory.guards_intact()
