"""Scheduling on both loops: callbacks, timers, threads, tasks, errors, signals, fds, close.

Every test runs on the io_uring loop and on stdlib asyncio (conftest.py). What is checked is
order and outcome, never how long anything took.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading

import pytest

from mooncaked.io.uring import UringEventLoop

from .support import is_uring, run


def test_is_an_asyncio_loop(loop):
    assert isinstance(loop, asyncio.AbstractEventLoop)
    assert not loop.is_running() and not loop.is_closed()

    async def inside():
        assert asyncio.get_running_loop() is loop
        return loop.is_running()

    assert run(loop, inside()) is True


def test_call_soon_runs_in_order(loop):
    order = []
    for i in range(10):
        loop.call_soon(order.append, i)
    loop.call_soon(loop.stop)
    loop.run_forever()
    assert order == list(range(10))


def test_call_soon_from_a_callback_waits_for_the_next_iteration(loop):
    order = []

    def first():
        order.append("first")
        loop.call_soon(order.append, "scheduled by first")

    loop.call_soon(first)
    loop.call_soon(order.append, "second")
    loop.call_soon(loop.stop)
    loop.run_forever()
    assert order == ["first", "second"]  # stop() took effect after that iteration
    loop.call_soon(loop.stop)
    loop.run_forever()
    assert order == ["first", "second", "scheduled by first"]


def test_timers_run_earliest_first_and_after_ready_callbacks(loop):
    order = []
    loop.call_later(0.03, order.append, "late")
    loop.call_later(0.01, order.append, "early")
    loop.call_later(0.02, order.append, "middle")
    loop.call_soon(order.append, "soon")
    loop.call_later(0.05, loop.stop)
    loop.run_forever()
    assert order == ["soon", "early", "middle", "late"]


def test_timers_with_the_same_deadline_run_in_call_order(loop):
    if not is_uring(loop):
        pytest.skip("stdlib asyncio's heapq does not keep equal deadlines in call order")
    order = []
    when = loop.time() + 0.01
    for i in range(50):
        loop.call_at(when, order.append, i)
    loop.call_at(when + 0.01, loop.stop)
    loop.run_forever()
    assert order == list(range(50))


def test_call_at_uses_the_loop_clock(loop):
    fired = []
    handle = loop.call_at(loop.time() + 0.01, lambda: fired.append(loop.time()))
    assert handle.when() > 0
    run(loop, asyncio.sleep(0.05))
    assert fired and fired[0] >= handle.when()


def test_cancelled_timer_never_runs(loop):
    fired = []
    handle = loop.call_later(0.01, fired.append, "cancelled")
    keep = loop.call_later(0.01, fired.append, "kept")
    handle.cancel()
    assert handle.cancelled() and not keep.cancelled()
    run(loop, asyncio.sleep(0.05))
    assert fired == ["kept"]


def test_many_cancelled_timers_are_dropped(loop):
    fired = []
    handles = [loop.call_later(10 + i, fired.append, i) for i in range(500)]
    for handle in handles[:-1]:
        handle.cancel()
    loop.call_later(0.01, fired.append, "due")
    run(loop, asyncio.sleep(0.05))
    handles[-1].cancel()
    assert fired == ["due"]


def test_call_soon_threadsafe_wakes_a_waiting_loop(loop):
    future = loop.create_future()
    started = threading.Event()

    def other_thread():
        started.wait()
        loop.call_soon_threadsafe(future.set_result, threading.get_ident())

    thread = threading.Thread(target=other_thread)
    thread.start()

    async def wait():
        started.set()  # the loop is about to block with nothing else to do
        return await future

    try:
        assert run(loop, wait()) == thread.ident
    finally:
        thread.join()


def test_call_soon_threadsafe_from_many_threads(loop):
    results = []
    done = loop.create_future()
    total = 8 * 200

    def add(value):
        results.append(value)
        if len(results) == total and not done.done():
            done.set_result(None)

    def worker(base):
        for i in range(200):
            loop.call_soon_threadsafe(add, base + i)

    threads = [threading.Thread(target=worker, args=(n * 1000,)) for n in range(8)]
    for thread in threads:
        thread.start()
    run(loop, done)
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(n * 1000 + i for n in range(8) for i in range(200))


def test_task_cancellation(loop):
    events = []

    async def sleeper():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled inside")
            raise

    async def main():
        task = loop.create_task(sleeper(), name="sleeper")
        await asyncio.sleep(0.01)
        assert task.get_name() == "sleeper"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert run(loop, main()) is True
    assert events == ["cancelled inside"]


def test_wait_for_timeout_cancels_the_inner_task(loop):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(30), 0.01)
        return "after"

    assert run(loop, main()) == "after"


def test_callback_exception_reaches_the_handler(loop):
    def boom():
        raise ValueError("boom")

    loop.call_soon(boom)
    loop.call_soon(loop.stop)
    loop.run_forever()
    calls, loop.handler_calls = loop.handler_calls, []
    assert len(calls) == 1
    assert isinstance(calls[0]["exception"], ValueError)
    assert calls[0]["message"].startswith("Exception in callback")


def test_unretrieved_task_exception_reaches_the_handler(loop):
    async def fails():
        raise KeyError("lost")

    async def main():
        loop.create_task(fails())
        await asyncio.sleep(0.01)

    run(loop, main())
    import gc
    gc.collect()
    calls, loop.handler_calls = loop.handler_calls, []
    assert [type(c.get("exception")) for c in calls] == [KeyError]


def test_default_handler_logs(loop, caplog):
    loop.set_exception_handler(None)
    loop.call_soon(lambda: 1 / 0)
    loop.call_soon(loop.stop)
    with caplog.at_level("ERROR", logger="asyncio"):
        loop.run_forever()
    assert any("ZeroDivisionError" in (r.exc_text or "") or r.exc_info for r in caplog.records)


def test_keyboard_interrupt_propagates_out_of_run(loop):
    def interrupt():
        raise KeyboardInterrupt

    loop.call_soon(interrupt)
    with pytest.raises(KeyboardInterrupt):
        loop.run_forever()
    assert not loop.is_running()


def test_run_in_executor(loop):
    async def main():
        result = await loop.run_in_executor(None, sum, range(10))
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(None, divmod, 1, 0)
        return result, threading.get_ident()

    result, loop_thread = run(loop, main())
    assert result == 45 and loop_thread == threading.get_ident()


def test_signal_handler_runs_in_the_loop(loop):
    got = []
    future = loop.create_future()

    def on_signal(tag):
        got.append((tag, threading.get_ident()))
        if not future.done():
            future.set_result(None)

    loop.add_signal_handler(signal.SIGUSR1, on_signal, "usr1")
    try:
        loop.call_later(0.01, os.kill, os.getpid(), signal.SIGUSR1)
        run(loop, future)
        assert got == [("usr1", threading.get_ident())]
    finally:
        assert loop.remove_signal_handler(signal.SIGUSR1) is True
    assert loop.remove_signal_handler(signal.SIGUSR1) is False
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_signal_handler_rejects_coroutines_and_bad_signals(loop):
    async def coroutine_function():
        pass

    with pytest.raises(TypeError):
        loop.add_signal_handler(signal.SIGUSR1, coroutine_function)
    with pytest.raises((ValueError, RuntimeError)):
        loop.add_signal_handler(0, lambda: None)


def test_add_reader_on_a_pipe(loop):
    read_fd, write_fd = os.pipe()
    chunks = []
    done = loop.create_future()

    def readable():
        data = os.read(read_fd, 100)
        chunks.append(data)
        if b"".join(chunks) == b"onetwo" and not done.done():
            done.set_result(None)

    try:
        loop.add_reader(read_fd, readable)
        loop.call_later(0.01, os.write, write_fd, b"one")
        loop.call_later(0.02, os.write, write_fd, b"two")
        run(loop, done)
        assert loop.remove_reader(read_fd) is True
        assert loop.remove_reader(read_fd) is False
        os.write(write_fd, b"unread")
        run(loop, asyncio.sleep(0.02))  # removed: no more calls
        assert b"".join(chunks) == b"onetwo"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_add_reader_is_level_triggered(loop):
    # A callback that reads only part of what is there is called again, as with epoll.
    read_fd, write_fd = os.pipe()
    got = bytearray()
    done = loop.create_future()

    def readable():
        got.extend(os.read(read_fd, 1))
        if len(got) == 5 and not done.done():
            done.set_result(None)

    try:
        os.write(write_fd, b"abcde")
        loop.add_reader(read_fd, readable)
        run(loop, done)
        loop.remove_reader(read_fd)
        assert bytes(got) == b"abcde"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_add_reader_on_an_eventfd(loop):
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    counts = []
    done = loop.create_future()

    def readable():
        counts.append(os.eventfd_read(efd))
        if sum(counts) >= 3 and not done.done():
            done.set_result(None)

    try:
        loop.add_reader(efd, readable)
        thread = threading.Thread(target=lambda: [os.eventfd_write(efd, 1) for _ in range(3)])
        thread.start()
        run(loop, done)
        thread.join()
        assert loop.remove_reader(efd)
        assert sum(counts) == 3
    finally:
        os.close(efd)


def test_add_writer_and_replacing_a_callback(loop):
    left, right = socket.socketpair()
    calls = []
    done = loop.create_future()

    def first():
        calls.append("first")

    def second():
        calls.append("second")
        loop.remove_writer(left)
        done.set_result(None)

    try:
        loop.add_writer(left, first)
        loop.add_writer(left, second)  # replaces first before it ran
        run(loop, done)
        assert calls == ["second"]
    finally:
        left.close()
        right.close()


def test_run_until_complete_returns_the_result_and_raises(loop):
    async def value():
        await asyncio.sleep(0)
        return 7

    async def error():
        raise LookupError("x")

    assert loop.run_until_complete(value()) == 7
    with pytest.raises(LookupError):
        loop.run_until_complete(error())


def test_async_generators_are_finalized_by_shutdown_asyncgens(loop):
    closed = []

    async def gen():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    async def main():
        agen = gen()
        await agen.__anext__()
        return agen

    agen = run(loop, main())
    loop.run_until_complete(loop.shutdown_asyncgens())
    assert closed == [True]
    del agen


def test_asyncio_runner_drives_the_loop(loop_factory):
    async def main():
        await asyncio.sleep(0)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: "done")

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(main()) == "done"


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_close_releases_every_fd(loop_factory):
    before = _open_fds()
    loop = loop_factory()
    received = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(data)

    async def main():
        server = await loop.create_server(Echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ping")
        received.append(await reader.readexactly(4))
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        loop.add_signal_handler(signal.SIGUSR2, lambda: None)
        read_fd, write_fd = os.pipe()
        loop.add_reader(read_fd, lambda: None)
        await asyncio.sleep(0.01)
        loop.remove_reader(read_fd)
        os.close(read_fd)
        os.close(write_fd)
        await loop.run_in_executor(None, lambda: None)

    loop.run_until_complete(main())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
    assert received == [b"ping"]
    assert _open_fds() == before


def test_closed_loop_refuses_work(loop_factory):
    loop = loop_factory()
    loop.close()
    loop.close()  # twice is fine
    with pytest.raises(RuntimeError):
        loop.call_soon(lambda: None)
    with pytest.raises(RuntimeError):
        loop.run_forever()


def test_cannot_close_a_running_loop(loop):
    async def main():
        with pytest.raises(RuntimeError):
            loop.close()

    run(loop, main())


def test_uring_loop_class():
    assert issubclass(UringEventLoop, asyncio.AbstractEventLoop)


def test_busy_poll_keeps_timers_and_wake_ups(loop):
    if not is_uring(loop):
        pytest.skip("busy polling is the io_uring loop's")
    loop.set_busy_poll(200)
    assert loop.get_busy_poll() == 200
    with pytest.raises(ValueError):
        loop.set_busy_poll(-1)
    order = []
    loop.call_later(0.02, order.append, "later")
    loop.call_later(0.01, order.append, "sooner")
    future = loop.create_future()
    thread = threading.Thread(target=lambda: loop.call_soon_threadsafe(future.set_result, 1))

    async def main():
        thread.start()
        await future
        await asyncio.sleep(0.05)

    run(loop, main())
    thread.join()
    assert order == ["sooner", "later"]
