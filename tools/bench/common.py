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
import random
import sys

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
    """A bytearray whose pages are already touched, with its raw address (for put_from /
    get_into / register_buffer). bytearray(n) alone leaves large buffers as untouched zero
    pages, which would make the first copy into them measure page faults."""

    def __init__(self, size: int, fill: bytes | None = None) -> None:
        self.size = size
        self.data = bytearray(size)
        self._view = (ctypes.c_char * size).from_buffer(self.data)  # pins the bytearray
        self.address = ctypes.addressof(self._view)
        if fill is not None:
            ctypes.memmove(self.address, fill, size)
        else:
            ctypes.memset(self.address, 1, size)

    def equals(self, other: bytes, length: int | None = None) -> bool:
        length = self.size if length is None else length
        return self.data[:length] == other[:length]
