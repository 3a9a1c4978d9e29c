"""The shape of a `meta` request, checked before the leader acts on it.

A `meta` request reaches the leader from a peer (forwarded by a follower) or from this node;
what it carries becomes a log entry that every node must apply for ever. So each request is
checked field by field here, before anything is proposed: a malformed one is refused with
INVALID_PARAMS and changes nothing. `check` returns the params in the types the master takes
(keys and segment names as tuples, the replicate config as a ReplicateConfig).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec as command_codec
from mooncaked.meta import commands as c
from mooncaked.meta.master import ReplicateConfig

# Commands a node may register for itself (cluster/service.py `_register`).
REGISTER_COMMANDS = (c.NodeUp, c.MountSegment)
_UINT64_MAX = (1 << 64) - 1


class _Invalid(Exception):
    pass


def _int(value: Any, minimum: int = 0) -> int:
    if type(value) is not int or not minimum <= value <= _UINT64_MAX:
        raise _Invalid(f"an int >= {minimum}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Invalid("a bool")
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise _Invalid("a str")
    return value


def _key(value: Any) -> tuple[str, str]:
    if type(value) not in (list, tuple) or len(value) != 2 or \
            type(value[0]) is not str or type(value[1]) is not str or not value[1]:
        raise _Invalid("[namespace, key] of str")
    return (value[0], value[1])


def _keys(value: Any) -> list[tuple[str, str]]:
    if type(value) not in (list, tuple):
        raise _Invalid("an array of [namespace, key]")
    return [_key(key) for key in value]


def _config(value: Any) -> ReplicateConfig:
    if type(value) not in (list, tuple) or len(value) != 4:
        raise _Invalid("[replica_num, preferred_segments, soft_pin_ttl_ms, hard_pin]")
    replica_num, preferred, soft_pin_ttl_ms, hard_pin = value
    if type(preferred) not in (list, tuple) or any(type(s) is not str for s in preferred):
        raise _Invalid("preferred_segments: an array of str")
    if soft_pin_ttl_ms is not None:
        _int(soft_pin_ttl_ms, 1)
    return ReplicateConfig(_int(replica_num, 1), tuple(preferred), soft_pin_ttl_ms,
                           _bool(hard_pin))


def _pattern(value: Any) -> re.Pattern | None:
    if value is None:
        return None
    try:
        return re.compile(_str(value))
    except re.error as exc:
        raise _Invalid(f"a valid pattern ({exc})") from None


def _registration(value: Any) -> list:
    if type(value) not in (list, tuple):
        raise _Invalid("an array of encoded commands")
    registered = []
    for data in value:
        if type(data) is not bytes:
            raise _Invalid("encoded commands (bin)")
        try:
            command = command_codec.decode(data)
        except ValueError as exc:
            raise _Invalid(f"decodable commands ({exc})") from None
        if type(command) not in REGISTER_COMMANDS:
            raise _Invalid(f"NodeUp or MountSegment commands, not {type(command).__name__}")
        registered.append(command)
    # The leader mounts the segments under the generation the log gives the NodeUp.
    if not registered or type(registered[0]) is not c.NodeUp \
            or any(type(x) is not c.MountSegment
                   or c.node_of_segment(x.segment_id) != registered[0].node_id
                   for x in registered[1:]):
        raise _Invalid("a NodeUp, then MountSegment commands of that node's segments")
    return registered


def _quota_namespace(value: Any) -> str:
    if value != c.QUOTA_DEFAULT and not c.valid_namespace(value):
        raise _Invalid(f"a namespace or {c.QUOTA_DEFAULT!r}")
    return value


def _limit(value: Any) -> int | None:
    return None if value is None else _int(value)


def _node_id(value: Any) -> int:
    return _int(value, 1)


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


_SHAPES: dict[str, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    "put_start": (("key", _key), ("size", lambda v: _int(v, 1)), ("config", _config),
                  ("upsert", _bool), ("writer_id", _int)),
    "put_end": (("key", _key), ("writer_id", _int)),
    "put_revoke": (("key", _key), ("writer_id", _int), ("hold_ms", _int)),
    "read": (("keys", _keys),),
    "remove": (("key", _key), ("force", _bool)),
    "remove_matching": (("namespace", _str), ("pattern", _pattern), ("force", _bool)),
    "set_quota": (("namespace", _quota_namespace), ("max_bytes", _limit),
                  ("max_objects", _limit)),
    "register": (("commands", _registration),),
    "return": (("node_id", _node_id), ("generation", lambda v: _int(v, 1))),
    "join": (("node_id", _node_id), ("address", _str)),
    "leave": (("node_id", _node_id),),
    "remove_member": (("node_id", _node_id),),
    "transfer_leader": (("node_id", _node_id),),
    "drain": (("node_id", _node_id),),
    # Each None keeps the log's value; the leader checks the bounds of the result.
    "set_store_settings": (("max_objects", _optional(lambda v: _int(v, 1))),
                           ("put_start_discard_timeout_ms", _optional(lambda v: _int(v, 1))),
                           ("put_start_release_timeout_ms", _optional(lambda v: _int(v, 1))),
                           ("allocation_strategy", _optional(_str))),
}

METHODS = frozenset(_SHAPES)


def check(method: str, params: Any) -> list:
    """The params of a meta request, checked and converted; MooncakedError otherwise."""
    shape = _SHAPES.get(method)
    if shape is None:
        raise MooncakedError(ErrorCode.UNKNOWN_METHOD, f"no meta method {method!r}")
    names = ", ".join(name for name, _ in shape)
    if type(params) not in (list, tuple) or len(params) != len(shape):
        raise MooncakedError(ErrorCode.INVALID_PARAMS, f"meta {method} takes [{names}]")
    checked = []
    for (name, convert), value in zip(shape, params):
        try:
            checked.append(convert(value))
        except _Invalid as exc:
            raise MooncakedError(ErrorCode.INVALID_PARAMS,
                                 f"meta {method}: {name} must be {exc}") from None
    return checked
