"""Linearizability checker for recorded client histories of the store's metadata operations.

A history is a list of `Operation`s, each with the time it was invoked and the time its result
came back, on one monotonic clock shared by all clients. The history is linearizable if every
operation can be given a single instant between its invocation and its completion such that the
results match a sequential run of the object model below in that order.

Object model, per key (keys are independent, so each key is checked on its own):

- `put(key, v)`: write-once. True: the key was absent and now holds v. False: the key was
  present (or being written); nothing changed.
- `upsert(key, v)`: always replaces; result True.
- `get(key)`: the value held, or None when absent.
- `remove(key)`: True: the key was present and is now absent. False: it was absent.
- `exists(key)`: whether the key is present.

Value ids must be hashable, must not be None, and should be unique per write (a get is matched to
a write by its value).

Recording rules for callers:

- An operation whose outcome is unknown (timeout, connection reset) is recorded with
  `complete_ns=None`; its result is ignored. It may have taken effect at any instant after its
  invocation, or never.
- An operation that failed in a way known to have changed nothing (the store rejected it before
  doing anything) must be left out of the history altogether. Only then: a put that reserved the
  key (so that a concurrent put returned False) and then failed had a visible effect, and is
  consistent only as an unknown outcome followed by a spontaneous loss.

With `allow_spontaneous_loss=True` the key may also become absent on its own at any instant
(eviction, every replica lost). A get may then miss and a later put may succeed, but a get must
still return the latest value written: an older value or one never written is a violation.

Algorithm: the depth-first search of Wing & Gong with Lowe's memoisation, per key. Operations with
a known outcome are call and return events in a doubly linked list ordered by time; the search
repeatedly linearizes a pending call that comes before the first pending return, remembers every
(set of linearized operations, model state) it has entered so that no configuration is explored
twice, and backtracks when every such call has been tried.

Unknown-outcome operations are kept out of that list. Any linearization can be rewritten so that
an unknown operation only takes effect immediately before a known operation that would be
impossible without it (otherwise it can be moved later past that operation, or dropped), and then
at most two of them are needed: a write of the value the next operation needs, preceded by a
remove when a put must find the key absent. So the search only tries unknown operations as such
short "bridges", which keeps never-applied timeouts from multiplying the search. Spontaneous loss
is handled the same way, as a bridge that needs no operation.

Reductions that keep the search small, each exact (no false verdict):
- a pending read (get, exists, a put or remove that changed nothing) that is possible in the
  current state is linearized at once, without branching: it commutes with everything else;
- a configuration is abandoned as soon as some pending operation can never be linearized (a get
  whose value is overwritten; an operation needing the key absent, or present, with no remove,
  or write, left that was invoked before it completed), not only when its return is reached;
- unknown reads are dropped (they change nothing and promise nothing), and values no get ever
  returned are folded into one "present, unread" state, since nothing can tell them apart;
- a configuration that has used up more unknown operations than an explored one with the same
  linearized operations and state is not explored again.
Moves that need unknown operations are tried after all the others, as they are rarely right.

Cost, measured on a shared 2-core VM: 100k operations from 32 clients on 16 keys with 2% unknown
outcomes take about 0.6-1 s (5-10 us per operation); 100k operations of 32 clients on one single
key about 4-7 s. Adversarial histories (hundreds of mutually concurrent writes of values read
back in a different order) are exponential, which is what the time budget is for.
"""

from __future__ import annotations

import bisect
import gc
import time
from dataclasses import dataclass, field
from typing import Iterable

KINDS = ("put", "upsert", "get", "remove", "exists")
_WRITES = ("put", "upsert", "remove")  # the kinds that may change the state


@dataclass(frozen=True)
class Operation:
    client: int
    kind: str            # "put" | "upsert" | "get" | "remove" | "exists"
    key: str
    value: object = None  # put/upsert: the value id written (unique per write)
    result: object = None
    invoke_ns: int = 0
    complete_ns: int | None = None  # None: unknown outcome


