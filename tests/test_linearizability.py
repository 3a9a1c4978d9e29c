"""Tests for the linearizability checker (mooncaked.checks.linearizability)."""

from __future__ import annotations

import random

import pytest

from mooncaked.checks.linearizability import CheckResult, Operation, check

K = "k"


def op(client, kind, result=None, t0=0, t1=None, value=None, key=K):
    return Operation(client, kind, key, value, result, t0, t1)


# -- reference model and generators -----------------------------------------------------------

class Model:
    """The sequential object model, one dict for all keys."""

    def __init__(self):
        self.data = {}

    def apply(self, kind, key, value=None):
        if kind == "put":
            if key in self.data:
                return False
            self.data[key] = value
            return True
        if kind == "upsert":
            self.data[key] = value
            return True
        if kind == "get":
            return self.data.get(key)
        if kind == "remove":
            return self.data.pop(key, None) is not None
        if kind == "exists":
            return key in self.data
        raise AssertionError(kind)


KIND_WEIGHTS = (("get", 40), ("put", 20), ("upsert", 12), ("remove", 10), ("exists", 18))


def generate(rng, n_ops, n_clients, keys, p_unknown=0.0, p_loss=0.0):
    """A history produced by the real model: each operation takes effect at a random instant
    inside its interval (unknown ones: after invocation, or never), applied in that order."""
    kinds = [k for k, w in KIND_WEIGHTS for _ in range(w)]
    clocks = [rng.randrange(100) for _ in range(n_clients)]
    planned = []  # (effect time or None, index, client, kind, key, value, invoke, complete)
    for n in range(n_ops):
        c = n % n_clients
        kind = rng.choice(kinds)
        key = rng.choice(keys)
        value = n if kind in ("put", "upsert") else None
        invoke = clocks[c] + rng.randrange(1, 50)
        at = invoke + rng.randrange(0, 200)
        complete = at + rng.randrange(0, 200)
        if rng.random() < p_unknown:
            # Took effect, possibly long after the client gave up on it, or never.
            at = invoke + rng.randrange(0, 2000) if rng.random() < 0.5 else None
            complete = None
            clocks[c] = invoke + 300
        else:
            clocks[c] = complete
        planned.append((at, n, c, kind, key, value, invoke, complete))
    model = Model()
    losses = []
    if p_loss:
        horizon = max(clocks)
        losses = sorted((rng.randrange(horizon), -1, rng.choice(keys)) for _ in
                        range(int(p_loss * n_ops)))
    effects = sorted([p for p in planned if p[0] is not None] + losses)
    results = {}
    for e in effects:
        if e[1] == -1:
            model.data.pop(e[2], None)
            continue
        at, n, c, kind, key, value, invoke, complete = e
        results[n] = model.apply(kind, key, value)
    return [Operation(c, kind, key, value, results.get(n) if complete is not None else None,
                      invoke, complete)
            for at, n, c, kind, key, value, invoke, complete in planned]


def brute_force(history, allow_loss):
    """Exhaustive search, no memo, no reductions: the definition, for small histories."""
    ops = list(history)
    model_absent = object()

    def step(o, state):
        """(ok, new state) for operation o against state, honouring its result if known."""
        known = o.complete_ns is not None
        present = state is not model_absent
        if o.kind == "get":
            res = None if not present else state
            return (not known or res == o.result), state
        if o.kind == "exists":
            return (not known or o.result is present), state
        if o.kind == "put":
            if known and o.result is not (not present):
                return False, state
            return True, (o.value if not present else state)
        if o.kind == "upsert":
            return (not known or o.result is True), o.value
        if o.kind == "remove":
            return (not known or o.result is present), model_absent
        raise AssertionError

    def rec(done, state, lost_ok):
        pending_known = [o for i, o in enumerate(ops)
                         if not done >> i & 1 and o.complete_ns is not None]
        if not pending_known:
            return True
        limit = min(o.complete_ns for o in pending_known)
        for i, o in enumerate(ops):
            if done >> i & 1 or o.invoke_ns > limit:
                continue
            ok, new = step(o, state)
            if ok and rec(done | 1 << i, new, True):
                return True
        # A loss; only once in a row (twice changes nothing).
        if allow_loss and lost_ok and state is not model_absent:
            return rec(done, model_absent, False)
        return False

    return rec(0, model_absent, True)


