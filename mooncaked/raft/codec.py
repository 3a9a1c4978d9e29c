"""Bytes for the Raft vocabulary: msgpack arrays, positional, no field names.

    Entry         [term, index, kind, data]
    ConfChange    [kind, node_id, context]
    ConfState     [[voter, ...], [learner, ...]]
    SnapshotMeta  [index, term, ConfState]
    Snapshot      [SnapshotMeta, data]
    HardState     [term, vote, commit]
    Message       [type, to, from, term, log_term, index, [Entry, ...], commit, reject,
                   reject_hint, Snapshot or nil, context]

Integers are non-negative and below 2**64; byte fields are msgpack bin. Decoding checks every
type, length and enum value and raises ValueError, and only ValueError, on anything else: the
input comes from the network or from disk and must never crash the caller another way.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, TypeVar

import msgpack

from mooncaked.raft.types import (
    ConfChange,
    ConfChangeKind,
    ConfState,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)

MAX_UINT64 = (1 << 64) - 1
E = TypeVar("E", bound=IntEnum)


# --- to plain values ---


def _entry_value(entry: Entry) -> list:
    return [entry.term, entry.index, int(entry.kind), bytes(entry.data)]


def _conf_state_value(conf_state: ConfState) -> list:
    return [list(conf_state.voters), list(conf_state.learners)]


def _snapshot_value(snapshot: Snapshot) -> list:
    meta = snapshot.meta
    return [[meta.index, meta.term, _conf_state_value(meta.conf_state)], bytes(snapshot.data)]


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def encode_entry(entry: Entry) -> bytes:
    return _pack(_entry_value(entry))


def encode_conf_change(change: ConfChange) -> bytes:
    return _pack([int(change.kind), change.node_id, bytes(change.context)])


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _pack(_snapshot_value(snapshot))


def encode_hard_state(hard_state: HardState) -> bytes:
    return _pack([hard_state.term, hard_state.vote, hard_state.commit])


def encode_message(msg: Message) -> bytes:
    return _pack(
        [
            int(msg.type),
            msg.to,
            msg.from_,
            msg.term,
            msg.log_term,
            msg.index,
            [_entry_value(entry) for entry in msg.entries],
            msg.commit,
            bool(msg.reject),
            msg.reject_hint,
            None if msg.snapshot is None else _snapshot_value(msg.snapshot),
            bytes(msg.context),
        ]
    )


# --- from plain values, checking everything ---


def _unpack(data: Any, what: str) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ValueError(f"{what}: not valid msgpack ({exc.__class__.__name__}: {exc})") from None


def _array(value: Any, length: int, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what}: expected an array, got {type(value).__name__}")
    if len(value) != length:
        raise ValueError(f"{what}: expected {length} fields, got {len(value)}")
    return value


def _uint(value: Any, what: str) -> int:
    # bool is an int subclass in Python but a distinct msgpack type: refuse it here.
    if type(value) is not int:
        raise ValueError(f"{what}: expected an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_UINT64:
        raise ValueError(f"{what}: {value} is out of range")
    return value


def _bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError(f"{what}: expected bytes, got {type(value).__name__}")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{what}: expected a boolean, got {type(value).__name__}")
    return value


def _enum(enum: type[E], value: Any, what: str) -> E:
    number = _uint(value, what)
    try:
        return enum(number)
    except ValueError:
        raise ValueError(f"{what}: unknown {enum.__name__} {number}") from None


def _node_ids(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what}: expected an array, got {type(value).__name__}")
    return tuple(_uint(item, what) for item in value)


def _entry_from(value: Any, what: str = "entry") -> Entry:
    term, index, kind, data = _array(value, 4, what)
    return Entry(
        term=_uint(term, f"{what}.term"),
        index=_uint(index, f"{what}.index"),
        kind=_enum(EntryKind, kind, f"{what}.kind"),
        data=_bytes(data, f"{what}.data"),
    )


def _conf_state_from(value: Any, what: str) -> ConfState:
    voters, learners = _array(value, 2, what)
    return ConfState(_node_ids(voters, f"{what}.voters"), _node_ids(learners, f"{what}.learners"))


def _snapshot_from(value: Any, what: str = "snapshot") -> Snapshot:
    meta, data = _array(value, 2, what)
    index, term, conf_state = _array(meta, 3, f"{what}.meta")
    return Snapshot(
        meta=SnapshotMeta(
            index=_uint(index, f"{what}.meta.index"),
            term=_uint(term, f"{what}.meta.term"),
            conf_state=_conf_state_from(conf_state, f"{what}.meta.conf_state"),
        ),
        data=_bytes(data, f"{what}.data"),
    )


def decode_entry(data: bytes) -> Entry:
    return _entry_from(_unpack(data, "entry"))


def decode_conf_change(data: bytes) -> ConfChange:
    kind, node_id, context = _array(_unpack(data, "conf change"), 3, "conf change")
    return ConfChange(
        kind=_enum(ConfChangeKind, kind, "conf change.kind"),
        node_id=_uint(node_id, "conf change.node_id"),
        context=_bytes(context, "conf change.context"),
    )


def decode_snapshot(data: bytes) -> Snapshot:
    return _snapshot_from(_unpack(data, "snapshot"))


def decode_hard_state(data: bytes) -> HardState:
    term, vote, commit = _array(_unpack(data, "hard state"), 3, "hard state")
    return HardState(
        term=_uint(term, "hard state.term"),
        vote=_uint(vote, "hard state.vote"),
        commit=_uint(commit, "hard state.commit"),
    )


def decode_message(data: bytes) -> Message:
    fields = _array(_unpack(data, "message"), 12, "message")
    (msg_type, to, from_, term, log_term, index, entries, commit, reject, reject_hint,
     snapshot, context) = fields
    if not isinstance(entries, list):
        raise ValueError(f"message.entries: expected an array, got {type(entries).__name__}")
    return Message(
        type=_enum(MessageType, msg_type, "message.type"),
        to=_uint(to, "message.to"),
        from_=_uint(from_, "message.from"),
        term=_uint(term, "message.term"),
        log_term=_uint(log_term, "message.log_term"),
        index=_uint(index, "message.index"),
        entries=tuple(_entry_from(entry, "message.entries[]") for entry in entries),
        commit=_uint(commit, "message.commit"),
        reject=_bool(reject, "message.reject"),
        reject_hint=_uint(reject_hint, "message.reject_hint"),
        snapshot=None if snapshot is None else _snapshot_from(snapshot, "message.snapshot"),
        context=_bytes(context, "message.context"),
    )
