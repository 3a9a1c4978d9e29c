"""Threads sharing one MooncakeDistributedStore: throughput of 1 thread against N.

    .venv/bin/python tools/bench/facade_threads.py --address unix:/run/mooncaked/mooncaked.sock

Each thread repeats what vLLM's MooncakeStoreConnector does per step: `batch_is_exist` of a
batch of block keys, `batch_put_from_multi_buffers` (each block gathered from one buffer per
layer), and `batch_get_into_multi_buffers` of the same keys into other buffers, whose bytes are
then checked. Every thread uses the same store object. Prints blocks/s per thread count and
the ratio to one thread; a failed call or a wrong byte stops the run with an error.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mooncaked.mooncake_store import MooncakeDistributedStore  # noqa: E402


def _worker(store, thread: int, count: int, batch: int, layers: int, layer_bytes: int,
            seconds: float, results: list, failures: list) -> None:
    block_bytes = layers * layer_bytes
    source = ctypes.create_string_buffer(batch * block_bytes)
    target = ctypes.create_string_buffer(batch * block_bytes)
    base_in, base_out = ctypes.addressof(source), ctypes.addressof(target)
    for region in (base_in, base_out):
        if store.register_buffer(region, batch * block_bytes) != 0:
            failures.append(f"thread {thread}: register_buffer failed")
            return
    blocks, step = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = [f"c{count}-t{thread}-s{step}-b{b}" for b in range(batch)]
        stamp = f"{count}:{thread}:{step}:".encode()
        pattern = (stamp * (len(source) // len(stamp) + 1))[:len(source)]
        ctypes.memmove(base_in, pattern, len(pattern))
        ptrs = [[base_in + b * block_bytes + layer * layer_bytes for layer in range(layers)]
                for b in range(batch)]
        out_ptrs = [[base_out + b * block_bytes + layer * layer_bytes for layer in range(layers)]
                    for b in range(batch)]
        sizes = [[layer_bytes] * layers for _ in range(batch)]
        if store.batch_is_exist(keys) != [0] * batch:
            failures.append(f"thread {thread}: keys of step {step} exist already")
            return
        codes = store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        if codes != [0] * batch:
            failures.append(f"thread {thread}: put codes {codes}")
            return
        read = store.batch_get_into_multi_buffers(keys, out_ptrs, sizes)
        if read != [block_bytes] * batch:
            failures.append(f"thread {thread}: get results {read}")
            return
        if ctypes.string_at(base_out, len(pattern)) != pattern:
            failures.append(f"thread {thread}: wrong bytes at step {step}")
            return
        store.batch_remove(keys, True)  # keep the store from filling up
        blocks += batch
        step += 1
    for region in (base_in, base_out):
        store.unregister_buffer(region)  # the next run may get memory at the same address
    results.append(blocks)


def measure(store, count: int, args) -> float:
    results: list = []
    failures: list = []
    threads = [threading.Thread(target=_worker, args=(
        store, t, count, args.batch, args.layers, args.layer_bytes, args.seconds, results,
        failures)) for t in range(count)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    if failures:
        raise SystemExit(f"FAIL with {count} threads: {failures[0]}")
    return sum(results) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="unix:/run/mooncaked/mooncaked.sock",
                        help="the daemon (unix:PATH or HOST:PORT)")
    parser.add_argument("--threads", default="1,8", help="thread counts to measure, in order")
    parser.add_argument("--batch", type=int, default=4, help="blocks per call")
    parser.add_argument("--layers", type=int, default=2, help="buffers (layers) per block")
    parser.add_argument("--layer-bytes", type=int, default=8192, help="bytes per buffer")
    parser.add_argument("--seconds", type=float, default=3.0, help="time per thread count")
    args = parser.parse_args()
    store = MooncakeDistributedStore()
    code = store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.address)
    if code != 0:
        raise SystemExit(f"setup({args.address}) returned {code}")
    try:
        baseline = None
        block_bytes = args.layers * args.layer_bytes
        for count in (int(c) for c in args.threads.split(",")):
            rate = measure(store, count, args)
            baseline = baseline or rate
            print(f"{count:3d} threads: {rate:9.0f} blocks/s  {rate * block_bytes / 1e9:6.3f} GB/s"
                  f"  {rate / baseline:5.2f}x one thread")
    finally:
        store.close()


if __name__ == "__main__":
    main()