def random_small(rng):
    """A small random history on one key with random (often impossible) results."""
    n = rng.randrange(1, 8)
    kinds = [rng.choice(("put", "upsert", "get", "remove", "exists")) for _ in range(n)]
    written = [f"v{c}" for c, kind in enumerate(kinds) if kind in ("put", "upsert")]
    ops = []
    for c, kind in enumerate(kinds):
        t0 = rng.randrange(0, 40)
        t1 = None if rng.random() < 0.2 else t0 + rng.randrange(0, 25)
        value = f"v{c}" if kind in ("put", "upsert") else None
        if kind == "get":
            result = rng.choice(written + [None, "never-written"])
        elif kind == "upsert":
            result = True
        else:
            result = rng.random() < 0.5
        ops.append(op(c, kind, result, t0, t1, value))
    return ops


# -- hand-written histories ---------------------------------------------------------------------

def test_empty_history():
    r = check([])
    assert r.ok and r.checked_keys == 0 and r.operations == 0 and r.conclusive


def test_sequential_history():
    h = [
        op(1, "get", None, 0, 1),
        op(1, "exists", False, 2, 3),
        op(1, "put", True, 4, 5, "a"),
        op(2, "put", False, 6, 7, "b"),
        op(2, "get", "a", 8, 9),
        op(1, "exists", True, 10, 11),
        op(2, "upsert", True, 12, 13, "c"),
        op(1, "get", "c", 14, 15),
        op(1, "remove", True, 16, 17),
        op(2, "remove", False, 18, 19),
        op(2, "get", None, 20, 21),
        op(1, "put", True, 22, 23, "d"),
        op(1, "get", "d", 24, 25),
    ]
    r = check(h)
    assert r == CheckResult(True, 1, len(h))


@pytest.mark.parametrize("seen", ["a", None])
def test_concurrent_put_and_get_either_order(seen):
    h = [op(1, "put", True, 0, 10, "a"), op(2, "get", seen, 1, 9)]
    assert check(h).ok


def test_stale_read_fails():
    h = [
        op(1, "put", True, 0, 1, "a"),
        op(1, "upsert", True, 2, 3, "b"),
        op(2, "get", "a", 4, 5),
    ]
    r = check(h)
    assert not r.ok and r.failed_key == K
    # Loss does not excuse an older value coming back.
    assert not check(h, allow_spontaneous_loss=True).ok


def test_lost_acknowledged_put():
    h = [op(1, "put", True, 0, 1, "a"), op(2, "get", None, 2, 3)]
    assert not check(h).ok
    assert check(h, allow_spontaneous_loss=True).ok
    # After a loss, a new put succeeds.
    h2 = h + [op(2, "put", True, 4, 5, "b"), op(1, "get", "b", 6, 7)]
    assert not check(h2).ok
    assert check(h2, allow_spontaneous_loss=True).ok


def test_resurrection_fails_even_with_loss():
    h = [
        op(1, "put", True, 0, 1, "a"),
        op(1, "remove", True, 2, 3),
        op(2, "get", "a", 4, 5),
    ]
    assert not check(h).ok
    assert not check(h, allow_spontaneous_loss=True).ok


def test_two_successful_puts_fail():
    h = [op(1, "put", True, 0, 1, "a"), op(2, "put", True, 2, 3, "b")]
    assert not check(h).ok
    # Concurrent puts both succeeding are just as wrong.
    h = [op(1, "put", True, 0, 10, "a"), op(2, "put", True, 1, 9, "b")]
    assert not check(h).ok
    # With a remove in between it is fine.
    h = [op(1, "put", True, 0, 1, "a"), op(3, "remove", True, 2, 3),
         op(2, "put", True, 4, 5, "b")]
    assert check(h).ok


def test_unknown_put_observed_later():
    h = [op(1, "put", None, 0, None, "a"), op(2, "get", None, 5, 6),
         op(2, "get", "a", 100, 101), op(2, "put", False, 102, 103, "b")]
    assert check(h).ok


def test_unknown_put_never_observed():
    h = [op(1, "put", None, 0, None, "a"), op(2, "get", None, 5, 6),
         op(2, "exists", False, 100, 101), op(2, "put", True, 102, 103, "b"),
         op(2, "get", "b", 104, 105)]
    assert check(h).ok


def test_unknown_put_takes_effect_after_a_remove():
    # The unknown put may land late, after a remove, even though the key was full when invoked.
    h = [op(1, "put", True, 0, 1, "a"), op(2, "put", None, 2, None, "b"),
         op(1, "remove", True, 3, 4), op(1, "get", "b", 5, 6)]
    assert check(h).ok


def test_unknown_put_cannot_take_effect_before_its_invocation():
    h = [op(2, "get", "a", 0, 1), op(1, "put", None, 5, None, "a")]
    assert not check(h).ok


