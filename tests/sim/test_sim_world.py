"""The simulator's world alone: the virtual-time loop (mooncaked/sim/loop.py) and the simulated
streams (mooncaked/sim/streams.py)."""

from __future__ import annotations

import asyncio
import contextvars
import random
import time

import pytest

from mooncaked import environment
from mooncaked.sim.loop import Stalled, VirtualTimeLoop
from mooncaked.sim.streams import Network
from mooncaked.sim.world import NodeEnvironment


@pytest.fixture
def loop():
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


def node_context(loop, name: str) -> tuple[NodeEnvironment, contextvars.Context]:
    env = NodeEnvironment(name, loop, random.Random(1), 100.0, 1.0)
    context = contextvars.Context()
    context.run(environment.current.set, env)
    return env, context


def test_time_is_virtual_and_nothing_sleeps(loop):
    started = time.monotonic()
    order = []

    async def main():
        loop.call_later(3600, order.append, "hour")
        loop.call_later(1, order.append, "second")
        await asyncio.sleep(7200)
        return loop.time()
    assert loop.run_until_complete(main()) == pytest.approx(7200)
    assert order == ["second", "hour"]
    assert time.monotonic() - started < 30  # two virtual hours, no real waiting


def test_a_loop_with_nothing_to_do_stalls(loop):
    async def forever():
        await loop.create_future()
    with pytest.raises(Stalled):
        loop.run_until_complete(forever())


def test_executor_work_runs_on_the_loop_after_the_chosen_delay(loop):
    loop.executor_delay = lambda: 0.25

    async def main():
        return await loop.run_in_executor(None, lambda: (42, loop.time()))
    assert loop.run_until_complete(main()) == (42, pytest.approx(0.25))


def test_a_node_reads_its_own_drifting_clock(loop):
    env = NodeEnvironment("n1", loop, random.Random(1), 100.0, 1.5)
    _, context = env, contextvars.Context()
    context.run(environment.current.set, env)
    loop.run_until_complete(asyncio.sleep(2))
    assert context.run(environment.monotonic) == pytest.approx(103.0)
    assert environment.monotonic() != pytest.approx(103.0)  # the world's is the system's
    assert context.run(environment.random_bytes, 8) == random.Random(1).randbytes(8)


def test_a_paused_node_runs_nothing_until_resumed_and_a_crashed_one_never(loop):
    paused, paused_context = node_context(loop, "n1")
    crashed, crashed_context = node_context(loop, "n2")
    ran = []
    for at in (1, 2, 3):
        loop.call_later(at, ran.append, ("n1", at), context=paused_context)
        loop.call_later(at, ran.append, ("n2", at), context=crashed_context)

    async def main():
        await asyncio.sleep(1.5)
        paused.paused = True
        crashed.crashed = True
        await asyncio.sleep(2)
        assert ran == [("n1", 1), ("n2", 1)]
        loop.resume(paused)
        await asyncio.sleep(0)
    loop.run_until_complete(main())
    assert ran == [("n1", 1), ("n2", 1), ("n1", 2), ("n1", 3)]


class Recorder(asyncio.Protocol):
    def __init__(self, log=None):
        self.log = log if log is not None else []
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        self.log.append("made")

    def data_received(self, data):
        self.log.append(bytes(data))

    def eof_received(self):
        self.log.append("eof")

    def connection_lost(self, exc):
        self.log.append(("lost", type(exc).__name__ if exc else None))


class BufferedRecorder(asyncio.BufferedProtocol):
    def __init__(self):
        self.buffer = bytearray(3)  # small: a delivery takes several get_buffer calls
        self.received = bytearray()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, hint):
        return memoryview(self.buffer)

    def buffer_updated(self, count):
        self.received += self.buffer[:count]

    def connection_lost(self, exc):
        pass


def serve(loop, network, name, port, factory):
    _, context = node_context(loop, name)
    return context.run(network.listen, factory, "127.0.0.1", port)


def connect_from(loop, name, port, factory):
    env, context = node_context(loop, name)
    task = context.run(loop.create_task,
                       loop.create_connection(factory, "127.0.0.1", port))
    return env, task


