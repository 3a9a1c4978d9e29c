"""Virtual time and the event queue, plus the trace that names everything that happened.

Time is an integer count of virtual nanoseconds (no float rounding, and it is what the
linearizability checker's histories are stamped with). The queue is a heap keyed by
(time, sequence number): events at the same instant run in the order they were scheduled, so
one seed always gives one order.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import deque
from typing import Callable

MS = 1_000_000  # nanoseconds per millisecond


class Scheduler:
    def __init__(self) -> None:
        self.now = 0
        self._queue: list[tuple[int, int, Callable, tuple]] = []
        self._seq = 0
        self.events = 0  # events run so far

    def at(self, time_ns: int, fn: Callable, *args) -> None:
        if time_ns < self.now:
            time_ns = self.now
        self._seq += 1
        heapq.heappush(self._queue, (time_ns, self._seq, fn, args))

    def after(self, delay_ns: int, fn: Callable, *args) -> None:
        self.at(self.now + delay_ns, fn, *args)

    def run_one(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._queue:
            return False
        time_ns, _, fn, args = heapq.heappop(self._queue)
        self.now = time_ns
        self.events += 1
        fn(*args)
        return True

    def next_time(self) -> int | None:
        return self._queue[0][0] if self._queue else None


class Trace:
    """What happened, one line per notable event: hashed (the determinism check), the most recent
    lines kept for failure reports, and all of them printed when asked (--trace)."""

    def __init__(self, scheduler: Scheduler, echo: Callable[[str], None] | None = None,
                 keep: int = 200) -> None:
        self._scheduler = scheduler
        self._hash = hashlib.sha256()
        self.recent: deque[str] = deque(maxlen=keep)
        self._echo = echo

    def __call__(self, text: str) -> None:
        now = self._scheduler.now
        line = f"{now // MS:>7}.{now % MS // 1000:03d}ms {text}"
        self._hash.update(line.encode())
        self._hash.update(b"\n")
        self.recent.append(line)
        if self._echo is not None:
            self._echo(line)

    def digest(self) -> str:
        return self._hash.hexdigest()
