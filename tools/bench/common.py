"""Helpers shared by the worker processes (workers.py, machine.py): the line protocol with the
orchestrator, latency summaries, and buffers at raw addresses.

Only the standard library is used, so the same code runs under the project's Python (mooncaked
workers, no numpy there) and under the bench venv (Mooncake, Redis, numpy).

Line protocol, all on stdout, one line each:
    READY [json]   setup done; the worker then waits for "GO" on stdin (rate tests)
    RESULT json    the measurement; rate workers then wait for "DONE" before closing
Everything else a worker or its libraries print goes to stderr (a log file).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import sys
import time

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3


def emit(tag: str, obj=None) -> None:
    sys.stdout.write(tag if obj is None else f"{tag} {json.dumps(obj)}")
    sys.stdout.write("\n")
    sys.stdout.flush()


def wait_line(expected: str) -> None:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("the orchestrator went away")
        if line.strip() == expected:
            return


def percentile(sorted_values: list, p: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    if not sorted_values:
        return float("nan")
    rank = int(round(p / 100.0 * len(sorted_values) + 0.5)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, rank))]


def latency_summary(ns: list[int], bytes_per_op: int) -> dict:
    """Per-op latencies (ns) of one op in flight -> MB/s (bytes / sum of latencies), ops/s,
    p50/p99 in µs."""
    total_s = sum(ns) / 1e9
    ordered = sorted(ns)
    return {"n": len(ns), "total_s": total_s,
            "mbps": bytes_per_op * len(ns) / 1e6 / total_s if total_s else float("nan"),
            "ops_s": len(ns) / total_s if total_s else float("nan"),
            "p50_us": percentile(ordered, 50) / 1e3, "p99_us": percentile(ordered, 99) / 1e3}


def pattern(size: int, seed: int) -> bytes:
    """Deterministic incompressible bytes."""
    return random.Random(seed).randbytes(size)


class Buffer:
    """A buffer whose pages are already touched, with its raw address (for put_from /
    get_into / register_buffer). bytearray(n) alone leaves large buffers as untouched zero
    pages, which would make the first copy into them measure page faults. With `address`
    the buffer wraps memory someone else allocated (Mooncake's alloc_from_mem_pool)."""

    def __init__(self, size: int, fill: bytes | None = None, address: int | None = None) -> None:
        self.size = size
        if address is None:
            self.data = bytearray(size)
            self._view = (ctypes.c_char * size).from_buffer(self.data)  # pins the bytearray
            self.address = ctypes.addressof(self._view)
        else:
            self._view = (ctypes.c_char * size).from_address(address)
            self.data = memoryview(self._view).cast("B")
            self.address = address
        if fill is not None:
            ctypes.memmove(self.address, fill, size)
        else:
            ctypes.memset(self.address, 1, size)

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        length = self.size - offset if length is None else length
        return memoryview(self.data)[offset:offset + length]

    def equals(self, other: bytes, length: int | None = None) -> bool:
        length = self.size if length is None else length
        return self.data[:length] == other[:length]


# -- values that carry their key -------------------------------------------------------------
# Every value a worker stores carries (nonce, key index) in a 16-byte stamp at the start of
# every STRIDE bytes (and its last 16 bytes); the rest is a fixed incompressible pattern. A read
# back is checked byte for byte against the value rebuilt from its index, so a value that
# belongs to another key, another trial (the nonce) or is torn shows as a failed check.

STAMP = struct.Struct("<QQ")
STRIDE = 4096


def new_nonce() -> int:
    return int.from_bytes(os.urandom(8), "little")


def stamp_into(view, index: int, nonce: int, stride: int = STRIDE) -> None:
    """Write the stamp of (nonce, index) into a writable view of one value (in place)."""
    size = len(view)
    if size < STAMP.size:
        return
    tag = STAMP.pack(nonce, index)
    for offset in range(0, size - STAMP.size + 1, stride):
        view[offset:offset + STAMP.size] = tag
    view[size - STAMP.size:size] = tag


def stamped(base: bytes, size: int, index: int, nonce: int) -> bytearray:
    """The value of key `index` in a trial: base[:size] with its stamps."""
    value = bytearray(base[:size])
    stamp_into(memoryview(value), index, nonce)
    return value


def check_value(got, base: bytes, size: int, index: int, nonce: int) -> bool:
    """Whether `got` (bytes or a view) is exactly the value of key `index`."""
    return got is not None and len(got) == size and got == stamped(base, size, index, nonce)


# -- CPU time of other processes (the servers) -----------------------------------------------

HZ = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pids) -> float:
    """utime + stime (s) of the given processes (all their threads, exited ones included),
    from /proc/PID/stat; a process that is gone counts 0. Counted in clock ticks (1/HZ s,
    10 ms here; this kernel has no /proc/PID/schedstat): a row shorter than a few ticks is
    coarse, which is why rows sum the ticks of all their trials."""
    total = 0
    for pid in pids or ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total / HZ


class CpuWindow:
    """`with CpuWindow(server_pids) as w:` -> w.server_s (the servers' CPU seconds) and
    w.client_s (this process's CPU seconds, all threads) spent inside the block."""

    def __init__(self, pids) -> None:
        self.pids = list(pids or ())

    def __enter__(self) -> "CpuWindow":
        self.s0, self.c0 = proc_cpu_s(self.pids), time.process_time()
        return self

    def __exit__(self, *exc) -> bool:
        self.server_s = proc_cpu_s(self.pids) - self.s0
        self.client_s = time.process_time() - self.c0
        return False

    def as_dict(self) -> dict:
        return {"server_cpu_s": self.server_s, "client_cpu_s": self.client_s}
