"""Shared memory that a cluster node's local clients map for gets (wire/PROTOCOL.md, get_staged).

A cluster node's clients do not map its segments (a value's replica may be on another node,
and the log decides every allocation in them). For a local client over the Unix socket the
node keeps one more shared-memory area, `[cluster] get_staging_bytes`, outside every segment
and outside the log: `get_staged` receives a value's bytes from the replica's node straight
into a range of it (or copies them from this node's own segment), and the client copies them
out of its mapping. The bytes cross the network once and never pass through the client's
socket. A range stays the connection's until it hands it back (the `release` list of its next
`get_staged`, or `release_staged`) or closes.
"""

from __future__ import annotations

from mooncaked._native import OffsetAllocator
from mooncaked.daemon.segment_memory import SegmentMemory
from mooncaked.errors import ErrorCode, MooncakedError

# The id fd tokens carry for the staging area: no segment id is negative.
STAGING_SEGMENT_ID = -1
ALIGNMENT_BYTES = 64  # a cache line: the copies in and out start aligned
MAX_RANGES = 4096  # ranges held at once, all connections together


class GetStaging:
    def __init__(self, size_bytes: int, shm_dir: str, mode: int, prefault: bool) -> None:
        self.size_bytes = size_bytes
        # A memfd: never a file a process could open by path; clients get its fd by token.
        try:
            self.memory = SegmentMemory(STAGING_SEGMENT_ID, shm_dir, size_bytes, mode,
                                        prefault=prefault, memfd_name="get-staging")
        except ValueError as exc:  # its pages cannot all be had
            raise ValueError(f"[cluster] get_staging_bytes = {size_bytes}: {exc}; lower it, "
                             "or 0 for none") from None
        self._allocator = OffsetAllocator(size_bytes, ALIGNMENT_BYTES, MAX_RANGES)
        # connection id -> {offset: (handle, size)}; a connection listed may map the area.
        self._held: dict[int, dict[int, tuple[int, int]]] = {}
        self.stats = {"staged_gets": 0, "staged_bytes": 0, "staging_full": 0}

    def segment_fd(self, segment_id: int) -> int | None:
        """The fd handover's lookup: the area's fd for its token, nothing else."""
        return self.memory.fd if segment_id == STAGING_SEGMENT_ID else None

    def admit(self, connection_id: int) -> None:
        """The connection was offered the area (its hello): it may stage gets."""
        self._held.setdefault(connection_id, {})

    def admitted(self, connection_id: int) -> bool:
        return connection_id in self._held

    def take(self, connection_id: int, size: int) -> tuple[int, memoryview] | None:
        """A range of `size` bytes held by the connection: (offset, view); None when the area
        has no room for it now (the caller sends the value through the socket instead)."""
        got = self._allocator.allocate(size) if size <= self.size_bytes else None
        if got is None:
            self.stats["staging_full"] += 1
            return None
        offset, handle = got
        self._held[connection_id][offset] = (handle, size)
        return offset, self.memory.slice(offset, size)

    def give_back(self, connection_id: int, offset: int) -> None:
        """A range the daemon took for a get that failed: free at once (nothing writes into it
        any more, see ClusterService.read_one_replica)."""
        handle, _ = self._held[connection_id].pop(offset)
        self._allocator.free(handle)

    def release(self, connection_id: int, offsets: list) -> None:
        """The client is done with these ranges. All or nothing: an offset this connection
        does not hold is INVALID_PARAMS and nothing is released."""
        held = self._held.get(connection_id, {})
        if type(offsets) is not list or any(type(o) is not int or o not in held
                                            for o in offsets) \
                or len(set(offsets)) != len(offsets):
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 "release must list offsets of staged ranges this connection "
                                 "holds, each once")
        for offset in offsets:
            handle, _ = held.pop(offset)
            self._allocator.free(handle)

    def forget_connection(self, connection_id: int) -> None:
        """The connection closed: every range it held is free again."""
        for handle, _ in self._held.pop(connection_id, {}).values():
            self._allocator.free(handle)

    def status(self) -> dict:
        return {"size_bytes": self.size_bytes, "held_bytes": self._allocator.used_bytes,
                **self.stats}

    def close(self) -> None:
        self.memory.close()
