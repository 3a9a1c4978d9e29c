"""The machine's limits, measured in the same run as the stores (worker roles, run by workers.py
under the bench venv, one fresh process per trial):

    memcpy         single-thread copy bandwidth: numpy.copyto of 256 MiB into a prefaulted
                   destination, and a bytearray slice copy of the same size
    memcpy_like    the copies of a put_from / get_into row (same size, count and buffer
                   reuse) as plain memcpy: the reference of the "% of memcpy" targets
    sock_recv /    bulk transfer over TCP loopback: sendall/recv_into in 1 MiB chunks
    sock_send
    pingpong_srv / 1-byte request/response round trips, TCP (TCP_NODELAY) or Unix socket: the
    pingpong_cli   floor of any request/response store under the CPU placement in use
    fdatasync      4 KiB appends, each followed by fdatasync, on the file system of a directory
                   (the cluster section's Raft logs)

The socket roles bind 127.0.0.1 (port 0) or a Unix socket path the orchestrator gives.
"""

from __future__ import annotations

import os
import socket
import time

from common import MiB, emit, percentile


def role_memcpy(a: dict) -> None:
    import numpy as np
    size, reps = a["bytes"], a["reps"]
    src = np.empty(size, np.uint8)
    src.fill(1)
    dst = np.empty(size, np.uint8)
    dst.fill(0)  # prefault the destination
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    numpy_gbps = size * reps / (time.perf_counter() - t0) / 1e9
    del dst
    source = bytearray(src.tobytes())
    del src
    target = bytearray(size)
    target[:] = source  # prefault
    t0 = time.perf_counter()
    for _ in range(reps):
        target[:] = source
    bytearray_gbps = size * reps / (time.perf_counter() - t0) / 1e9
    emit("RESULT", {"numpy_copyto_gbps": numpy_gbps, "bytearray_slice_gbps": bytearray_gbps})


def role_memcpy_like(a: dict) -> None:
    """The copies a put_from / get_into row of `size` x `ops` makes, with the same buffer
    reuse, as plain single-thread memcpy (libc memmove through ctypes): put-like = one source
    buffer copied into `ops` distinct destinations of a prefaulted arena (each key gets its own
    place in the store's segment); get-like = `ops` distinct sources (filled) copied into one
    destination buffer. Per-copy time summed, as the rows sum per-op latencies."""
    import ctypes
    size, ops = a["size"], a["ops"]
    pc = time.perf_counter_ns
    one = bytearray(os.urandom(size))
    one_addr = ctypes.addressof((ctypes.c_char * size).from_buffer(one))
    arena = bytearray(size * ops)
    arena_addr = ctypes.addressof((ctypes.c_char * (size * ops)).from_buffer(arena))
    ctypes.memset(arena_addr, 7, size * ops)  # prefault (the store's segment is prefaulted)
    out = {}
    for name, copy in (("put_like", lambda i: ctypes.memmove(arena_addr + i * size, one_addr,
                                                                size)),
                       ("get_like", lambda i: ctypes.memmove(one_addr, arena_addr + i * size,
                                                                size))):
        ns = []
        for i in range(ops):
            t0 = pc(); copy(i); ns.append(pc() - t0)
        total = sum(ns) / 1e9
        out[name] = {"mbps": size * ops / total / 1e6, "ops": ops}
    emit("RESULT", out)


def _listen(a: dict):
    if a["family"] == "unix":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(a["path"])
        address = a["path"]
    else:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("127.0.0.1", 0))
        address = server.getsockname()[1]
    server.listen(1)
    return server, address


def _connect(a: dict) -> socket.socket:
    if a["family"] == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(a["address"])
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect(("127.0.0.1", a["address"]))
    return sock


def role_sock_recv(a: dict) -> None:
    """Server side of the bulk test: receives a["total"] bytes, then acks with one byte."""
    server, address = _listen(a)
    emit("READY", {"address": address})
    conn, _ = server.accept()
    view = memoryview(bytearray(MiB))
    total, got, started = a["total"], 0, None
    while got < total:
        n = conn.recv_into(view, min(MiB, total - got))
        if n == 0:
            break
        if started is None:
            started = time.perf_counter()
        got += n
    elapsed = time.perf_counter() - started
    conn.sendall(b"k")
    conn.close()
    server.close()
    emit("RESULT", {"bytes": got, "gbps": got / elapsed / 1e9})


def role_sock_send(a: dict) -> None:
    sock = _connect(a)
    chunk = memoryview(os.urandom(MiB))
    sent = 0
    while sent < a["total"]:
        sock.sendall(chunk)
        sent += MiB
    sock.recv(1)
    sock.close()
    emit("RESULT", {"bytes": sent})


def role_pingpong_srv(a: dict) -> None:
    server, address = _listen(a)
    emit("READY", {"address": address})
    conn, _ = server.accept()
    if a["family"] != "unix":
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64)
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        conn.sendall(buf[:n])
    conn.close()
    server.close()
    emit("RESULT", {})


def role_pingpong_cli(a: dict) -> None:
    sock = _connect(a)
    buf = bytearray(64)
    for _ in range(200):  # warm-up
        sock.sendall(b"x")
        sock.recv_into(buf)
    latencies = []
    pc = time.perf_counter_ns
    t_start = time.monotonic()
    deadline = t_start + a["duration_s"]
    while True:
        for _ in range(64):
            t0 = pc(); sock.sendall(b"x"); sock.recv_into(buf); latencies.append(pc() - t0)
        if time.monotonic() >= deadline:
            break
    elapsed = time.monotonic() - t_start
    sock.close()
    latencies.sort()
    emit("RESULT", {"n": len(latencies), "ops_s": len(latencies) / elapsed,
                    "p50_us": percentile(latencies, 50) / 1e3,
                    "p99_us": percentile(latencies, 99) / 1e3})


def role_fdatasync(a: dict) -> None:
    """Append 4 KiB and fdatasync, one after the other, for a fixed window: the floor of a log
    that syncs each write on its own (a Raft log with fsync = "batch" and one client)."""
    path = os.path.join(a["dir"], "fdatasync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    block = os.urandom(4096)
    latencies = []
    pc = time.perf_counter_ns
    try:
        for _ in range(5):  # warm-up: the file's first blocks, the journal
            os.write(fd, block)
            os.fdatasync(fd)
        t_start = time.monotonic()
        deadline = t_start + a["duration_s"]
        while time.monotonic() < deadline:
            t0 = pc(); os.write(fd, block); os.fdatasync(fd); latencies.append(pc() - t0)
        elapsed = time.monotonic() - t_start
    finally:
        os.close(fd)
        os.unlink(path)
    latencies.sort()
    emit("RESULT", {"n": len(latencies), "ops_s": len(latencies) / elapsed,
                    "p50_us": percentile(latencies, 50) / 1e3,
                    "p99_us": percentile(latencies, 99) / 1e3})


ROLES = {"fdatasync": role_fdatasync, "memcpy": role_memcpy, "memcpy_like": role_memcpy_like,
         "sock_recv": role_sock_recv,
         "sock_send": role_sock_send,
         "pingpong_srv": role_pingpong_srv, "pingpong_cli": role_pingpong_cli}
