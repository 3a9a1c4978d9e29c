"""A structure-aware mutator for the client target: changes requests, not only bytes.

Byte mutations of a frame mostly break its length prefix, and the daemon then only ever sees
malformed frames. Half of the time this mutator decodes the input's frames, changes one
request the way a lying client would (a parameter replaced by a value of another type, a huge
or negative number, a long or odd string, or nudged: a number off by a little, an array one
item longer or shorter; a method, msgid or payload length changed; frames repeated, dropped or
swapped) and encodes them again with correct prefixes. The other half,
and whenever the input does not decode, it leaves the bytes to libFuzzer's own mutations.
"""

from __future__ import annotations

import copy
import random
import struct

import msgpack

from mooncaked.daemon import handlers

PREFIX = struct.Struct(">II")
CONTROL_BYTES = 3
METHODS = sorted(handlers.HANDLERS) + ["", "nope", "hello\x00"]
INTERESTING = [
    0, 1, -1, 2, 63, 64, 65, 4096, 16384, 65535, 65536, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
    2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1, -2 ** 63, None, True, False, 1.5, float("inf"),
    "", "k", "a", "*", "#reserved", "default", "ns\n", "x" * 65, "é" * 40, ".*", "(", "a{99999}",
    b"", b"k", [], {}, [[64, 1]], [[4096, 2]], [[0, 0]], [[0, 0, 64]], [["k"]],
    {"replica_num": 2}, {"replica_num": 3}, {"replica_num": 2 ** 40},
    {"with_soft_pin": True}, {"with_hard_pin": True}, {"preferred_segments": ["fuzz/0"]},
    {"protocol": 1}, {"protocol": 2}, {"protocol": 1, "namespace": "*"},
]


def _split(stream: bytes):
    """[(header, payload)] of the whole frames that decode, and the bytes after them."""
    frames, position = [], 0
    while len(stream) - position >= PREFIX.size:
        header_length, payload_length = PREFIX.unpack_from(stream, position)
        end = position + PREFIX.size + header_length + payload_length
        if header_length == 0 or end > len(stream):
            break
        try:
            header = msgpack.unpackb(
                stream[position + PREFIX.size:position + PREFIX.size + header_length],
                raw=False, strict_map_key=False)
        except Exception:  # not msgpack: leave it to the byte mutations
            break
        frames.append([header, bytes(stream[end - payload_length:end])])
        position = end
    return frames, bytes(stream[position:])


def _join(frames, tail: bytes) -> bytes:
    out = bytearray()
    for header, payload in frames:
        packed = msgpack.packb(header, use_bin_type=True)
        out += PREFIX.pack(len(packed), len(payload)) + packed + payload
    return bytes(out + tail)


def _random_value(rng: random.Random):
    if rng.random() < 0.8:
        return rng.choice(INTERESTING)
    return rng.choice([rng.randrange(-2 ** 64, 2 ** 64), "k" + str(rng.randrange(100)),
                       [rng.choice(INTERESTING) for _ in range(rng.randrange(4))]])


def _nodes(value, path=()):
    """Paths to every value inside a decoded header's params."""
    yield path
    if type(value) is list:
        for index, item in enumerate(value):
            yield from _nodes(item, path + (index,))
    elif type(value) is dict:
        for key, item in value.items():
            yield from _nodes(item, path + (key,))


def _replace(value, path, new):
    if not path:
        return new
    value[path[0]] = _replace(value[path[0]], path[1:], new)
    return value


def _value_at(value, path):
    for step in path:
        value = value[step]
    return value


def _tweak(value, rng: random.Random):
    """A value near the one there: a number a little off, a list a little longer or shorter,
    a string changed at one end."""
    if type(value) is int:
        return rng.choice([value + 1, value - 1, value * 2, value // 2, -value, value + 64])
    if type(value) is list and value:
        value = copy.deepcopy(value)
        if rng.random() < 0.6:
            value.insert(rng.randrange(len(value) + 1), copy.deepcopy(rng.choice(value)))
        else:
            value.pop(rng.randrange(len(value)))
        return value
    if type(value) is str:
        return rng.choice([value + rng.choice("0aZ/."), value[:-1], value * 2])
    return _random_value(rng)


def _mutate_request(header, payload: bytes, rng: random.Random):
    if type(header) is not list or len(header) != 4 or type(header[3]) is not list:
        return [0, rng.randrange(8), rng.choice(METHODS), []], payload
    choice = rng.randrange(8)
    if choice == 0:
        header[2] = rng.choice(METHODS)
    elif choice == 1:
        header[1] = rng.choice([0, 1, 2, header[1], 2 ** 32 - 1, 2 ** 32, -1])
    elif choice == 2:
        size = rng.choice([0, 1, len(payload) + 1, max(len(payload) - 1, 0), 64, 4096])
        payload = (payload * (size // max(len(payload), 1) + 1))[:size] or bytes(size)
    elif choice == 3 and header[3]:
        header[3].pop(rng.randrange(len(header[3])))
    elif choice == 4:
        header[3].append(_random_value(rng))
    elif choice in (5, 6):
        path = rng.choice(list(_nodes(header[3])))
        header[3] = _replace(header[3], path, _tweak(_value_at(header[3], path), rng))
    else:
        paths = list(_nodes(header[3]))
        header[3] = _replace(header[3], rng.choice(paths), _random_value(rng))
    return header, payload


def mutate(data: bytes, max_size: int, seed: int, byte_mutate) -> bytes:
    """libFuzzer's custom mutator; `byte_mutate` is atheris.Mutate."""
    rng = random.Random(seed)
    if len(data) < CONTROL_BYTES or rng.random() < 0.5:
        return byte_mutate(data, max_size)
    control, (frames, tail) = data[:CONTROL_BYTES], _split(data[CONTROL_BYTES:])
    choice = rng.randrange(8)
    if not frames or choice == 0:
        control = bytes([rng.randrange(4)]) + rng.choice([0, rng.randrange(1, 65536)]).to_bytes(
            2, "big")
    elif choice == 1 and len(frames) > 1:
        frames.insert(rng.randrange(len(frames) + 1), copy.deepcopy(rng.choice(frames)))
    elif choice == 2 and len(frames) > 1:
        frames.pop(rng.randrange(1, len(frames)))  # keep the hello, most of the time
    elif choice == 3 and len(frames) > 2:
        i, j = rng.randrange(1, len(frames)), rng.randrange(1, len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    else:
        index = rng.randrange(len(frames))
        frames[index] = list(_mutate_request(*frames[index], rng))
    try:
        out = control + _join(frames, tail)
    except (OverflowError, ValueError, TypeError):  # a value msgpack cannot encode
        return byte_mutate(data, max_size)
    if len(out) > max_size:
        return byte_mutate(data, max_size)
    return out
