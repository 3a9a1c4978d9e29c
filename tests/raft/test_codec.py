"""The Raft codec: round trips, a pinned byte layout, and ValueError (only) for bad input."""

from __future__ import annotations

from enum import IntEnum

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncaked.raft import codec
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

uint64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
small_bytes = st.binary(max_size=48)
node_ids = st.lists(uint64, max_size=5).map(tuple)

entries = st.builds(Entry, term=uint64, index=uint64, kind=st.sampled_from(EntryKind),
                    data=small_bytes)
conf_changes = st.builds(ConfChange, kind=st.sampled_from(ConfChangeKind), node_id=uint64,
                         context=small_bytes)
conf_states = st.builds(ConfState, voters=node_ids, learners=node_ids)
snapshots = st.builds(
    Snapshot,
    meta=st.builds(SnapshotMeta, index=uint64, term=uint64, conf_state=conf_states),
    data=small_bytes,
)
hard_states = st.builds(HardState, term=uint64, vote=uint64, commit=uint64)
messages = st.builds(
    Message,
    type=st.sampled_from(MessageType),
    to=uint64,
    from_=uint64,
    term=uint64,
    log_term=uint64,
    index=uint64,
    entries=st.lists(entries, max_size=4).map(tuple),
    commit=uint64,
    reject=st.booleans(),
    reject_hint=uint64,
    snapshot=st.none() | snapshots,
    context=small_bytes,
)

CODECS = {
    "entry": (codec.encode_entry, codec.decode_entry, entries),
    "conf_change": (codec.encode_conf_change, codec.decode_conf_change, conf_changes),
    "snapshot": (codec.encode_snapshot, codec.decode_snapshot, snapshots),
    "hard_state": (codec.encode_hard_state, codec.decode_hard_state, hard_states),
    "message": (codec.encode_message, codec.decode_message, messages),
}
DECODERS = [decode for _, decode, _ in CODECS.values()]


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_round_trip(name, data):
    encode, decode, values = CODECS[name]
    value = data.draw(values)
    encoded = encode(value)
    assert isinstance(encoded, bytes)
    decoded = decode(encoded)
    assert decoded == value
    for enum_field in ("kind", "type"):  # enums come back as enums, not bare ints
        if hasattr(decoded, enum_field):
            assert isinstance(getattr(decoded, enum_field), IntEnum)
    assert encode(decoded) == encoded


def test_byte_layout_is_pinned():
    # Compact positional arrays: these bytes are what the log file and the wire hold.
    assert codec.encode_hard_state(HardState(1, 2, 3)) == bytes([0x93, 1, 2, 3])
    assert codec.encode_entry(Entry(2, 7, EntryKind.CONF_CHANGE, b"ab")) == bytes(
        [0x94, 2, 7, 1, 0xC4, 2]) + b"ab"
    remove = ConfChange(ConfChangeKind.REMOVE, 3)
    assert codec.encode_conf_change(remove) == bytes([0x93, 2, 3, 0xC4, 0])
    heartbeat = Message(MessageType.HEARTBEAT, 2, 1, 5, commit=9)
    assert codec.encode_message(heartbeat) == bytes(
        [0x9C, 7, 2, 1, 5, 0, 0, 0x90, 9, 0xC2, 0, 0xC0, 0xC4, 0])


def test_message_with_entries_and_snapshot_round_trips():
    snapshot = Snapshot(SnapshotMeta(10, 3, ConfState((1, 2, 3), (4,))), b"state")
    msg = Message(MessageType.APPEND, 2, 1, 3, log_term=3, index=10,
                  entries=(Entry(3, 11, data=b"x"), Entry(3, 12, EntryKind.CONF_CHANGE, b"y")),
                  commit=11, reject=True, reject_hint=4, snapshot=snapshot, context=b"ctx")
    assert codec.decode_message(codec.encode_message(msg)) == msg


def _valid_message_fields() -> list:
    msg = Message(MessageType.APPEND, 2, 1, 3, entries=(Entry(1, 1),))
    return msgpack.unpackb(codec.encode_message(msg))


@pytest.mark.parametrize(
    "fields, complaint",
    [
        (lambda f: f[:-1], "expected 12 fields"),
        (lambda f: f + [0], "expected 12 fields"),
        (lambda f: [99] + f[1:], "unknown MessageType 99"),
        (lambda f: [f[0], True] + f[2:], "message.to: expected an integer"),
        (lambda f: f[:3] + [-1] + f[4:], "message.term"),
        (lambda f: f[:3] + [1.5] + f[4:], "message.term: expected an integer"),
        (lambda f: f[:6] + [{}] + f[7:], "message.entries: expected an array"),
        (lambda f: f[:6] + [[[1, 1, 7, b""]]] + f[7:], "unknown EntryKind 7"),
        (lambda f: f[:6] + [[[1, 1, 0, "text"]]] + f[7:], "expected bytes"),
        (lambda f: f[:6] + [[[1, 1, 0]]] + f[7:], "expected 4 fields"),
        (lambda f: f[:8] + [1] + f[9:], "message.reject: expected a boolean"),
        (lambda f: f[:10] + [[[1, 1, [[1], "x"]], b""]] + f[11:], "conf_state.learners"),
        (lambda f: f[:10] + [[[1, 1], b""]] + f[11:], "expected 3 fields"),
        (lambda f: f[:11] + ["ctx"], "message.context: expected bytes"),
        (lambda f: {"type": 1}, "expected an array"),
    ],
)
def test_malformed_message_names_the_problem(fields, complaint):
    data = msgpack.packb(fields(_valid_message_fields()), use_bin_type=True)
    with pytest.raises(ValueError, match=complaint):
        codec.decode_message(data)


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01\x02", b"\x93\x01\x02\x03\x04", "text", None, 12,
     b"\xdd\xff\xff\xff\xff", msgpack.packb(msgpack.ExtType(5, b"x")),
     msgpack.packb([[[[[[[[]]]]]]]])],
)
def test_garbage_raises_value_error(decode, data):
    with pytest.raises(ValueError):
        decode(data)


def test_enum_out_of_range_and_wrong_shapes():
    with pytest.raises(ValueError, match="unknown ConfChangeKind"):
        codec.decode_conf_change(msgpack.packb([9, 1, b""]))
    with pytest.raises(ValueError, match="hard state.vote: expected an integer"):
        codec.decode_hard_state(msgpack.packb([1, None, 3]))
    with pytest.raises(ValueError, match="out of range"):
        codec.decode_hard_state(msgpack.packb([1, -5, 3]))
    with pytest.raises(ValueError, match="not valid msgpack"):
        codec.decode_entry(codec.encode_entry(Entry(1, 1)) + b"\x00")  # trailing bytes


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (st.lists(children, max_size=13)
                      | st.dictionaries(st.text(max_size=4), children, max_size=3)),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(value=json_like)
def test_any_msgpack_value_decodes_or_raises_value_error(value):
    data = msgpack.packb(value, use_bin_type=True)
    for decode in DECODERS:
        try:
            decode(data)
        except ValueError:
            pass


@settings(max_examples=300, deadline=None)
@given(msg=messages, position=st.integers(min_value=0), byte=st.integers(0, 255), cut=st.booleans())
def test_damaged_encodings_decode_or_raise_value_error(msg, position, byte, cut):
    data = bytearray(codec.encode_message(msg))
    position %= len(data)
    if cut:
        del data[position:]
    else:
        data[position] = byte
    try:
        codec.decode_message(bytes(data))
    except ValueError:
        pass