def test_unknown_remove_then_put():
    # get b needs the unknown remove and then the known put to land inside the put's window.
    h = [op(1, "put", True, 0, 1, "a"), op(2, "remove", None, 2, None),
         op(3, "put", True, 3, 10, "b"), op(1, "get", "b", 11, 12)]
    assert check(h).ok
    assert not check([h[0], h[2], h[3]]).ok


def test_get_of_value_never_written_fails():
    h = [op(1, "put", True, 0, 1, "a"), op(2, "get", "zzz", 2, 3)]
    r = check(h, allow_spontaneous_loss=True)
    assert not r.ok


def test_duplicate_value_ids_are_matched_by_value():
    h = [op(1, "upsert", True, 0, 1, "a"), op(1, "upsert", True, 2, 3, "b"),
         op(1, "upsert", True, 4, 5, "a"), op(2, "get", "a", 6, 7)]
    assert check(h).ok
    assert not check(h[:2] + [h[3]]).ok


def test_unknown_remove_explains_a_miss():
    h = [op(1, "put", True, 0, 1, "a"), op(2, "remove", None, 2, None),
         op(1, "get", None, 5, 6), op(1, "put", True, 7, 8, "b")]
    assert check(h).ok
    # But not before it was invoked.
    h = [op(1, "put", True, 0, 1, "a"), op(1, "get", None, 2, 3),
         op(2, "remove", None, 4, None)]
    assert not check(h).ok


def test_upsert_must_return_true():
    assert not check([op(1, "upsert", False, 0, 1, "a")]).ok


def test_keys_are_independent():
    h = [op(1, "put", True, 0, 1, "a", key="x"), op(2, "put", True, 0, 1, "b", key="y"),
         op(1, "get", "a", 2, 3, key="x"), op(2, "get", "b", 2, 3, key="y")]
    r = check(h)
    assert r.ok and r.checked_keys == 2 and r.operations == 4


def test_explanation_names_key_and_operations():
    h = [
        op(1, "put", True, 0, 1, "a", key="obj/7"),
        op(1, "upsert", True, 2, 3, "b", key="obj/7"),
        op(4, "get", "a", 4, 5, key="obj/7"),
        op(1, "get", "q", 0, 1, key="other"),
    ]
    r = check(h[:3] + [op(1, "get", None, 0, 1, key="other")])
    assert not r.ok and r.failed_key == "obj/7"
    text = r.explanation
    assert "'obj/7'" in text
    assert "client 4 get('obj/7') -> 'a'" in text
    assert "upsert('obj/7', 'b') -> True" in text
    assert "holding 'b'" in text or "value no get returned" in text


def test_invalid_operations_raise():
    with pytest.raises(ValueError):
        check([op(1, "frobnicate", None, 0, 1)])
    with pytest.raises(ValueError):
        check([op(1, "get", None, 5, 1)])
    with pytest.raises(ValueError):
        check([op(1, "put", True, 0, 1, None)])


def test_time_budget_is_inconclusive_not_failed():
    rng = random.Random(7)
    h = generate(rng, 20000, 16, ["a"], p_unknown=0.02)
    r = check(h, time_budget_s=0.0)
    assert r.ok and r.timed_out_keys == ["a"] and not r.conclusive


# -- randomized -------------------------------------------------------------------------------

def test_matches_brute_force_on_small_histories():
    rng = random.Random(1234)
    verdicts = {True: 0, False: 0}
    for _ in range(3000):
        h = random_small(rng)
        loss = rng.random() < 0.3
        expected = brute_force(h, loss)
        got = check(h, allow_spontaneous_loss=loss)
        assert got.ok == expected, (loss, h, got.explanation)
        verdicts[expected] += 1
    # Both verdicts are well exercised.
    assert min(verdicts.values()) > 300


def test_model_generated_histories_pass():
    rng = random.Random(42)
    for trial in range(30):
        loss = trial % 3 == 0
        h = generate(rng, 600, rng.randrange(2, 9), ["a", "b", "c"], p_unknown=0.05,
                     p_loss=0.02 if loss else 0.0)
        r = check(h, allow_spontaneous_loss=loss)
        assert r.ok and r.conclusive, r.explanation


def test_hot_key_history_passes():
    # 32 clients on one key: every operation overlaps about 30 others.
    rng = random.Random(8)
    h = generate(rng, 4000, 32, ["hot"], p_unknown=0.02)
    r = check(h, time_budget_s=60)
    assert r.ok and r.conclusive, r.explanation


