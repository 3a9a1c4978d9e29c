"""Commands as bytes: how a metadata command travels in a Raft log entry.

A command is a msgpack array `[tag, field, ...]` with the fields in their dataclass order.
Fields added to a command later come last with a default, and may be missing from an entry
written before them (it decodes with the default). Arrays decode as tuples, which is what the commands' tuple fields (object keys, segment names)
are. Decoding checks the tag, the arity and each field's type, and raises ValueError otherwise:
entries come from disk and peers, and a bad one must stop the node with a clear message rather
than put a wrong value into the state machine.
"""

from __future__ import annotations

import dataclasses
import operator

import msgpack

from mooncaked.meta import commands as c

# Tags are part of the log format: never renumber one.
TAGS: dict[type, int] = {
    c.MountSegment: 1,
    c.UnmountSegment: 2,
    c.PutStart: 3,
    c.PutEnd: 4,
    c.PutRevoke: 5,
    c.Remove: 6,
    c.Evict: 7,
    c.ReleaseExpired: 8,
    c.NodeUp: 9,
    c.NodeDown: 10,
    c.PutCommit: 11,
    c.SetQuota: 12,
    c.AddReplicas: 13,
    c.MoveCommit: 14,
    c.SetStoreSettings: 15,
    c.ReserveArena: 16,
    c.CloseArenas: 17,
    c.ArenaPut: 18,
    c.Batch: 19,
    c.NodeReturn: 20,
    c.ReleaseDownNode: 21,
    c.AddDiskReplica: 22,
    c.DropDiskReplica: 23,
}
_BY_TAG = {tag: cls for cls, tag in TAGS.items()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in TAGS}
# Each command's field values as one tuple, in _FIELDS order (one C call per encode).
_VALUES = {cls: (operator.attrgetter(*names) if len(names) > 1
                 else (lambda command, name=names[0]: (getattr(command, name),)) if names
                 else (lambda command: ()))
           for cls, names in _FIELDS.items()}
# Fields without a default: an entry carries at least these.
_REQUIRED = {cls: sum(1 for f in dataclasses.fields(cls)
                      if f.default is dataclasses.MISSING) for cls in TAGS}


def _is_key(value) -> bool:
    return (type(value) is tuple and len(value) == 2
            and type(value[0]) is str and type(value[1]) is str)


def _is_int(value) -> bool:
    return type(value) is int


# What each field must look like, by field name (names mean the same in every command).
_CHECKS = {
    "object_key": _is_key,
    "reserved_key": _is_key,
    "object_keys": lambda v: type(v) is tuple and all(_is_key(k) for k in v),
    "preferred_segments": lambda v: type(v) is tuple and all(type(s) is str for s in v),
    "soft_pin_ttl_ms": lambda v: v is None or type(v) is int,
    "hard_pin": lambda v: type(v) is bool,
    "upsert": lambda v: type(v) is bool,
    "recovered": lambda v: type(v) is bool,
    "name": lambda v: type(v) is str,
    "node_name": lambda v: type(v) is str,
    "client_address": lambda v: type(v) is str,
    "peer_address": lambda v: type(v) is str,
    "namespace": lambda v: v == c.QUOTA_DEFAULT or c.valid_namespace(v),
    "max_bytes": lambda v: type(v) is int and v >= 0,
    "max_objects": lambda v: type(v) is int and v >= 0,
    "pool_namespace": lambda v: v == "" or c.valid_namespace(v),
    "owner_namespace": lambda v: v is None or c.valid_namespace(v),
    "allocation_strategy": lambda v: type(v) is str,
    "arena_ids": lambda v: type(v) is tuple and all(type(i) is int for i in v),
    "replicas": lambda v: type(v) is tuple and all(
        type(r) is tuple and len(r) == 2 and type(r[0]) is int and type(r[1]) is int
        for r in v),
}

def _check_fields(cls, values) -> None:
    for name, field_value in zip(_FIELDS[cls], values):
        if not _CHECKS.get(name, _is_int)(field_value):
            raise ValueError(f"command {cls.__name__}: bad {name} {field_value!r}")


def encode_batch(encoded: list[bytes]) -> bytes:
    """One Batch entry of commands already encoded (and so checked) by `encode`."""
    return msgpack.packb([TAGS[c.Batch], encoded], use_bin_type=True)


def encode(command) -> bytes:
    """The command's bytes; ValueError for a command `decode` would refuse, so that nothing
    that no node can decode is ever proposed."""
    return encode_checked(command)[0]


def encode_checked(command) -> tuple[bytes, object]:
    """The command's bytes and what `decode` makes of them (the command every node applies),
    or ValueError as for `encode`. A leader applies the second rather than decode its own
    bytes again."""
    cls = type(command)
    if cls is c.Batch:
        if type(command.commands) is not tuple \
                or any(type(sub) is c.Batch for sub in command.commands):
            raise ValueError("command Batch: a tuple of commands, none of them a Batch")
        encoded = [encode_checked(sub) for sub in command.commands]
        return (encode_batch([data for data, _ in encoded]),
                c.Batch(tuple(decoded for _, decoded in encoded)))
    if cls not in TAGS:
        raise ValueError(f"command: {cls.__name__} is not a log command")
    try:
        data = msgpack.packb([TAGS[cls], *_VALUES[cls](command)], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"command {cls.__name__}: cannot encode ({exc})") from None
    return data, _check(msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True))


def decode(data: bytes, in_batch: bool = False):
    """The command; ValueError for bytes that are not one (`in_batch`: nor a Batch)."""
    try:
        value = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad bytes
        raise ValueError(f"command: not msgpack ({exc})") from None
    return _check(value, in_batch)


def _check(value, in_batch: bool = False):
    if type(value) is not tuple or not value or type(value[0]) is not int:
        raise ValueError("command: expected an array starting with a tag")
    cls = _BY_TAG.get(value[0])
    if cls is None:
        raise ValueError(f"command: unknown tag {value[0]}")
    names = _FIELDS[cls]
    if not _REQUIRED[cls] <= len(value) - 1 <= len(names):
        expected = (f"{len(names)}" if _REQUIRED[cls] == len(names)
                    else f"{_REQUIRED[cls]} to {len(names)}")
        raise ValueError(f"command {cls.__name__}: expected {expected} fields, "
                         f"got {len(value) - 1}")
    if cls is c.Batch:
        if in_batch:
            raise ValueError("command Batch: a batch inside a batch")
        if len(value) != 2 or type(value[1]) is not tuple \
                or not all(type(item) is bytes for item in value[1]):
            raise ValueError("command Batch: expected one array of encoded commands")
        return c.Batch(tuple(decode(item, in_batch=True) for item in value[1]))
    _check_fields(cls, value[1:])
    return cls(*value[1:])
