"""Replica placement: which segments receive the replicas of a new object.

Pure: the segments and a seeded random generator are passed in. Replicas of one object always
land on distinct segments. Placement is best effort, as in Mooncake Store: fewer replicas than
asked are returned when fewer segments have room; none at all means no space.
"""

from __future__ import annotations

import random
from typing import Iterable, Protocol


class Allocatable(Protocol):
    segment_id: int
    name: str
    mounted: bool

    def allocate(self, size_bytes: int) -> tuple[int, int] | None: ...

    def free_ratio(self) -> float: ...


def candidate_order(segments: list[Allocatable], preferred_names: Iterable[str], strategy: str,
                    seed: int) -> list[Allocatable]:
    """Segments in the order placement tries them: preferred ones first, then by strategy."""
    by_name = {s.name: s for s in segments if s.mounted}
    ordered, seen = [], set()
    for name in preferred_names:
        segment = by_name.get(name)
        if segment is not None and segment.segment_id not in seen:
            ordered.append(segment)
            seen.add(segment.segment_id)
    rest = [s for s in segments if s.mounted and s.segment_id not in seen]
    if len(rest) > 1:
        if strategy == "free_ratio_first":
            rest.sort(key=lambda s: (-s.free_ratio(), s.segment_id))
        else:  # random, local_first (whose own segments come as preferred): a random
            # starting point, then walk the list
            start = random.Random(seed).randrange(len(rest))
            rest = rest[start:] + rest[:start]
    ordered.extend(rest)
    return ordered


def place(segments: list[Allocatable], size_bytes: int, replica_num: int, preferred_names: Iterable[str],
          strategy: str, seed: int) -> list[tuple[object, int, int]]:
    """Allocate up to `replica_num` ranges on distinct segments: [(segment, offset, handle)]."""
    if len(segments) == 1 and not preferred_names:
        candidates = segments if segments[0].mounted else []
    else:
        candidates = candidate_order(segments, preferred_names, strategy, seed)
    placed = []
    for segment in candidates:
        allocation = segment.allocate(size_bytes)
        if allocation is not None:
            placed.append((segment, allocation[0], allocation[1]))
            if len(placed) == replica_num:
                break
    return placed
