"""Seed inputs of the client target: the request vectors and valid request sequences.

Each seed is the control bytes of client_target (kind, split seed) and a stream of frames:
every request vector of wire/vectors/frames.json after a hello, and sequences that exercise
each method with good parameters (puts, gets, removes, batches, shared-memory puts,
reservations and their commits). The ranges a reservation grants are learnt by running the
sequence's first half through the target (placements are seeded, so they repeat).
"""

from __future__ import annotations

import json
import os
import struct

import msgpack

import client_target
from wire_oracle import decode_replies

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VECTORS = os.path.join(REPO, "wire", "vectors", "frames.json")

TCP, UNIX = 0, 1
SWEEP = 2


def frame(msgid: int, method: str, params: list, payload: bytes = b"") -> bytes:
    header = msgpack.packb([0, msgid, method, params], use_bin_type=True)
    return struct.pack(">II", len(header), len(payload)) + header + payload


def hello(namespace: str = "default") -> bytes:
    return frame(0, "hello", [{"protocol": 1, "namespace": namespace, "client_name": "seed"}])


def control(flags: int, split_seed: int = 0) -> bytes:
    return bytes([flags]) + split_seed.to_bytes(2, "big")


def _vector_seeds() -> list[bytes]:
    with open(VECTORS, encoding="utf-8") as f:
        vectors = json.load(f)
    seeds = []
    for vector in vectors:
        data = bytes.fromhex(vector["frame_hex"])
        if vector["header"][0] != 0:
            continue  # responses and notifications are what the daemon sends
        stream = data if vector["header"][2] == "hello" else hello() + data
        seeds.append(control(TCP) + stream)
        seeds.append(control(UNIX, 7) + stream)
    return seeds


def _socket_sequences() -> list[bytes]:
    value = b"v" * 100
    big = bytes(range(256)) * 20
    return [
        hello() + frame(1, "put", ["a", None], value) + frame(2, "get", ["a"])
        + frame(3, "get_size", ["a"]) + frame(4, "exists", ["a"]) + frame(5, "remove", ["a"]),
        hello() + frame(1, "put", ["b", {"replica_num": 2}], big) + frame(2, "get", ["b"])
        + frame(3, "upsert", ["b"], value) + frame(4, "remove", ["b", True]),
        hello("ns1") + frame(1, "batch_put", [["x", "y", "z"], [10, 20, 30]], b"q" * 60)
        + frame(2, "batch_get", [["x", "y", "nope"]]) + frame(3, "batch_exists", [["x", "q"]])
        + frame(4, "batch_remove", [["x", "y"], True]) + frame(5, "remove_all", [True]),
        hello() + frame(1, "put", ["p", {"with_soft_pin": True, "soft_pin_ttl_ms": 100}], value)
        + frame(2, "put", ["h", {"with_hard_pin": True}], value)
        + frame(3, "remove_by_regex", ["^p", True]) + frame(4, "objects_list", ["", None, "*", 5])
        + frame(5, "object_stat", ["h"]) + frame(6, "status", []) + frame(7, "segments", [])
        + frame(8, "config_show", []) + frame(9, "cluster_status", []) + frame(10, "ping", []),
        hello() + b"".join(frame(n, "put", [f"w{n}"], bytes([n]) * 7000) for n in range(1, 6))
        + frame(6, "get", ["w1"]),
        hello() + b"".join(frame(n, "put", [f"n{n}"], b"n") for n in range(1, 40)),
        hello() + frame(1, "get", ["missing"]) + frame(2, "put", ["k", None], value)
        + frame(3, "put", ["k", None], value) + frame(4, "remove", ["k"]),
    ]


def _shared_memory_sequences() -> list[bytes]:
    starts = (hello() + frame(1, "put_start", ["s", 4096]) + frame(2, "put_end", ["s"])
              + frame(3, "get_replica", ["s"]) + frame(4, "put_start", ["t", 100, {"replica_num": 2}])
              + frame(5, "put_revoke", ["t"])
              + frame(6, "batch_put_start", [["u", "v"], [64, 128]])
              + frame(7, "batch_put_end", [["u"]]) + frame(8, "batch_put_revoke", [["v"]])
              + frame(9, "batch_get_replica", [["s", "u", "none"]])
              + frame(10, "put_start", ["left-open", 256]))
    reserve = hello() + frame(1, "reserve", [[[4096, 2], [64, 3]]])
    granted = _granted(reserve)
    commits = b""
    if len(granted) >= 5:
        (s0, o0, n0), (s1, o1, n1), (s2, o2, n2), (s3, o3, n3), (s4, o4, n4) = granted[:5]
        commits = (frame(2, "put_commit", ["r1", s0, o0, n0, None, [[4096, 1]], [[s1, o1]]])
                   + frame(3, "batch_put_commit", [["r2", "r3"], [[s2, o2, n2], [s3, o3, n3]]])
                   + frame(4, "get", ["r1"]) + frame(5, "reserve", [None, [[s4, o4]]]))
    return [starts, reserve + commits, reserve]


def _granted(stream: bytes) -> list[list[int]]:
    """The ranges the target's daemon grants to the stream's reserve requests."""
    written = client_target.run(control(UNIX) + stream)
    granted = []
    for reply in decode_replies(written):
        if reply.error is None and type(reply.result) is list:
            granted.extend(r for r in reply.result if type(r) is list and len(r) == 3)
    return granted


def seeds() -> dict[str, bytes]:
    named = {}
    for index, data in enumerate(_vector_seeds()):
        named[f"vector-{index:02d}"] = data
    for index, stream in enumerate(_socket_sequences()):
        named[f"socket-{index:02d}"] = control(TCP) + stream
        named[f"socket-{index:02d}-split"] = control(TCP | SWEEP, 1000 + index) + stream
    for index, stream in enumerate(_shared_memory_sequences()):
        named[f"shm-{index:02d}"] = control(UNIX) + stream
        named[f"shm-{index:02d}-split"] = control(UNIX | SWEEP, 2000 + index) + stream
    return named