@dataclass
class CheckResult:
    ok: bool                 # no violation found (see timed_out_keys: those keys are unproven)
    checked_keys: int
    operations: int
    failed_key: str | None = None
    explanation: str = ""
    timed_out_keys: list[str] = field(default_factory=list)

    @property
    def conclusive(self) -> bool:
        """True when the verdict covers every key (a failure is always conclusive)."""
        return not self.ok or not self.timed_out_keys


class _Token:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_ABSENT = _Token("absent")
_UNREAD = _Token("present, holding a value no get returned")
_KEEP = _Token("keep")  # an operation's effect: the state does not change

# What an operation needs from the state before it.
_ANY, _NEED_ABSENT, _NEED_PRESENT, _NEED_VALUE, _NEVER = range(5)

# How much work (about a microsecond each) between two looks at the clock.
_CLOCK_EVERY = 1000
# How many linearized operations the failure explanation shows before the point of failure.
_CONTEXT = 8


def check(history: Iterable[Operation], *, allow_spontaneous_loss: bool = False,
          time_budget_s: float = 10.0) -> CheckResult:
    """Check `history` per key; stop at the first key that has no linearization.

    `time_budget_s` bounds the whole check. Keys are checked smallest first, each with an equal
    share of the time still left, so one pathological key cannot starve the others; a key that
    runs out of its share is listed in `timed_out_keys` (inconclusive), not reported as failed.
    """
    by_key: dict[str, list[Operation]] = {}
    count = 0
    for op in history:
        _validate(op)
        by_key.setdefault(op.key, []).append(op)
        count += 1
    keys = sorted(by_key, key=lambda k: len(by_key[k]))
    end = time.monotonic() + time_budget_s
    timed_out: list[str] = []
    # The search allocates many small tuples and no cycles; the cyclic collector would only
    # rescan them (and the whole history) over and over: about 20% of the time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for done, key in enumerate(keys):
            now = time.monotonic()
            deadline = now + max(0.0, end - now) / (len(keys) - done)
            verdict = _KeySearch(key, by_key[key], allow_spontaneous_loss).run(deadline)
            if verdict is None:
                timed_out.append(key)
            elif verdict is not True:
                return CheckResult(False, done + 1, count, key, verdict, timed_out)
    finally:
        if collecting:
            gc.enable()
    return CheckResult(True, len(keys), count, timed_out_keys=timed_out)


def _validate(op: Operation) -> None:
    if op.kind not in KINDS:
        raise ValueError(f"unknown operation kind {op.kind!r} in {op!r}")
    if op.complete_ns is not None and op.complete_ns < op.invoke_ns:
        raise ValueError(f"operation completes before it is invoked: {op!r}")
    if op.kind in ("put", "upsert") and op.value is None:
        raise ValueError(f"a write needs a value id: {op!r}")


def format_operation(op: Operation) -> str:
    args = repr(op.key) if op.kind not in ("put", "upsert") else f"{op.key!r}, {op.value!r}"
    if op.complete_ns is None:
        return f"client {op.client} {op.kind}({args}) -> ?  [{op.invoke_ns} .. no reply]"
    return (f"client {op.client} {op.kind}({args}) -> {op.result!r}"
            f"  [{op.invoke_ns} .. {op.complete_ns}]")