def test_a_stream_keeps_its_order_whatever_the_delays(loop):
    network = Network(loop, random.Random(5), min_delay_s=0.001, max_delay_s=0.050)
    server_log = []
    serve(loop, network, "a", 1, lambda: Recorder(server_log))
    _, connecting = connect_from(loop, "b", 1, Recorder)

    async def main():
        transport, _ = await connecting
        for i in range(50):
            transport.write(b"%d," % i)
        transport.close()
        await asyncio.sleep(1)
    loop.run_until_complete(main())
    data = b"".join(x for x in server_log if isinstance(x, bytes))
    assert data == b"".join(b"%d," % i for i in range(50))
    assert server_log[0] == "made" and server_log[-2:] == ["eof", ("lost", None)]


def test_a_buffered_protocol_gets_every_byte_through_small_buffers(loop):
    network = Network(loop, random.Random(5))
    protocols = []
    serve(loop, network, "a", 1, lambda: protocols.append(BufferedRecorder()) or protocols[-1])
    _, connecting = connect_from(loop, "b", 1, Recorder)

    async def main():
        transport, _ = await connecting
        transport.write(b"0123456789" * 10)
        await asyncio.sleep(1)
    loop.run_until_complete(main())
    assert bytes(protocols[0].received) == b"0123456789" * 10


def test_a_partition_holds_bytes_until_it_heals(loop):
    network = Network(loop, random.Random(5))
    server_log = []
    serve(loop, network, "a", 1, lambda: Recorder(server_log))
    _, connecting = connect_from(loop, "b", 1, Recorder)

    async def main():
        transport, _ = await connecting
        await asyncio.sleep(0.1)
        network.partition({"a"}, {"b"})
        transport.write(b"held")
        await asyncio.sleep(5)
        assert b"held" not in server_log
        network.heal()
        await asyncio.sleep(0.1)
    loop.run_until_complete(main())
    assert b"held" in server_log


def test_a_reset_partition_and_a_crash_reset_the_other_side(loop):
    network = Network(loop, random.Random(5))
    serve(loop, network, "a", 1, Recorder)
    _, connecting = connect_from(loop, "b", 1, Recorder)
    serve(loop, network, "c", 2, Recorder)
    _, connecting_c = connect_from(loop, "d", 2, Recorder)

    async def main():
        _, protocol = await connecting
        _, protocol_c = await connecting_c
        await asyncio.sleep(0.1)
        network.reset_on_partition = True
        network.partition({"a"}, {"b"})
        network.crash("c")
        await asyncio.sleep(0.1)
        return protocol.log, protocol_c.log
    log, log_c = loop.run_until_complete(main())
    assert log[-1] == ("lost", "ConnectionResetError")
    assert log_c[-1] == ("lost", "ConnectionResetError")


def test_connecting_to_a_dead_address_is_refused_and_across_a_partition_times_out(loop):
    network = Network(loop, random.Random(5))
    serve(loop, network, "a", 1, Recorder)
    network.partition({"a"}, {"b"})
    _, refused = connect_from(loop, "b", 9, Recorder)
    _, cut = connect_from(loop, "b", 1, Recorder)

    async def main():
        results = await asyncio.gather(refused, cut, return_exceptions=True)
        return [type(r).__name__ for r in results]
    assert loop.run_until_complete(main()) == ["ConnectionRefusedError", "TimeoutError"]


def test_data_for_a_closed_connection_is_answered_with_a_reset(loop):
    network = Network(loop, random.Random(5))
    accepted = []
    serve(loop, network, "a", 1, lambda: accepted.append(Recorder()) or accepted[-1])
    _, connecting = connect_from(loop, "b", 1, Recorder)

    async def main():
        transport, protocol = await connecting
        await asyncio.sleep(0.1)
        network.partition({"a"}, {"b"})
        accepted[0].transport.abort()  # its reset is held by the partition
        await asyncio.sleep(0.1)
        network.heal()
        transport.write(b"late")
        await asyncio.sleep(0.1)
        return protocol.log
    assert loop.run_until_complete(main())[-1] == ("lost", "ConnectionResetError")
