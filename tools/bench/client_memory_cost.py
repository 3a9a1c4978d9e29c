"""What reaching a local client's memory costs the daemon (README "Transfer layer"):
process_vm_readv / process_vm_writev of another process's buffer against a plain memcpy of the
same size in one process, GB/s per size (best of several runs).

    PYTHONPATH=. python tools/bench/client_memory_cost.py [--repeat N]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time

from mooncaked.transfer.process_memory import read_from, write_to

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
CHILD = ("import ctypes, sys\n"
         "b = ctypes.create_string_buffer(%d)\n"
         "print(ctypes.addressof(b), flush=True)\n"
         "sys.stdin.read()\n")


def best_gbps(function, size: int, repeat: int) -> float:
    count = max(1, (256 << 20) // size)  # ~256 MiB a run
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(count):
            function()
        best = min(best, time.perf_counter() - started)
    return size * count / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    largest = max(SIZES)
    child = subprocess.Popen([sys.executable, "-c", CHILD % largest], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        remote = int(child.stdout.readline())
        source = ctypes.create_string_buffer(b"\x5a" * largest, largest)
        target = ctypes.create_string_buffer(largest)
        staging = bytearray(largest)
        print(f"{'size':>10} {'memcpy GB/s':>12} {'readv GB/s':>11} {'writev GB/s':>12}")
        for size in SIZES:
            view = memoryview(staging)[:size]
            memcpy = best_gbps(lambda: ctypes.memmove(target, source, size), size, args.repeat)
            readv = best_gbps(lambda: read_from(child.pid, remote, view), size, args.repeat)
            writev = best_gbps(lambda: write_to(child.pid, remote, view), size, args.repeat)
            print(f"{size:>10} {memcpy:>12.2f} {readv:>11.2f} {writev:>12.2f}")
    finally:
        child.stdin.close()
        child.wait(10)


if __name__ == "__main__":
    main()
