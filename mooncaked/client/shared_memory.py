"""A local client's view of the daemon's segments (wire/PROTOCOL.md section 5.2).

`hello` lists the segments this connection may map, each with a one-time `fd_token`; the
client trades each token for the segment's file descriptor on the daemon's fd socket
(SCM_RIGHTS), maps it, and moves values with one memcpy (GIL released) between its own
buffers and segment memory. A description without a token (a daemon before fd handover) is
opened by its `shm_path`.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading

from mooncaked._native import buffer_address, copy_memory
from mooncaked.errors import ErrorCode, error_for


FD_GRANTED = 0
MAX_REFUSAL_BYTES = 256


def receive_segment_fd(fd_socket: str, token: bytes, timeout_s: float | None = 30.0) -> int:
    """Trade a segment token from hello for the segment's file descriptor."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(fd_socket)
        sock.sendall(token)
        message, fds, _, _ = socket.recv_fds(sock, MAX_REFUSAL_BYTES, 1)
        if message[:1] == bytes([FD_GRANTED]) and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        while message[:1] and len(message) < MAX_REFUSAL_BYTES:  # the reason, up to EOF
            more = sock.recv(MAX_REFUSAL_BYTES - len(message))
            if not more:
                break
            message += more
    reason = message[1:].decode(errors="replace") or "no answer"
    raise error_for(ErrorCode.SEGMENT_NOT_FOUND, f"the daemon refused the segment: {reason}")


def _open_segment(segment: dict, fd_socket: str) -> int:
    if segment.get("fd_token") is not None and fd_socket:
        return receive_segment_fd(fd_socket, segment["fd_token"])
    return os.open(segment["shm_path"], os.O_RDWR | os.O_CLOEXEC)


class SharedSegments:
    def __init__(self, descriptions: list[dict], fd_socket: str = "") -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._bases: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._close_lock = threading.Lock()
        try:
            for segment in descriptions:
                # A prefaulted segment's pages all exist: map them all now, so copies take no
                # page faults (without it, every first touch of a 4 KiB page faults).
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if segment.get("prefaulted") else 0)
                fd = _open_segment(segment, fd_socket)
                try:
                    mapped = mmap.mmap(fd, segment["size_bytes"], flags,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self._maps[segment["id"]] = mapped
                self._bases[segment["id"]] = buffer_address(mapped)
                self._sizes[segment["id"]] = segment["size_bytes"]
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self._maps)

    def address(self, segment_id: int, offset: int, size_bytes: int) -> int:
        """The address of a range the daemon handed out; checked against the mapping."""
        base = self._bases.get(segment_id)
        if base is None:
            raise error_for(ErrorCode.SEGMENT_NOT_FOUND,
                            f"segment {segment_id} is not mapped by this client")
        if offset < 0 or offset + size_bytes > self._sizes[segment_id]:
            raise ValueError(f"range {offset}+{size_bytes} is outside segment {segment_id}")
        return base + offset

    def write(self, segment_id: int, offset: int, source_address: int, size_bytes: int) -> None:
        copy_memory(self.address(segment_id, offset, size_bytes), source_address, size_bytes)

    def read(self, segment_id: int, offset: int, target_address: int, size_bytes: int) -> None:
        copy_memory(target_address, self.address(segment_id, offset, size_bytes), size_bytes)

    def close(self) -> None:
        """Unmap every segment; safe to call twice and from two threads at once. The caller
        makes sure no copy is using the mapping."""
        with self._close_lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._bases.clear()
        for mapped in maps:
            try:
                mapped.close()
            except BufferError:
                pass


# The id a cluster node's get staging area goes by in the fd handover (never a segment's).
STAGING_SEGMENT_ID = -1


class GetStagingMapping:
    """A cluster node's get staging area (hello's `get_staging`), mapped: get_staged puts a
    value in a range of it, this client copies it out and hands the range back with its next
    get_staged (`to_release`)."""

    def __init__(self, description: dict) -> None:
        self._mapped = SharedSegments([{"id": STAGING_SEGMENT_ID,
                                        "size_bytes": description["size_bytes"],
                                        "prefaulted": description.get("prefaulted", False),
                                        "fd_token": description["fd_token"]}],
                                      description["fd_socket"])
        self.to_release: list[int] = []

    def take_release(self) -> list[int]:
        """The ranges to hand back with the next request (sent once)."""
        release, self.to_release = self.to_release, []
        return release

    def read(self, offset: int, target_address: int, size_bytes: int) -> None:
        self._mapped.read(STAGING_SEGMENT_ID, offset, target_address, size_bytes)

    def close(self) -> None:
        self._mapped.close()
