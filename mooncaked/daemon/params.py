"""The checks of a request's params, shared by the single-node and the cluster handlers
(daemon/handlers.py, daemon/cluster_handlers.py): a bad value is an INVALID_PARAMS error with a
message that names what is wrong."""

from __future__ import annotations

from typing import Any

from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta.master import ReplicateConfig


def invalid(message: str) -> MooncakedError:
    return MooncakedError(ErrorCode.INVALID_PARAMS, message)


def arity(params: list, least: int, most: int, usage: str) -> None:
    if not least <= len(params) <= most:
        raise invalid(f"expected params {usage}, got {len(params)} values")


def optional(params: list, index: int, default: Any) -> Any:
    if len(params) > index and params[index] is not None:
        return params[index]
    return default


def as_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise invalid(f"{name} must be a bool")
    return value


def as_int(value: Any, name: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise invalid(f"{name} must be an int >= {minimum}")
    return value


def key(conn, value: Any) -> tuple[str, str]:
    if type(value) is not str or not value:
        raise invalid("a key must be a non-empty str")
    limit = conn.daemon.max_key_bytes
    # UTF-8 takes 1 to 4 bytes a character: encode only when the length alone cannot decide.
    if len(value) > limit or (4 * len(value) > limit and len(value.encode()) > limit):
        raise invalid(f"a key must be at most {limit} UTF-8 bytes")
    return (conn.namespace, value)


def keys(conn, value: Any) -> list[tuple[str, str]]:
    if type(value) is not list:
        raise invalid("keys must be an array of str")
    if len(value) > conn.daemon.max_batch_keys:
        raise invalid(f"a batch holds at most {conn.daemon.max_batch_keys} keys")
    return [key(conn, k) for k in value]


def sizes(value: Any, count: int) -> list[int]:
    if type(value) is not list or len(value) != count:
        raise invalid("sizes must be an array with one int per key")
    for size in value:
        if type(size) is not int or size <= 0:
            raise invalid("each size must be an int >= 1")
    return value


_CONFIG_KEYS = {"replica_num", "preferred_segments", "with_soft_pin", "soft_pin_ttl_ms",
                "with_hard_pin", "write_through"}
_DEFAULT_CONFIG = ReplicateConfig()


def replicate_config(conn, value: Any) -> ReplicateConfig:
    if value is None:
        return _DEFAULT_CONFIG
    if type(value) is not dict:
        raise invalid("config must be a map or nil")
    unknown = set(value) - _CONFIG_KEYS
    if unknown:
        raise invalid(f"unknown config keys: {', '.join(sorted(map(str, unknown)))}")
    replica_num = as_int(value.get("replica_num", 1), "replica_num", 1)
    preferred = value.get("preferred_segments", [])
    if type(preferred) is not list or any(type(p) is not str for p in preferred):
        raise invalid("preferred_segments must be an array of str")
    soft_pin = as_bool(value.get("with_soft_pin", False), "with_soft_pin")
    ttl = value.get("soft_pin_ttl_ms")
    if ttl is not None:
        if not soft_pin:
            raise invalid("soft_pin_ttl_ms needs with_soft_pin")
        ttl = as_int(ttl, "soft_pin_ttl_ms", 1)
    elif soft_pin:
        ttl = conn.daemon.config.store.soft_pin_ttl_ms
    write_through = value.get("write_through")
    if write_through is not None:
        write_through = as_bool(write_through, "write_through")
    config = ReplicateConfig(replica_num, tuple(preferred), ttl,
                             as_bool(value.get("with_hard_pin", False), "with_hard_pin"),
                             write_through)
    conn.daemon.master.check_replicate_config(config)
    return config
