"""The admission filter of promotion: a Count-Min sketch of disk hits per key.

A value read from the disk tier is promoted back to DRAM only once it was hit
`promote_threshold` times (README "SSD tier"): one-off reads of cold values do not push warm
ones out of DRAM. The sketch counts hits in 4 rows of `width` 4-bit counters (saturating at 15)
with conservative update (only the smallest counters of a key grow), so a key's estimate is
never below its true count since the last aging, and collisions only ever overestimate. Every
`10 x width` hits all counters are halved (aging): old popularity fades.
"""

from __future__ import annotations

ROWS = 4
MAX_COUNT = 15
_HALF = bytes(value >> 1 for value in range(256))
# Per-row salts, so that the rows hash a key independently.
_SALTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


class CountMinSketch:
    def __init__(self, width: int, aging_period: int | None = None) -> None:
        if width < 1:
            raise ValueError("a sketch needs at least one counter per row")
        self.width = width
        self.aging_period = aging_period if aging_period is not None else 10 * width
        self.rows = [bytearray(width) for _ in range(ROWS)]
        self.additions = 0
        self.agings = 0

    def _slots(self, key) -> list[int]:
        width = self.width
        return [hash((salt, key)) % width for salt in _SALTS]

    def estimate(self, key) -> int:
        rows = self.rows
        return min(rows[i][slot] for i, slot in enumerate(self._slots(key)))

    def add(self, key) -> int:
        """Count one hit of `key`; returns its estimate after it."""
        rows = self.rows
        slots = self._slots(key)
        current = min(rows[i][slot] for i, slot in enumerate(slots))
        if current < MAX_COUNT:
            for i, slot in enumerate(slots):
                if rows[i][slot] == current:
                    rows[i][slot] = current + 1
            current += 1
        self.additions += 1
        if self.additions >= self.aging_period:
            self.age()
        return current

    def age(self) -> None:
        """Halve every counter."""
        self.rows = [row.translate(_HALF) for row in self.rows]
        self.additions = 0
        self.agings += 1
