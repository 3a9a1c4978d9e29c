"""Fuzz target: what a peer sends, from garbage bytes to well-formed lies.

Byte 0 of the input picks a mode (modulo 4); the rest is its input:

0. The Raft codec (mooncaked/raft/codec.py): every decoder on the bytes. Only ValueError may
   come out; what decodes must encode and decode back to the same value.
1. The metadata command codec (mooncaked/meta/codec.py): the same rules.
2. A Raft core (mooncaked/raft/core.py), node 1 of voters {1, 2, 3}, fed messages built from
   the bytes: any type, any sender (members, non-members, itself, 0), terms and indexes around
   its own and at the ends of the u64 range, entries at wrong indexes and terms, snapshots,
   huge commits. Between messages it ticks, proposes and handles its Readies as the driver
   does (persist, apply, advance). It must never raise, and after every step: the term never
   decreases, the commit index never decreases and never passes the last index, the log's
   entries are contiguous with non-decreasing terms, a committed entry never changes, and
   every message it sends encodes (codec) and decodes back equal.
3. The peer listener's frame reader (cluster/peer_transport.py `_ServerProtocol`), with the
   bytes as the stream and an in-memory transport: a bad frame closes the connection, nothing
   else escapes, nothing reaches the log at ERROR, nothing before peer_hello makes it hold
   more than a small buffer; Raft notifications go to a core as in mode 2.
"""

from __future__ import annotations

import logging
import random

from mooncaked.cluster import peer_transport
from mooncaked.meta import codec as command_codec
from mooncaked.raft import codec
from mooncaked.raft.core import RaftConfig, RaftCore
from mooncaked.raft.types import (ConfChange, ConfChangeKind, ConfState, Entry, EntryKind,
                                  HardState, Message, MessageType, NotLeader, ProposalDropped,
                                  Role, Snapshot, SnapshotMeta)

from fakes import ErrorRecords, FakeTransport
from wire_oracle import Finding

U64_MAX = (1 << 64) - 1
NODE = 1
VOTERS = (1, 2, 3)
SENDERS = (2, 3, 4, 0, 1, 99, U64_MAX)  # members, a non-member, nobody, itself, extremes
# Anyone who can connect may send bytes before peer_hello: what they make the listener hold.
PRE_HELLO_BUFFER_BYTES = 64 * 1024


# -- modes 0 and 1: codecs ----------------------------------------------------------------------

_DECODERS = (
    (codec.decode_message, codec.encode_message),
    (codec.decode_entry, codec.encode_entry),
    (codec.decode_conf_change, codec.encode_conf_change),
    (codec.decode_snapshot, codec.encode_snapshot),
    (codec.decode_hard_state, codec.encode_hard_state),
)


def _raft_codec(data: bytes) -> None:
    for decode, encode in _DECODERS:
        try:
            value = decode(data)
        except ValueError:
            continue
        if decode(encode(value)) != value:
            raise Finding(f"{decode.__name__}: {value!r:.200} does not survive a round trip")


def _command_codec(data: bytes) -> None:
    try:
        command = command_codec.decode(data)
    except ValueError:
        return
    if command_codec.decode(command_codec.encode(command)) != command:
        raise Finding(f"command {command!r:.200} does not survive a round trip")


# -- mode 2: a Raft core fed lies ---------------------------------------------------------------