def test_corrupted_read_fails():
    rng = random.Random(99)
    stale_detected = 0
    for trial in range(30):
        h = generate(rng, 400, 4, ["a", "b"], p_unknown=0.03)
        assert check(h).ok
        reads = [i for i, o in enumerate(h)
                 if o.kind == "get" and o.result is not None and o.complete_ns is not None]
        i = rng.choice(reads)
        o = h[i]
        # A value never written: always detectable, with or without loss.
        bad = h[:i] + [Operation(o.client, "get", o.key, None, "never-written", o.invoke_ns,
                                 o.complete_ns)] + h[i + 1:]
        r = check(bad, allow_spontaneous_loss=True)
        assert not r.ok and r.failed_key == o.key
        # An older value of the same key: detectable unless concurrency excuses it.
        older = [x.value for x in h[:i] if x.key == o.key and x.kind in ("put", "upsert")
                 and x.complete_ns is not None and x.complete_ns < o.invoke_ns
                 and x.value != o.result and x.result]
        if older:
            stale = h[:i] + [Operation(o.client, "get", o.key, None, older[0], o.invoke_ns,
                                       o.complete_ns)] + h[i + 1:]
            stale_detected += not check(stale).ok
    assert stale_detected >= 15


def test_large_history():
    # 100k operations, 32 clients, 16 keys, 2% unknown outcome (timing is reported by the
    # benchmark in the module's report, not asserted here).
    rng = random.Random(5)
    h = generate(rng, 100_000, 32, [f"key{i}" for i in range(16)], p_unknown=0.02)
    r = check(h, time_budget_s=60)
    assert r.ok and r.conclusive and r.operations == 100_000 and r.checked_keys == 16


# -- histories of the store's own state machine: concurrent upserts, puts, removes ------------

def _store_history(seed: int, with_removes: bool, with_expiry: bool):
    """Clients' operations on one key run against the real Master and state machine, each
    write split into its PutStart and PutEnd with other clients' steps in between; returns
    the history and the number of upserts that failed."""
    from mooncaked.errors import MooncakedError
    from mooncaked.meta.master import ReplicateConfig
    from test_state_machine import new_master

    rng = random.Random(seed)
    master = new_master()  # release timeout 1000 ms
    key = ("ns", K)
    history, writing = [], {}  # writing: client -> (kind, value, invoke time)
    failed_upserts = 0
    now = 0
    values = iter(range(1, 10 ** 9))
    for _ in range(120):
        now += 1500 if with_expiry and rng.random() < 0.03 else 1
        client = rng.randrange(5)
        if client in writing:
            kind, value, t0 = writing.pop(client)
            try:
                master.put_end(key, client, now)
                history.append(op(client, kind, True, t0, now, value))
            except MooncakedError:
                # Nothing readable ever held the value: recorded as unknown, which is sound.
                history.append(op(client, kind, None, t0, None, value))
                failed_upserts += kind == "upsert"
            continue
        roll = rng.random()
        if roll < 0.5:
            kind = "upsert" if rng.random() < 0.8 else "put"
            value = next(values)
            try:
                master.put_start(key, 100, ReplicateConfig(), kind == "upsert", client, now)
            except MooncakedError:
                assert kind == "put"
                if master.state.readable(key) is not None:
                    history.append(op(client, "put", False, now, now, value))
                # else it found the key being written: a refusal outside the model, which
                # changed nothing, so it is left out
                continue
            writing[client] = (kind, value, now)
        elif roll < 0.6 and with_removes:
            try:
                master.remove(key, True, now)
                history.append(op(client, "remove", True, now, now))
            except MooncakedError:
                if master.state.objects.get(key) is None:
                    history.append(op(client, "remove", False, now, now))
        else:
            version = master.get(key, now)
            history.append(op(client, "get", None if version is None else
                              _value_of(history, version), now, now))
        if with_expiry:
            master.tick(now)
    return history, failed_upserts


def _value_of(history, version):
    """The value id of the write that made `version` readable: the state machine keeps the
    writer id and start time; the test's writers are identified by (client, invoke time)."""
    for item in reversed(history):
        if item.kind in ("put", "upsert") and item.client == version.writer_id \
                and item.invoke_ns <= version.started_ms and item.value is not None \
                and item.result is not False:
            return item.value
    raise AssertionError("a readable version nobody wrote")


@pytest.mark.parametrize("seed", range(40))
def test_concurrent_upserts_of_the_store_are_linearizable_and_succeed(seed):
    history, failed = _store_history(seed, with_removes=False, with_expiry=False)
    result = check(history)
    assert result.ok, result.explanation
    assert failed == 0  # without removes or expiry, every upsert succeeds


@pytest.mark.parametrize("seed", range(40))
def test_store_histories_with_removes_and_expiry_are_linearizable(seed):
    history, _ = _store_history(seed, with_removes=True, with_expiry=True)
    result = check(history)
    assert result.ok, result.explanation
