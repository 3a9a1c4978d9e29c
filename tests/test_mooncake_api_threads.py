"""One MooncakeDistributedStore shared by many threads: mixed calls with every byte checked,
close() racing itself, and a daemon restart under load (calls answer codes, never raise,
and succeed again afterwards)."""

from __future__ import annotations

import ctypes
import os
import threading

from mooncaked.mooncake_store import MooncakeDistributedStore, ReplicateConfig

THREADS = 8
ROUNDS = 25
PAGE = 4096


def _store(address):
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", address) == 0
    return store


def _run_threads(target):
    errors = []

    def guarded(index):
        try:
            target(index)
        except BaseException as exc:  # reported below: an assertion in a thread
            errors.append(f"thread {index}: {exc!r}")
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_mixed_calls_from_eight_threads(daemon):
    store = _store(daemon.unix_address)
    config = ReplicateConfig()

    def work(index):
        # Each thread registers its own memory: the registration table is shared.
        memory = ctypes.create_string_buffer(8 * PAGE)
        base = ctypes.addressof(memory)
        assert store.register_buffer(base, 8 * PAGE) == 0
        for round_number in range(ROUNDS):
            key = f"t{index}-r{round_number}"
            layers = [os.urandom(PAGE), os.urandom(PAGE // 2)]
            ctypes.memmove(base, layers[0], PAGE)
            ctypes.memmove(base + PAGE, layers[1], PAGE // 2)
            assert store.batch_put_from_multi_buffers(
                [key], [[base, base + PAGE]], [[PAGE, PAGE // 2]], config) == [0]
            assert store.batch_get_into_multi_buffers(
                [key], [[base + 2 * PAGE, base + 4 * PAGE]], [[PAGE // 2, PAGE]]) \
                == [PAGE + PAGE // 2]
            whole = layers[0] + layers[1]
            assert ctypes.string_at(base + 2 * PAGE, PAGE // 2) + \
                ctypes.string_at(base + 4 * PAGE, PAGE) == whole
            small = os.urandom(100)
            assert store.put(key + "-small", small) == 0
            assert store.get(key + "-small") == small
            assert store.batch_is_exist([key, key + "-small", key + "-none"]) == [1, 1, 0]
            assert store.get_size(key) == len(whole)
            assert store.batch_get_into([key], [base + 6 * PAGE], [2 * PAGE]) == [len(whole)]
            assert ctypes.string_at(base + 6 * PAGE, len(whole)) == whole
            assert store.remove(key + "-small", force=True) == 0
        assert store.unregister_buffer(base) == 0

    _run_threads(work)
    assert store.batch_is_exist([f"t{i}-r{ROUNDS - 1}" for i in range(THREADS)]) == [1] * THREADS
    store.close()


def test_close_from_two_threads_and_calls_after(daemon):
    store = _store(daemon.tcp_address)
    assert store.put("k", b"v") == 0
    barrier = threading.Barrier(THREADS)
    results = []

    def work(index):
        barrier.wait()
        if index < 2:
            results.append(store.close())
        else:
            code = store.is_exist("k")
            assert code in (1, -600, -900), code  # answered, or the not-initialized code
            results.append(0)

    _run_threads(work)
    assert results == [0] * THREADS
    assert store.put("k", b"v") == -600 and store.get("k") == b""


def test_daemon_restart_under_load(daemon):
    store = _store(daemon.unix_address)
    stop = threading.Event()
    answered_after_restart = threading.Event()
    restarted = threading.Event()

    def work(index):
        memory = ctypes.create_string_buffer(2 * PAGE)
        base = ctypes.addressof(memory)
        assert store.register_buffer(base, 2 * PAGE) == 0
        count = 0
        while not stop.is_set():
            key = f"w{index}-{count}"
            count += 1
            payload = os.urandom(PAGE)
            ctypes.memmove(base, payload, PAGE)
            code = store.batch_put_from_multi_buffers([key], [[base]], [[PAGE]])[0]
            assert code in (0, -900), code  # stored, or the outcome is unknown
            got = store.batch_get_into_multi_buffers([key], [[base + PAGE]], [[PAGE]])[0]
            if code == 0 and got == PAGE:
                assert ctypes.string_at(base + PAGE, PAGE) == payload
                if restarted.is_set():
                    answered_after_restart.set()
            else:
                assert got in (PAGE, -704, -900), got
            exists = store.is_exist(key)
            assert exists in (0, 1, -900), exists

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    errors = []
    for thread in threads:
        thread.run = (lambda run: lambda: _collect(run, errors))(thread.run)
        thread.start()
    daemon.terminate()
    daemon.start()
    restarted.set()
    answered_after_restart.wait(60)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    assert answered_after_restart.is_set()
    assert store.put("after", b"restart") == 0 and store.get("after") == b"restart"
    assert store.health_check() == 0
    store.close()


def _collect(run, errors):
    try:
        run()
    except BaseException as exc:
        errors.append(repr(exc))