class Reader:
    """Choices drawn from the input's bytes; zeros once they run out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0

    def more(self) -> bool:
        return self.position < len(self.data)

    def byte(self) -> int:
        if self.position >= len(self.data):
            return 0
        self.position += 1
        return self.data[self.position - 1]

    def choice(self, options):
        return options[self.byte() % len(options)]

    def small(self, limit: int) -> int:
        return self.byte() % limit


class Driver:
    """A RaftCore and what its driver keeps: the applied state, the committed entries seen."""

    def __init__(self, leader: bool) -> None:
        self.core = RaftCore(RaftConfig(node_id=NODE, election_ticks=5),
                             random.Random(0), conf_state=ConfState(VOTERS))
        self.committed: dict[int, int] = {}  # index -> term, of every entry applied
        self.last_term = 0
        self.last_commit = 0
        self.handle_readies()
        if leader:
            self.core.campaign()  # pre-vote, then votes granted by 2: a leader of term 2
            self.handle_readies()
            term = self.core.term
            self.step(Message(MessageType.PRE_VOTE_RESPONSE, NODE, 2, term + 1))
            self.step(Message(MessageType.VOTE_RESPONSE, NODE, 2, self.core.term))
            if self.core.role != Role.LEADER:
                raise Finding(f"the core did not become leader: {self.core.status()}")

    def step(self, msg: Message) -> None:
        self.core.step(msg)
        self.check()
        self.handle_readies()

    def handle_readies(self) -> None:
        core = self.core
        for _ in range(100):
            if not core.has_ready():
                return
            rd = core.ready()
            for msg in rd.messages:
                try:
                    encoded = codec.encode_message(msg)
                except (OverflowError, ValueError, TypeError) as exc:
                    raise Finding(f"the core sent a message the codec cannot encode "
                                  f"({type(exc).__name__}: {exc}): {msg!r:.300}") from None
                if codec.decode_message(encoded) != msg:
                    raise Finding(f"a sent message does not decode back: {msg!r:.300}")
            if rd.snapshot is not None:
                self.committed = {i: t for i, t in self.committed.items()
                                  if i > rd.snapshot.meta.index}
            for entry in rd.committed_entries:
                seen = self.committed.get(entry.index)
                if seen is not None and seen != entry.term:
                    raise Finding(f"committed entry {entry.index} changed term {seen} -> "
                                  f"{entry.term}")
                self.committed[entry.index] = entry.term
                if entry.kind == EntryKind.CONF_CHANGE:
                    try:
                        change = codec.decode_conf_change(entry.data)
                    except ValueError:
                        continue  # the node stops on such an entry (cluster/raft_node.py)
                    core.apply_conf_change(change)
            core.advance(rd)
            self.check()
        raise Finding("the core keeps producing Readies (100 in a row)")

    def check(self) -> None:
        core = self.core
        log = core._log
        if core.term < self.last_term:
            raise Finding(f"term went back from {self.last_term} to {core.term}")
        if core.commit_index < self.last_commit:
            raise Finding(f"commit index went back from {self.last_commit} to "
                          f"{core.commit_index}")
        if core.commit_index > core.last_index:
            raise Finding(f"commit index {core.commit_index} is past the last index "
                          f"{core.last_index}")
        previous_term = log.snapshot_term
        for position, entry in enumerate(log._entries):
            if entry.index != log.snapshot_index + 1 + position:
                raise Finding(f"the log holds entry {entry.index} at index "
                              f"{log.snapshot_index + 1 + position}")
            if entry.term < previous_term:
                raise Finding(f"the log's terms go back at index {entry.index}")
            previous_term = entry.term
        self.last_term = core.term
        self.last_commit = core.commit_index


def _index(reader: Reader, core: RaftCore) -> int:
    last, commit = core.last_index, core.commit_index
    return reader.choice((last, last + 1, last - 1 if last else 0, commit, commit + 1, 0, 1,
                          last + reader.small(8), U64_MAX, U64_MAX - 1))


def _term(reader: Reader, core: RaftCore) -> int:
    term = core.term
    return reader.choice((term, term + 1, term - 1 if term else 0, 0, 1, term + 2,
                          U64_MAX, U64_MAX - 1))


def _entries(reader: Reader, core: RaftCore, first: int) -> tuple[Entry, ...]:
    entries = []
    contiguous = reader.byte() % 4 != 0
    for position in range(reader.small(5)):
        index = first + position if contiguous else _index(reader, core)
        kind = reader.choice((EntryKind.NORMAL, EntryKind.NORMAL, EntryKind.CONF_CHANGE))
        if kind == EntryKind.CONF_CHANGE and reader.byte() % 2:
            data = codec.encode_conf_change(ConfChange(reader.choice(tuple(ConfChangeKind)),
                                                       reader.choice((1, 2, 3, 4, 5))))
        else:
            data = bytes(reader.small(4))
        entries.append(Entry(_term(reader, core), index, kind, data))
    return tuple(entries)


def _message(reader: Reader, core: RaftCore) -> Message:
    msg_type = reader.choice(tuple(MessageType))
    index = _index(reader, core)
    snapshot = None
    if msg_type == MessageType.SNAPSHOT and reader.byte() % 4:
        voters = reader.choice(((1, 2, 3), (2, 3), (1,), (4, 5, 6), ()))
        snapshot = Snapshot(SnapshotMeta(_index(reader, core), _term(reader, core),
                                         ConfState(voters)), b"")
    context = reader.choice((b"", b"transfer", bytes(16), b"\xff" * 16))
    return Message(msg_type, reader.choice((NODE, NODE, NODE, 2, 0)),
                   reader.choice(SENDERS), _term(reader, core), log_term=_term(reader, core),
                   index=index, entries=_entries(reader, core, index + 1),
                   commit=_index(reader, core), reject=bool(reader.byte() % 2),
                   reject_hint=_index(reader, core), snapshot=snapshot, context=context)


def _raft_core(data: bytes) -> None:
    reader = Reader(data)
    driver = Driver(leader=bool(reader.byte() % 2))
    for _ in range(64):
        if not reader.more():
            break
        action = reader.small(8)
        core = driver.core
        if action == 0:
            core.tick()
            driver.check()
            driver.handle_readies()
        elif action == 1:
            try:
                core.propose(b"x")
            except (NotLeader, ProposalDropped):  # the documented refusals
                pass
            driver.handle_readies()
        else:
            driver.step(_message(reader, core))


# -- mode 3: the peer listener's frame reader ---------------------------------------------------

_errors = ErrorRecords()
_peer_log = logging.getLogger("mooncaked")
_peer_log.addHandler(_errors)
_peer_log.setLevel(logging.WARNING)
_peer_log.propagate = False


def _peer_frames(data: bytes) -> None:
    driver = Driver(leader=False)
    raft_messages = []

    def on_raft(message_bytes: bytes) -> None:
        try:
            message = codec.decode_message(message_bytes)
        except ValueError:
            return  # dropped, as cluster/raft_node.py does
        raft_messages.append(message)
        if message.to == NODE:
            driver.step(message)

    async def on_request(method, params, payload):  # never awaited: see _answer_soon below
        return None, None

    server = peer_transport.PeerServer(lambda node_id, address: None, on_raft, on_request,
                                       max_payload_bytes=1 << 16)
    requests = []
    server._answer_soon = lambda transport, msgid, method, params, payload: requests.append(
        (msgid, method, params, payload))  # the handler runs on the loop; here, only recorded
    protocol = peer_transport._ServerProtocol(server)
    transport = FakeTransport()
    protocol.connection_made(transport)
    _errors.records.clear()
    reader_seed = data[0] if data else 0
    rng = random.Random(reader_seed)
    position = 1
    while position < len(data) and not transport.closing:
        end = min(len(data), position + rng.choice((1, 3, 8, 64, 4096, len(data))))
        while position < end and not transport.closing:
            buffer = protocol.get_buffer(-1)
            if not len(buffer):
                raise Finding("get_buffer returned an empty buffer")
            count = min(len(buffer), end - position)
            buffer[:count] = data[position:position + count]
            position += count
            protocol.buffer_updated(count)
            if not protocol.hello and len(protocol._scratch) > PRE_HELLO_BUFFER_BYTES:
                raise Finding(f"before peer_hello, the listener holds a buffer of "
                              f"{len(protocol._scratch)} bytes for one frame")
    protocol.connection_lost(None)
    if _errors.records:
        record = _errors.records[0]
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        raise Finding(f"the peer listener logged an error: {text}")
    if server._transports:
        raise Finding("the closed peer connection is still registered")


MODES = (_raft_codec, _command_codec, _raft_core, _peer_frames)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    MODES[data[0] % len(MODES)](data[1:])


def seeds() -> dict[str, bytes]:
    import msgpack
    from mooncaked.meta import commands as c
    from mooncaked.proto import framing

    entry = Entry(2, 5, EntryKind.NORMAL, b"cmd")
    append = Message(MessageType.APPEND, 1, 2, 3, log_term=1, index=4, entries=(entry,),
                     commit=4)
    snapshot = Snapshot(SnapshotMeta(7, 2, ConfState((1, 2, 3))), b"state")
    named = {
        "raft-append": bytes([0]) + codec.encode_message(append),
        "raft-snapshot": bytes([0]) + codec.encode_message(
            Message(MessageType.SNAPSHOT, 1, 2, 3, snapshot=snapshot)),
        "raft-entry": bytes([0]) + codec.encode_entry(entry),
        "raft-conf-change": bytes([0]) + codec.encode_conf_change(
            ConfChange(ConfChangeKind.ADD_LEARNER, 4, b"addr")),
        "raft-hard-state": bytes([0]) + codec.encode_hard_state(HardState(3, 2, 1)),
        "command-put-start": bytes([1]) + command_codec.encode(
            c.PutStart(("ns", "k"), 100, 1, ("a/0",), None, False, False, 7, 1000, 42)),
        "command-mount": bytes([1]) + command_codec.encode(
            c.MountSegment(1, "a/0", "a", 1 << 20, 64, 1024)),
        "command-evict": bytes([1]) + command_codec.encode(c.Evict((("ns", "k"),))),
    }
    for leader in (0, 1):
        # Mode 2: the scenario bytes are choices; these walk a few of each kind.
        named[f"core-{leader}-mixed"] = bytes([2, leader]) + bytes(range(2, 200))
        named[f"core-{leader}-appends"] = bytes([2, leader]) + bytes(
            [4, 4, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0] * 8)
        named[f"core-{leader}-ticks"] = bytes([2, leader]) + bytes([0] * 30 + [8, 5, 0] * 10)
    hello = framing.request_head(0, "peer_hello", [2, "127.0.0.1:7000"])
    raft = framing.frame_head([framing.NOTIFICATION, "raft", [codec.encode_message(append)]])
    request = framing.request_head(1, "read_replica", [0, 0, 16])
    named["frames"] = bytes([3, 0]) + hello + raft + request
    named["frames-split"] = bytes([3, 5]) + hello + raft + raft + request
    named["frames-large-header-before-hello"] = bytes([3, 0]) + framing.PREFIX.pack(
        32 << 20, 0) + b"\x94" * 2
    named["frames-payload"] = bytes([3, 9]) + hello + framing.request_head(
        2, "write_replica", [0, 0, 4], 4) + b"abcd" + msgpack.packb(None)
    return named
