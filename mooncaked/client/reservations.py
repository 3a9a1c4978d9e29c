"""A connection's stock of reserved segment ranges (wire/PROTOCOL.md 5.2, reservations).

With a range of a value's exact size in stock, a local put is one memcpy and one request
(`put_commit`), whose answer refills the stock; without one it takes two (a `reserve`, or the
put_start / put_end path). The daemon ties reservations to the connection, so each connection
keeps its own stock (the pool's connections too), and closing it frees them.

Bounds: the bytes the daemon allows per connection (`max_reserved_bytes` in hello) and
MAX_RANGES ranges. A size not used lately gives its ranges back when another size needs the
room. A range is used only within half the daemon's reservation lifetime
(`reservation_ttl_ms`): past it the daemon may free the range, and a copy must never land in
memory that is someone else's; older ranges are given back unused.
"""

from __future__ import annotations

import collections
import time

MAX_RANGES = 4096

Taken = tuple[int, int, int, float]  # (segment_id, offset, size, granted at, monotonic s)


class ReservationStock:
    def __init__(self, limit_bytes: int, ttl_ms: int) -> None:
        self.limit_bytes = limit_bytes
        self.usable_s = ttl_ms / 2000
        # size -> ranges (segment_id, offset, granted at), oldest first; least recently used
        # size first.
        self._by_size: collections.OrderedDict[int, collections.deque] = \
            collections.OrderedDict()
        self.held_bytes = 0  # as the daemon counts it: in stock, taken, or being released
        self.held_ranges = 0
        self._release: list[list[int]] = []  # given back with the next request

    def take(self, size_bytes: int) -> Taken | None:
        """A stocked range of exactly this size, or None. The caller commits it, or gives it
        back with `put_back`."""
        ranges = self._by_size.get(size_bytes)
        if not ranges:
            return None
        self._by_size.move_to_end(size_bytes)
        deadline = time.monotonic() - self.usable_s
        while ranges and ranges[0][2] <= deadline:
            self._give_back(size_bytes, ranges.popleft())
        if not ranges:
            return None
        segment_id, offset, granted_at = ranges.popleft()
        return segment_id, offset, size_bytes, granted_at

    def put_back(self, taken: Taken) -> None:
        """A taken range that was not used up (not written, or the key existed)."""
        segment_id, offset, size_bytes, granted_at = taken
        self._by_size.setdefault(size_bytes, collections.deque()).appendleft(
            (segment_id, offset, granted_at))

    def committed(self, taken: Taken) -> None:
        """A taken range is being committed: once the daemon has it, it no longer counts it
        (counted so before the commit is sent, as the daemon commits before it reserves)."""
        self.held_bytes -= taken[2]
        self.held_ranges -= 1

    def restore(self, taken: Taken) -> None:
        """A range given to a commit that did not use it up (the key existed, or the request
        failed): back in stock."""
        self.held_bytes += taken[2]
        self.held_ranges += 1
        self.put_back(taken)

    def add(self, granted: list, granted_at: float) -> None:
        """Ranges the daemon reserved, [segment_id, offset, size] each; `granted_at` is when
        the request was sent (no later than the daemon's own start of their lifetime)."""
        for segment_id, offset, size_bytes in granted:
            self._by_size.setdefault(size_bytes, collections.deque()).append(
                (segment_id, offset, granted_at))
            self.held_bytes += size_bytes
            self.held_ranges += 1

    def request(self, counts: dict[int, int], all_or_nothing: bool):
        """What to ask of the daemon for `counts` more ranges by size: ([[size, count], ...],
        the ranges to give back first). Makes room by giving back ranges of the sizes used
        least recently. With `all_or_nothing`, None when the whole of `counts` cannot fit;
        else as much of it as fits."""
        need_bytes = sum(size * count for size, count in counts.items())
        need_ranges = sum(counts.values())
        for size in list(self._by_size):
            if self._fits(need_bytes, need_ranges):
                break
            if size in counts:
                continue
            ranges = self._by_size.pop(size)
            while ranges:
                self._give_back(size, ranges.popleft())
        wanted = []
        room_bytes = self.limit_bytes - self.held_bytes
        room_ranges = MAX_RANGES - self.held_ranges
        for size, count in counts.items():
            count = min(count, room_bytes // size, room_ranges)
            if count < counts[size] and all_or_nothing:
                return None
            if count > 0:
                wanted.append([size, count])
                room_bytes -= size * count
                room_ranges -= count
        return wanted, self.release_list()

    def release_list(self) -> list[list[int]]:
        """The ranges to give back with the next request (taken from the list: send them)."""
        deadline = time.monotonic() - self.usable_s
        for size, ranges in self._by_size.items():
            while ranges and ranges[0][2] <= deadline:
                self._give_back(size, ranges.popleft())
        release, self._release = self._release, []
        return release

    def _fits(self, need_bytes: int, need_ranges: int) -> bool:
        return (self.held_bytes + need_bytes <= self.limit_bytes
                and self.held_ranges + need_ranges <= MAX_RANGES)

    def _give_back(self, size_bytes: int, stocked) -> None:
        # The daemon handles a request's releases before its reservations, so the room is
        # counted free as soon as the release is queued.
        self._release.append([stocked[0], stocked[1]])
        self.held_bytes -= size_bytes
        self.held_ranges -= 1