class _KeySearch:
    """The search over one key's operations."""

    def __init__(self, key: str, ops: list[Operation], allow_loss: bool):
        self.key = key
        self.allow_loss = allow_loss
        self.total = len(ops)
        known = [op for op in ops if op.complete_ns is not None]
        known.sort(key=lambda op: op.invoke_ns)
        self.known = known
        self.unknown_count = len(ops) - len(known)
        # An unknown read neither changed anything nor promised a result: nothing to check.
        unknown = [op for op in ops if op.complete_ns is None and op.kind in _WRITES]
        unknown.sort(key=lambda op: op.invoke_ns)
        self.unknown = unknown
        observed = {op.result for op in known if op.kind == "get"}
        observed.discard(None)
        n = len(known)

        # Per known operation: what it needs (req, reqv), the state after it (post), whether it
        # leaves the state as it is (is_read), and whether it is a remove that empties the key
        # (supplier 1) or a write that fills it (supplier 2).
        req, reqv, post = [_NEVER] * n, [None] * n, [_KEEP] * n
        is_read, supplier = [False] * n, [0] * n
        removes, writes = [], []  # invocation times of those removes and writes
        known_writers: dict[object, list[int]] = {}
        for i, op in enumerate(known):
            kind, res = op.kind, op.result
            if kind == "get":
                if res is None:
                    req[i] = _NEED_ABSENT
                else:
                    req[i], reqv[i] = _NEED_VALUE, res
                is_read[i] = True
            elif kind == "exists":
                if res is True or res is False:
                    req[i] = _NEED_PRESENT if res else _NEED_ABSENT
                    is_read[i] = True
            elif kind == "remove":
                if res is True:
                    req[i], post[i], supplier[i] = _NEED_PRESENT, _ABSENT, 1
                    removes.append(op.invoke_ns)
                elif res is False:  # found nothing: a read of absence
                    req[i], post[i], is_read[i] = _NEED_ABSENT, _ABSENT, True
            elif res is True and (kind == "upsert" or kind == "put"):
                req[i] = _ANY if kind == "upsert" else _NEED_ABSENT
                post[i] = op.value if op.value in observed else _UNREAD
                supplier[i] = 2
                writes.append(op.invoke_ns)
                known_writers.setdefault(op.value, []).append(i)
            elif res is False and kind == "put":
                req[i], is_read[i] = _NEED_PRESENT, True
        removes.sort()
        writes.sort()
        self.req, self.reqv, self.post = req, reqv, post
        self.is_read, self.supplier = is_read, supplier

        # Unknown operations: bit j of a mask stands for unknown[j]. They are in invocation
        # order, so the ones invoked by some instant are the bits below some index.
        self.unknown_invokes = [op.invoke_ns for op in unknown]
        self.remove_bits = 0   # unknown removes
        self.unread_bits = 0   # unknown writes of values no get returned
        self.read_bits = 0     # unknown writes of values some get returned
        self.unknown_value: list[object] = []
        self.writes_of: dict[object, list[tuple[int, bool]]] = {}  # value -> (bit, is a put)
        for j, op in enumerate(unknown):
            bit = 1 << j
            if op.kind == "remove":
                self.unknown_value.append(None)
                self.remove_bits |= bit
            elif op.value in observed:
                self.unknown_value.append(op.value)
                self.read_bits |= bit
                self.writes_of.setdefault(op.value, []).append((bit, op.kind == "put"))
            else:
                self.unknown_value.append(_UNREAD)
                self.unread_bits |= bit

        # Facts that let the search give up on a configuration early, as soon as a pending
        # operation can never be linearized, instead of when its return is reached.
        # - A get of a value: the one write of it, known (writer: index; -1 none; -2 several,
        #   so never prune) and unknown (unknown_writer: bit; 0 none). A write invoked after the
        #   get completed does not count.
        # - An operation that needs the key absent (present): how many known removes (writes)
        #   are invoked by the time it completes (supply). Every operation linearized while it
        #   is pending is among those, so when as many removes (writes) are linearized, none is
        #   left for it (unless an unknown one invoked in time is).
        writer, unknown_writer, supply = [-1] * n, [0] * n, [0] * n
        bisect_right = bisect.bisect_right
        for i, op in enumerate(known):
            r, end = req[i], op.complete_ns
            if r == _NEED_ABSENT:
                supply[i] = bisect_right(removes, end)
            elif r == _NEED_PRESENT:
                supply[i] = bisect_right(writes, end)
            elif r == _NEED_VALUE:
                ws = [w for w in known_writers.get(op.result, ()) if known[w].invoke_ns <= end]
                us = [bit for bit, _ in self.writes_of.get(op.result, ())
                      if unknown[bit.bit_length() - 1].invoke_ns <= end]
                if len(ws) + len(us) > 1:
                    writer[i] = -2  # duplicated value ids: never prune on them
                else:
                    writer[i] = ws[0] if ws else -1
                    unknown_writer[i] = us[0] if us else 0
        self.writer, self.unknown_writer, self.supply = writer, unknown_writer, supply

        # The event list: entry 0 is the head, the last entry the tail; calls sort before returns
        # at the same instant, so touching intervals count as concurrent (the lenient reading).
        # Event e < n is the call of operation e, event n + i its return; sorted on an int key
        # (time, then calls first), which is much quicker than sorting tuples.
        times = [op.invoke_ns * 2 for op in known] + [op.complete_ns * 2 + 1 for op in known]
        order = sorted(range(2 * n), key=times.__getitem__)
        size = 2 * n + 2
        self.tail = size - 1
        self.nxt = list(range(1, size + 1))
        self.prv = list(range(-1, size - 1))
        self.ev_op = [0] + [e if e < n else e - n for e in order] + [0]
        self.ev_call = [False] + [e < n for e in order] + [False]
        self.ev_time = [0] + [times[e] >> 1 for e in order] + [0]
        self.call_entry, self.ret_entry = [0] * n, [0] * n
        for pos, e in enumerate(order, 1):
            if e < n:
                self.call_entry[e] = pos
            else:
                self.ret_entry[e - n] = pos
        self.deepest = None
        self.deepest_depth = -1

    # -- unknown operations as bridges ---------------------------------------------------------

    def _bridges(self, i: int, state, consumed: int, limit: int) -> list[tuple[object, int]]:
        """Ways to make known operation i possible when it is not possible in `state`: a list of
        (state just before i, bits of the unknown operations used). Only unknown operations
        invoked by `limit`, the completion time of the first pending return, may be used."""
        req = self.req[i]
        if req == _NEVER:
            return []
        free = ~consumed & ((1 << bisect.bisect_right(self.unknown_invokes, limit)) - 1)
        # Unknown removes are interchangeable (no value, and along a search path the available
        # set only grows), so the lowest free one is as good as any; so are unread writes.
        removes = free & self.remove_bits
        remove = removes & -removes
        if req == _NEED_ABSENT:
            if self.allow_loss:
                return [(_ABSENT, 0)]
            return [(_ABSENT, remove)] if remove else []
        out = []
        if req == _NEED_PRESENT:  # the key is absent: any unknown write fills it
            unread = free & self.unread_bits
            if unread:
                out.append((_UNREAD, unread & -unread))
            read = free & self.read_bits
            while read:
                bit = read & -read
                read ^= bit
                out.append((self.unknown_value[bit.bit_length() - 1], bit))
            return out
        # _NEED_VALUE: only an unknown write of that very value can supply it.
        want = self.reqv[i]
        for bit, is_put in self.writes_of.get(want, ()):
            if not free & bit:
                continue
            if not is_put or state is _ABSENT or self.allow_loss:
                out.append((want, bit))
            elif remove:  # a put only writes an absent key: an unknown remove must come first
                out.append((want, bit | remove))
        return out

    # -- the search ----------------------------------------------------------------------------

    def run(self, deadline: float):
        """True when linearizable, None on timeout, else the failure explanation."""
        nxt, prv, ev_call, ev_op = self.nxt, self.prv, self.ev_call, self.ev_op
        ev_time = self.ev_time
        call_entry, ret_entry = self.call_entry, self.ret_entry
        req, reqv, post, is_read = self.req, self.reqv, self.post, self.is_read
        writer, unknown_writer = self.writer, self.unknown_writer
        supplier, supply, unknown_invokes = self.supplier, self.supply, self.unknown_invokes
        bisect_right = bisect.bisect_right
        remove_bits, write_bits = self.remove_bits, self.unread_bits | self.read_bits
        allow_loss = self.allow_loss
        # Linearized known operations that are removes emptying the key ([1]) and writes ([2]).
        supplied = [0, 0, 0]
        tail = self.tail
        ABSENT, KEEP = _ABSENT, _KEEP
        ANY, NEED_ABSENT, NEED_PRESENT, NEED_VALUE = _ANY, _NEED_ABSENT, _NEED_PRESENT, _NEED_VALUE
        clock = time.monotonic

        # The set of linearized operations, for the memo table: all operations before index
        # `base` (in invocation order) plus the bits of `rel` from there. Operations are mostly
        # linearized in about invocation order, so `rel` stays short however long the history.
        # `lin` holds the same set, quick to test.
        lin = bytearray(len(self.known))
        # Memo table: (base, rel, state) -> the `consumed` masks it was entered with (an int for
        # one, a list for several). A configuration that has used up a superset of the unknown
        # operations of an explored one, with the same linearized set and state, can do nothing
        # more than it: it fails too.
        seen: dict = {}

        def explored(memo, cons) -> bool:
            """Whether this configuration is covered by an explored one; if not, record it."""
            prev = seen.get(memo)
            if prev is None:
                seen[memo] = cons
                return False
            if type(prev) is int:
                if not prev & ~cons:
                    return True
                seen[memo] = [prev, cons]
                return False
            for mask in prev:
                if not mask & ~cons:
                    return True
            prev.append(cons)
            return False

        # One frame per linearized operation, with what is needed to resume after it:
        # (op, candidates, position in them, option, limit, state, consumed, base, rel).
        stack: list[tuple] = []
        state, consumed, base, rel = ABSENT, 0, 0, 0
        cands: list[int] = []
        pos = k = limit = 0
        fresh, dead = True, False
        steps, next_look = 0, _CLOCK_EVERY  # steps: a measure of work done
        while True:
            steps += 1
            if steps >= next_look:
                next_look = steps + _CLOCK_EVERY
                if clock() > deadline:
                    return None

            if dead:
                if not stack:
                    return self._explain()
                i, cands, pos, k, limit, state, consumed, base, rel = stack.pop()
                # Put the operation back, in the reverse order of lifting it out.
                lin[i] = 0
                supplied[supplier[i]] -= 1
                c, t = call_entry[i], ret_entry[i]
                nxt[prv[t]] = t
                prv[nxt[t]] = t
                nxt[prv[c]] = c
                prv[nxt[c]] = c
                if pos < 0:
                    continue  # a forced move failed: so does the configuration before it
                dead = False
                k += 1

            elif fresh:
                # A new configuration: collect the candidates, the calls before the first
                # pending return.
                fresh = False
                f = nxt[0]
                if f == tail:
                    return True
                window = []
                forced = doomed = -1
                while ev_call[f]:
                    i = ev_op[f]
                    r = req[i]
                    if r == NEED_VALUE:
                        if state == reqv[i]:
                            forced = i
                            break
                        # Its value can never come back (the write of it is linearized and
                        # overwritten, or there is none in time).
                        w, wbit = writer[i], unknown_writer[i]
                        if (w == -1 or (w >= 0 and lin[w])) and (not wbit or consumed & wbit):
                            doomed = i
                            break
                    elif r == NEED_ABSENT:
                        if state is ABSENT:
                            if is_read[i]:
                                forced = i
                                break
                        elif (not allow_loss and supply[i] == supplied[1] and not (
                                remove_bits & ~consumed & ((1 << bisect_right(
                                    unknown_invokes, ev_time[ret_entry[i]])) - 1))):
                            doomed = i  # no remove left that could empty the key in time
                            break
                    elif r == NEED_PRESENT:
                        if state is not ABSENT:
                            if is_read[i]:
                                forced = i
                                break
                        elif supply[i] == supplied[2] and not (
                                write_bits & ~consumed & ((1 << bisect_right(
                                    unknown_invokes, ev_time[ret_entry[i]])) - 1)):
                            doomed = i  # no write left that could fill the key in time
                            break
                    window.append(i)
                    f = nxt[f]
                steps += len(window)
                if doomed >= 0:
                    if len(stack) > self.deepest_depth:
                        self._remember(stack, state, consumed, doomed, True)
                    dead = True
                    continue
                if forced >= 0:
                    # A read (no state change) that is possible now can be linearized first
                    # without loss of generality: it commutes with whatever the other pending
                    # operations do before it. No branching: concurrent reads cost nothing.
                    i = forced
                    nbase, nrel = base, rel | (1 << (i - base))
                    if i == base:  # shift the run of linearized operations into base
                        t = (~nrel & (nrel + 1)).bit_length() - 1
                        nbase, nrel = base + t, nrel >> t
                    if explored((nbase, nrel, state), consumed):
                        dead = True
                        continue
                    stack.append((i, None, -1, 0, 0, state, consumed, base, rel))
                    base, rel = nbase, nrel
                    lin[i] = 1
                    supplied[supplier[i]] += 1
                    c, t = call_entry[i], ret_entry[i]
                    nxt[prv[c]] = nxt[c]
                    prv[nxt[c]] = prv[c]
                    nxt[prv[t]] = nxt[t]
                    prv[nxt[t]] = prv[t]
                    fresh = True
                    continue
                # Candidates are tried in invocation order (tried: by completion or by midpoint
                # is no better).
                cands, pos, k, limit = window, 0, 0, ev_time[f]

            # Branch: option k of candidate pos, then the following ones. Positions past the
            # candidates come back to them for the moves that need unknown operations: those are
            # tried last, as they are rarely right.
            m = len(cands)
            while pos < 2 * m:
                i = cands[pos] if pos < m else cands[pos - m]
                r = req[i]
                if (r == ANY or (r == NEED_ABSENT and state is ABSENT)
                        or (r == NEED_PRESENT and state is not ABSENT)
                        or (r == NEED_VALUE and state == reqv[i])):
                    options = ((state, 0),) if pos < m else ()
                else:
                    options = () if pos < m else self._bridges(i, state, consumed, limit)
                p = post[i]
                nbase, nrel = base, rel | (1 << (i - base))
                if i == base:
                    t = (~nrel & (nrel + 1)).bit_length() - 1
                    nbase, nrel = base + t, nrel >> t
                while k < len(options):
                    before, used = options[k]
                    nstate = before if p is KEEP else p
                    ncons = consumed | used
                    if not explored((nbase, nrel, nstate), ncons):
                        stack.append((i, cands, pos, k, limit, state, consumed, base, rel))
                        state, consumed, base, rel = nstate, ncons, nbase, nrel
                        lin[i] = 1
                        supplied[supplier[i]] += 1
                        c, t = call_entry[i], ret_entry[i]
                        nxt[prv[c]] = nxt[c]
                        prv[nxt[c]] = prv[c]
                        nxt[prv[t]] = nxt[t]
                        prv[nxt[t]] = prv[t]
                        fresh = True
                        break
                    k += 1
                if fresh:
                    break
                pos, k = pos + 1, 0
            else:
                # Every candidate tried: the first pending return (cands[0]'s) cannot be met.
                if len(stack) > self.deepest_depth:
                    self._remember(stack, state, consumed, cands[0], False, cands, limit)
                dead = True

    # -- explanation ---------------------------------------------------------------------------

    def _remember(self, stack, state, consumed: int, blocked: int, doomed: bool,
                  window: list[int] | None = None, limit: int = 0) -> None:
        """Keep the deepest dead end: the tail of its linearization, the operation that could
        not be linearized, and the other candidates."""
        tail_frames = stack[-_CONTEXT:]
        path = []
        for n, frame in enumerate(tail_frames):
            before = frame[6]
            after = tail_frames[n + 1][6] if n + 1 < len(tail_frames) else consumed
            path.append((frame[0], after & ~before))
        if window is None:
            window = []
            f = self.nxt[0]
            while self.ev_call[f]:
                window.append(self.ev_op[f])
                f = self.nxt[f]
            limit = self.ev_time[f]
        self.deepest_depth = len(stack)
        self.deepest = (len(stack), path, state, consumed, blocked, doomed, list(window), limit)

    def _explain(self) -> str:
        depth, path, state, consumed, blocked, doomed, window, limit = self.deepest
        known, unknown = self.known, self.unknown
        lines = [f"key {self.key!r}: no linearization of its {self.total} operation(s)"
                 f" ({self.unknown_count} of unknown outcome"
                 f"{', spontaneous loss allowed' if self.allow_loss else ''})."]
        if depth:
            lines.append(f"Deepest attempt: {depth} operation(s) linearized; the last ones,"
                         " in order:")
            if depth > len(path):
                lines.append("  ...")
            for i, used in path:
                for j, op in enumerate(unknown):
                    if used >> j & 1:
                        lines.append(f"  {format_operation(op)}   (assumed to take effect here)")
                lines.append(f"  {format_operation(known[i])}")
            if state is _UNREAD:  # name the value: the last write in the path shown
                shown = []
                for i, used in path:
                    shown += [op for j, op in enumerate(unknown) if used >> j & 1]
                    if self.post[i] is not _KEEP:
                        shown.append(known[i])
                if shown and shown[-1].kind in ("put", "upsert"):
                    state = shown[-1].value
            lines.append(f"The key is then {_describe(state)}.")
        else:
            lines.append("Nothing can be linearized first; the key starts absent.")
        if doomed:
            r = self.req[blocked]
            why = (f"the write of {self.reqv[blocked]!r} is already overwritten, or there is"
                   " none invoked before it completed" if r == _NEED_VALUE else
                   f"it needs the key {'absent' if r == _NEED_ABSENT else 'present'} and no"
                   f" {'remove' if r == _NEED_ABSENT else 'write'} invoked before it completed"
                   " is left")
            lines.append(f"{format_operation(known[blocked])} can no longer be linearized:"
                         f" {why}. Pending operations:")
        else:
            lines.append(f"{format_operation(known[blocked])} has completed by then, but no"
                         " pending operation can be linearized next:")
        for i in window:
            op = known[i]
            options = [(state, 0)] if self._possible(i, state) else \
                self._bridges(i, state, consumed, limit)
            if options:
                why = "possible here, but every continuation fails"
            else:
                why = f"needs {self._need(i)}"
            lines.append(f"  {format_operation(op)}: {why}")
        return "\n".join(lines)

    def _possible(self, i: int, state) -> bool:
        r = self.req[i]
        return (r == _ANY or (r == _NEED_ABSENT and state is _ABSENT)
                or (r == _NEED_PRESENT and state is not _ABSENT)
                or (r == _NEED_VALUE and state == self.reqv[i]))

    def _need(self, i: int) -> str:
        r, op = self.req[i], self.known[i]
        if r == _NEED_ABSENT:
            return "the key absent"
        if r == _NEED_PRESENT:
            return "the key present"
        if r == _NEED_VALUE:
            return f"the key holding {self.reqv[i]!r}, and no write of it can take effect here"
        return f"nothing: {op.result!r} is not a possible result of {op.kind}"


def _describe(state) -> str:
    if state is _ABSENT:
        return "absent"
    if state is _UNREAD:
        return repr(state)
    return f"holding {state!r}"
