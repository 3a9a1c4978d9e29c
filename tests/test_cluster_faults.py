"""Fault tests on a 3-node cluster of real daemons, with a recorded and checked history.

Each test runs client threads (tests/cluster_workload.py) while it injects one fault: kill -9
of the leader, SIGSTOP of the leader, network partitions (nftables, tests/cluster_harness.py),
a node killed in the middle of a put, a node declared down and back. What every test checks:

- every get returned exactly one written value of its key, or a miss, or an error: never
  partial, corrupt or another key's bytes (checked on each get, the test stops at the first);
- after healing and a final read of every key through every live node, the history is
  linearizable (mooncaked/checks/linearizability.py); spontaneous loss is allowed only for keys
  whose one replica was on a node that was declared down;
- no answer carried an error code that only a bug produces.

The timings are the harness's (elections in 0.5-1 s, node_ttl 3 s, put discard timeout 2 s).
Measured figures (unavailability, time to a new leader) are printed: run with -s to see them.
The only time asserted is the unavailability bound after a leader crash or stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from cluster_harness import ELECTION_TIMEOUT_S, Cluster, Partition
from cluster_workload import (KINDS, LeaderMonitor, Prober, Recorder, Violation, Workload,
                              check_history, connect, logs_tail, read_all, stop_all)
from mooncaked.client.calls import ReplicateConfig
from mooncaked.errors import ErrorCode, MooncakedError, code_name
from mooncaked.meta import commands as c

NODES = (1, 2, 3)
UNAVAILABILITY_BOUND_S = 2 * ELECTION_TIMEOUT_S + 1  # the longest a client may see no leader
DISCARD_TIMEOUT_S = 2.0  # the harness's put_start_discard_timeout_ms
NODE_TTL_S = 3.0         # the harness's node_ttl_ms
TWO = ReplicateConfig(replica_num=2)


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(**overrides) -> Cluster:
        cluster = Cluster(3, **overrides)
        made.append(cluster)
        return cluster.start()

    yield make
    stop_all()
    for cluster in made:
        cluster.close()


@contextlib.contextmanager
def diagnosed(cluster: Cluster, recorder: Recorder, monitor: LeaderMonitor | None = None):
    """On a failure, add what the clients saw, the leadership changes and the nodes' logs."""
    try:
        yield
    except Exception as exc:
        parts = [f"{type(exc).__name__}: {exc}", f"operations: {recorder.counts()}"]
        if recorder.violations:
            parts.append("wrong bytes read:\n" + "\n".join(recorder.violations[:10]))
            for key in dict.fromkeys(recorder.violation_keys[:3]):
                parts.append(f"all calls on {key!r}:\n{recorder.key_story(key, last=80)}")
        if monitor is not None:
            parts.append("leadership as polled (changes):\n" + monitor.describe())
        parts.append(logs_tail(cluster))
        raise AssertionError("\n\n".join(parts)) from exc


def others(node: int) -> list[int]:
    return [i for i in NODES if i != node]


def alive_nodes(cluster: Cluster) -> list[int]:
    return [i for i in NODES if i in cluster.alive()]


def run_until_ok(recorder: Recorder, cluster: Cluster, node: int, kind: str, key: str,
                 size: int = 0, config: ReplicateConfig | None = None,
                 timeout_s: float = 20.0):
    """One operation through `node`, retried after definite failures and errors (each try is
    recorded); returns the record of the try that succeeded."""
    client_id = recorder.client_id()
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        client = connect(cluster, node)
        if client is not None:
            with client:
                last = recorder.run(client, client_id, node, kind, key, size, config)
            if last.outcome == "ok":
                return last
        time.sleep(0.2)
    raise AssertionError(f"{kind}({key!r}) through node {node} did not succeed within "
                         f"{timeout_s} s; last try: {last.describe() if last else 'no connection'}")


def finish(cluster: Cluster, workload: Workload | None, recorder: Recorder, *,
           strict_keys: list[str], loss_keys: list[str] = (),
           monitor: LeaderMonitor | None = None) -> None:
    """Stop the clients, wait for a leader, read every key through every live node, check."""
    if workload is not None:
        workload.stop()
    recorder.assert_no_violation()
    cluster.wait_for_leader(timeout_s=30)
    read_all(cluster, recorder, alive_nodes(cluster), [*strict_keys, *loss_keys])
    recorder.assert_no_violation()
    bugs = recorder.bug_codes()
    assert not bugs, "answers with a code only a bug gives:\n" + "\n".join(
        r.describe() for r in bugs[:10])
    result, message = check_history(recorder, strict_keys, allow_spontaneous_loss=False)
    assert result.ok, message
    assert not result.timed_out_keys, f"the checker ran out of time on {result.timed_out_keys}"
    if loss_keys:
        result, message = check_history(recorder, loss_keys, allow_spontaneous_loss=True)
        assert result.ok, message
        assert not result.timed_out_keys, f"checker timed out on {result.timed_out_keys}"
    if monitor is not None:
        monitor.stop()
        split = {term: nodes for term, nodes in monitor.leaders_per_term().items()
                 if len(nodes) > 1}
        assert not split, f"two leaders in one term: {split}\n{monitor.describe()}"
    print(f"\n  operations: {recorder.counts()}")


def report_unavailability(what: str, fault_ns: int, end_ns: int, recorder: Recorder,
                          prober: Prober, monitor: LeaderMonitor, majority: list[int],
                          extra: str) -> None:
    """Print the measured figures; assert the prober's gap (a client retrying with a short
    timeout) stays under the bound."""
    gap_s, gap_at_s = prober.longest_gap_s(fault_ns, end_ns)
    ops_gap_s = recorder.longest_gap_s(fault_ns, end_ns, KINDS)
    elected = monitor.first_leader_after(fault_ns, majority)
    print(f"  {what}: a new leader reported after "
          f"{(elected - fault_ns) / 1e9 if elected else float('nan'):.2f} s; longest gap "
          f"between successful metadata writes of a quickly retrying client {gap_s:.2f} s "
          f"(from {gap_at_s:.2f} s; bound {UNAVAILABILITY_BOUND_S:.1f} s); longest gap between "
          f"successful operations of the workload's clients {ops_gap_s:.2f} s; {extra}")
    assert gap_s < UNAVAILABILITY_BOUND_S, \
        f"{what}: no metadata write succeeded for {gap_s:.2f} s, from {gap_at_s:.2f} s after " \
        f"the fault\n{monitor.describe(fault_ns)}"


# -- 1. kill -9 the leader ------------------------------------------------------------------------

def test_leader_killed_under_load_then_restarted(make_cluster):
    cluster = make_cluster()
    leader = cluster.wait_for_leader()
    survivors = others(leader)
    recorder = Recorder()
    monitor = LeaderMonitor(cluster).start()
    strict = [f"a{i}" for i in range(6)]  # two replicas: one node's crash loses none
    loose = [f"b{i}" for i in range(3)]   # one replica: lost when its node goes
    durable = [f"d{i}" for i in range(8)]  # acknowledged before the crash, never written again
    workload = Workload(cluster, strict + loose, [1, 2, 3, 1, 2, 3], seed=11, recorder=recorder,
                        config_for=lambda key: TWO if key.startswith("a") else None)
    prober = Prober(cluster, NODES)
    with diagnosed(cluster, recorder, monitor):
        acked = {key: run_until_ok(recorder, cluster, survivors[0], "put", key, 64 << 10,
                                   TWO).value for key in durable}
        workload.start()
        prober.start()
        workload.sleep(2.0)
        kill_ns = time.monotonic_ns()
        cluster.nodes[leader].kill()
        workload.sleep(0.5)
        # Restarted well before node_ttl_ms (it takes 1-2 s to start): it comes back with empty
        # segments that the log still lists until it registers again.
        cluster.nodes[leader].start()
        restarted_ns = time.monotonic_ns()
        # Reads through it at once: it must not serve the emptied replicas.
        with connect(cluster, leader) as client:
            client_id = recorder.client_id()
            for key in durable * 3:
                recorder.run(client, client_id, leader, "get", key)
        workload.sleep(4.0)
        end_ns = time.monotonic_ns()
        prober.stop()
        finish(cluster, workload, recorder, strict_keys=strict + durable, loss_keys=loose,
               monitor=monitor)
        for key, value_id in acked.items():
            reads = [r for r in recorder.records if r.key == key and r.kind == "get"
                     and r.outcome == "ok" and r.invoke_ns > end_ns]
            assert reads and all(r.result == value_id for r in reads), \
                f"acknowledged put of {key!r} (value {value_id}) not read back:\n" + \
                recorder.key_story(key)
        report_unavailability(f"leader {leader} killed", kill_ns, end_ns, recorder, prober,
                              monitor, survivors,
                              f"restarted (READY) {(restarted_ns - kill_ns) / 1e9:.2f} s later")


# -- 2. SIGSTOP the leader ------------------------------------------------------------------------

def test_leader_stopped_past_its_election_timeout_serves_no_stale_reads(make_cluster):
    """SIGSTOP the leader; the majority elects another and takes writes; reads sent to the old
    leader while it sleeps are answered when it wakes: never with the values it had.

    Where nftables is available the old leader is also cut off from the others as soon as it
    stops, so nothing the new leader sends waits in its sockets when it wakes: only its own
    clock can tell it that its lease has lapsed (its timers did not run while it was stopped).
    """
    try:
        partition = Partition()
    except RuntimeError:
        partition = None
    cluster = make_cluster()
    leader = cluster.wait_for_leader()
    rest = others(leader)
    recorder = Recorder()
    monitor = LeaderMonitor(cluster).start()
    keys = [f"s{i}" for i in range(5)]
    probes = [f"p{i}" for i in range(4)]
    workload = Workload(cluster, keys, [rest[0], rest[1], rest[0], rest[1], leader], seed=22,
                        recorder=recorder, config_for=lambda key: TWO)
    prober = Prober(cluster, NODES)
    pid = cluster.nodes[leader].process.pid
    results: dict[str, object] = {}

    def probe(client, key: str) -> None:
        try:
            results[key] = recorder.run(client, recorder.client_id(), leader, "get", key)
        except Violation as exc:
            results[key] = exc
        finally:
            client.close()

    try:
        with diagnosed(cluster, recorder, monitor):
            for key in probes:
                run_until_ok(recorder, cluster, rest[0], "put", key, 4096, TWO)
            # Connections to the leader opened now, used while it is stopped.
            probe_clients = [connect(cluster, leader) for _ in probes]
            assert all(probe_clients)
            workload.start()
            prober.start()
            workload.sleep(2.0)
            stop_ns = time.monotonic_ns()
            os.kill(pid, signal.SIGSTOP)
            try:
                if partition is not None:
                    partition.isolate(leader, list(NODES))
                new_leader = cluster.wait_for_leader(among=rest, timeout_s=15)
                elected_ns = time.monotonic_ns()
                # Writes through the majority while the old leader sleeps...
                majority_only = ReplicateConfig(2, [f"node{i}/0" for i in rest])
                written = {key: run_until_ok(recorder, cluster, rest[0], "upsert", key, 4096,
                                             majority_only).value for key in probes}
                # ...then reads through the old leader, sent before it wakes up.
                threads = [threading.Thread(target=probe, args=(c, k), daemon=True)
                           for c, k in zip(probe_clients, probes)]
                for thread in threads:
                    thread.start()
                time.sleep(max(0.3, stop_ns / 1e9 + 3 * ELECTION_TIMEOUT_S - time.monotonic()))
            finally:
                os.kill(pid, signal.SIGCONT)
            cont_ns = time.monotonic_ns()
            for thread in threads:
                thread.join(15)
            if partition is not None:
                partition.heal()
            assert new_leader != leader
            stale = []
            for key in probes:
                record = results.get(key)
                if isinstance(record, Exception):
                    raise record
                if record is not None and record.outcome == "ok" \
                        and record.result != written[key]:
                    stale.append(f"{key}: {record.describe()} (latest write: value "
                                 f"{written[key]})")
            assert not stale, "the resumed old leader served stale reads:\n" + "\n".join(stale)
            # Reads through the resumed node, now connected again, return the latest values.
            for key in probes:
                record = run_until_ok(recorder, cluster, leader, "get", key)
                assert record.result == written[key], \
                    f"{record.describe()}; latest write: value {written[key]}"
            workload.sleep(2.0)
            end_ns = time.monotonic_ns()
            prober.stop()
            finish(cluster, workload, recorder, strict_keys=keys + probes, monitor=monitor)
            outcomes = ", ".join(f"{k} {r.outcome if r.outcome != 'fail' else code_name(r.code)}"
                                 for k, r in sorted(results.items()))
            report_unavailability(
                f"leader {leader} stopped {(cont_ns - stop_ns) / 1e9:.2f} s"
                f"{' and cut off' if partition else ''}", stop_ns, end_ns, recorder, prober,
                monitor, rest, f"node {new_leader} led after "
                f"{(elected_ns - stop_ns) / 1e9:.2f} s; reads sent to the old leader while "
                f"it was stopped: {outcomes}")
    finally:
        if partition is not None:
            partition.close()


# -- 3. partitions --------------------------------------------------------------------------------

def test_partitions_fail_closed_on_the_minority_and_heal(make_cluster):
    try:
        partition = Partition()
    except RuntimeError as exc:
        pytest.skip(f"no partitions here: {exc}")
    try:
        cluster = make_cluster()
        recorder = Recorder()
        monitor = LeaderMonitor(cluster).start()
        keys = [f"q{i}" for i in range(6)]
        # Each cut lasts past node_ttl_ms, so two different nodes are declared down one after
        # the other (their replicas dropped): with three replicas no acknowledged value is lost.
        workload = Workload(cluster, keys, [1, 2, 3, 1, 2, 3], seed=33, recorder=recorder,
                            config_for=lambda key: ReplicateConfig(replica_num=3))
        prober = Prober(cluster, NODES)
        with diagnosed(cluster, recorder, monitor):
            leader = cluster.wait_for_leader()
            follower, third = others(leader)
            workload.start()
            prober.start()
            workload.sleep(2.0)

            # A follower alone: the majority serves, the follower fails closed.
            partition.isolate(follower, list(NODES))
            cut_ns = time.monotonic_ns()  # every rule is in place from here on
            workload.sleep(4.0)
            heal_ns = time.monotonic_ns()
            partition.heal()
            majority_writes = recorder.successes(nodes=[leader, third], since_ns=cut_ns,
                                                 until_ns=heal_ns)
            majority_probes = prober.count([leader, third], cut_ns, heal_ns)
            assert majority_probes, "the majority served no write while a follower was cut off"
            minority = recorder.successes(kinds=("put", "upsert", "remove", "get", "exists"),
                                          nodes=[follower], since_ns=cut_ns, until_ns=heal_ns)
            assert not minority, "the cut-off follower answered:\n" + "\n".join(
                r.describe() for r in minority[:10])
            assert not prober.count([follower], cut_ns, heal_ns), \
                "the cut-off follower acknowledged a metadata write"
            minority_probes = prober.failed([follower], cut_ns, heal_ns)
            # Calls through the cut-off follower during the cut (answered before or after the
            # heal; none succeeded before it, asserted above).
            minority_calls = [r for r in recorder.records if r.node == follower
                              and cut_ns <= r.invoke_ns < heal_ns]
            caught_up_s = wait_caught_up(cluster, follower)

            # The leader alone: a new leader on the majority side, the old one fails closed.
            leader = cluster.wait_for_leader(timeout_s=20)
            majority = others(leader)
            partition.isolate(leader, list(NODES))
            cut2_ns = time.monotonic_ns()
            new_leader = cluster.wait_for_leader(among=majority, timeout_s=20)
            elected_s = (time.monotonic_ns() - cut2_ns) / 1e9
            # Until the old leader is declared down, two-replica puts placed on it fail
            # (TRANSFER_FAIL after the RPC timeout); then the majority serves them all.
            down_s = wait_node(cluster, new_leader, leader, up=False, timeout_s=NODE_TTL_S + 20)
            workload.sleep(1.5)
            heal2_ns = time.monotonic_ns()
            partition.heal()
            assert not prober.count([leader], cut2_ns, heal2_ns), \
                "the cut-off old leader acknowledged a metadata write"
            old_leader_probes = prober.failed([leader], cut2_ns, heal2_ns)
            stale_writes = recorder.successes(nodes=[leader], since_ns=cut2_ns,
                                              until_ns=heal2_ns)
            assert not stale_writes, "the cut-off old leader acknowledged writes:\n" + \
                "\n".join(r.describe() for r in stale_writes[:10])
            old_reads = recorder.successes(kinds=("get", "exists"), nodes=[leader],
                                           since_ns=cut2_ns, until_ns=heal2_ns)
            majority_writes2 = recorder.successes(nodes=majority, since_ns=cut2_ns,
                                                  until_ns=heal2_ns)
            assert prober.count(majority, cut2_ns, heal2_ns), \
                "the majority served no write after the leader was cut off"
            gap_s, gap_at_s = prober.longest_gap_s(cut2_ns, heal2_ns)
            wait_caught_up(cluster, leader)
            workload.sleep(1.0)
            prober.stop()
            finish(cluster, workload, recorder, strict_keys=keys, monitor=monitor)
            outcomes: dict[str, int] = {}
            for r in minority_calls:
                name = "ok after the heal" if r.outcome == "ok" else \
                    f"{r.outcome} {code_name(r.code)}" if r.outcome else "no answer"
                outcomes[name] = outcomes.get(name, 0) + 1
            print(f"  follower {follower} cut off 4 s: its clients sent {len(minority_calls)} "
                  f"calls meanwhile ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))})"
                  f" and a quickly retrying client's writes through it failed with "
                  f"{minority_probes}, none succeeded before the heal; the majority acknowledged "
                  f"{len(majority_writes)} workload writes and {majority_probes} probe writes; "
                  f"it caught up {caught_up_s:.2f} s after the heal")
            print(f"  leader {leader} cut off: node {new_leader} led after {elected_s:.2f} s "
                  f"and declared it down {down_s:.2f} s later; the old leader answered "
                  f"{len(old_reads)} reads (lease) and no write (probe writes through it failed "
                  f"with {old_leader_probes}); the majority acknowledged "
                  f"{len(majority_writes2)} workload writes meanwhile; a quickly retrying "
                  f"client saw no leader for at most {gap_s:.2f} s")
    finally:
        partition.close()


def wait_caught_up(cluster: Cluster, node: int, timeout_s: float = 30.0) -> float:
    """Wait until `node` agrees on the leader and has applied what the leader had committed
    when the wait began; returns the seconds it took."""
    started = time.monotonic()
    leader = cluster.wait_for_leader(timeout_s=timeout_s)
    target = cluster.status(leader)["commit"]
    while time.monotonic() < started + timeout_s:
        status = cluster.status(node)
        if status and status["applied"] >= target and status["leader"] == leader:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"node {node} did not catch up to index {target}: "
                         f"{cluster.status(node)}")


# -- 4. the writer's node killed in the middle of a put -------------------------------------------

def test_a_node_killed_in_the_middle_of_a_put_leaves_no_partial_object(make_cluster):
    cluster = make_cluster(segment_bytes=64 << 20)
    leader = cluster.wait_for_leader()
    writer, target = others(leader)
    recorder = Recorder()
    keys = [f"big{attempt}" for attempt in range(3)]
    readers = Workload(cluster, keys, [leader, target, leader, target], seed=44,
                       recorder=recorder, weights={"get": 4, "exists": 1}, think_s=0.02)
    with diagnosed(cluster, recorder):
        readers.start()
        stat_client = connect(cluster, leader)
        caught = None
        for key in keys:
            if not cluster.nodes[writer].process or cluster.nodes[writer].process.poll() is not None:
                cluster.nodes[writer].start()
            put_client = connect(cluster, writer, timeout_s=20)
            records = []
            # 32 MiB through the writer's node into the target's segment: PutStart, a transfer
            # over the peer data links, PutEnd.
            thread = threading.Thread(target=lambda: records.append(recorder.run(
                put_client, recorder.client_id(), writer, "put", key, 32 << 20,
                ReplicateConfig(replica_num=1, preferred_segments=[f"node{target}/0"]))),
                daemon=True)
            thread.start()
            state = None
            deadline = time.monotonic() + 30
            while thread.is_alive() and time.monotonic() < deadline:
                state = object_state(stat_client, key)
                if state == "writing":
                    cluster.nodes[writer].kill()
                    break
            killed_ns = time.monotonic_ns()
            thread.join(30)
            put_client.close()
            after = object_state(stat_client, key)
            if state == "writing" and after == "writing":
                caught = (key, killed_ns, records[0] if records else None)
                break
            print(f"  {key}: the kill came too late or too early (state seen {state}, "
                  f"then {after}); again with another key")
        assert caught, "never killed the writer between PutStart and PutEnd"
        key, killed_ns, zombie = caught
        assert zombie is None or zombie.outcome != "ok", \
            f"the put answered although its node was killed: {zombie.describe()}"
        # Readers see no object (never partial bytes) while it is being written; after the
        # discard timeout a new put of the key takes it over.
        readers.sleep(DISCARD_TIMEOUT_S / 2)
        early = run_until_ok(recorder, cluster, leader, "put", key, 1 << 20)
        taken = early if early.result is True else None
        deadline = time.monotonic() + DISCARD_TIMEOUT_S + 20
        while taken is None and time.monotonic() < deadline:
            readers.sleep(0.25)
            record = run_until_ok(recorder, cluster, target, "put", key, 1 << 20)
            if record.result is True:
                taken = record
        assert taken is not None, f"no new put of {key!r} succeeded after the discard " \
            f"timeout:\n{recorder.key_story(key)}"
        takeover_s = (taken.complete_ns - killed_ns) / 1e9
        got = run_until_ok(recorder, cluster, target, "get", key)
        assert got.result == taken.value, recorder.key_story(key)
        readers.sleep(1.0)
        stat_client.close()
        finish(cluster, readers, recorder, strict_keys=keys)
        premature = early.result is True
        tries = [r for r in recorder.records if r.key == key and r.kind == "put"
                 and r.invoke_ns > killed_ns]
        answers = ", ".join(f"{(r.complete_ns - killed_ns) / 1e9:.1f} s: "
                            f"{r.result if r.outcome == 'ok' else code_name(r.code)}"
                            for r in tries)
        print(f"  writer node {writer} killed mid-put of {key!r}; a new put succeeded "
              f"{takeover_s:.2f} s later (discard timeout {DISCARD_TIMEOUT_S:.1f} s"
              f"{'; the first try, before it, already succeeded' if premature else ''}); "
              f"puts of the key after the kill: {answers}")
        assert not premature, "a new put took over the key before the discard timeout"


def object_state(client, key: str) -> str | None:
    try:
        return client.call("object_stat", key)["state"]
    except MooncakedError as exc:
        if exc.code == ErrorCode.OBJECT_NOT_FOUND:
            return None
        raise


# -- 5. a node declared down, then back -----------------------------------------------------------

def test_a_dead_node_is_declared_down_and_rejoins(make_cluster):
    cluster = make_cluster()
    leader = cluster.wait_for_leader()
    victim, keeper = others(leader)
    recorder = Recorder()
    only = [f"only{i}" for i in range(5)]   # the one replica on the victim
    elsewhere = [f"else{i}" for i in range(5)]  # the one replica on the keeper
    both = [f"both{i}" for i in range(5)]   # a replica on each
    busy = [f"w{i}" for i in range(4)]      # written throughout, two replicas
    on_victim = ReplicateConfig(replica_num=1, preferred_segments=[f"node{victim}/0"])
    on_keeper = ReplicateConfig(replica_num=1, preferred_segments=[f"node{keeper}/0"])
    on_both = ReplicateConfig(replica_num=2,
                              preferred_segments=[f"node{victim}/0", f"node{keeper}/0"])
    workload = Workload(cluster, busy, [leader, keeper, leader, keeper], seed=55,
                        recorder=recorder, config_for=lambda key: TWO)
    readers = Workload(cluster, only + elsewhere + both, [leader, keeper], seed=56,
                       recorder=recorder, weights={"get": 4, "exists": 1}, think_s=0.02)
    with diagnosed(cluster, recorder):
        acked = {}
        for keys, config, nodes in ((only, on_victim, {victim}), (elsewhere, on_keeper,
                                    {keeper}), (both, on_both, {victim, keeper})):
            for key in keys:
                acked[key] = run_until_ok(recorder, cluster, keeper, "put", key, 64 << 10,
                                          config).value
                placed = holders(cluster, leader, key)
                assert placed == nodes, f"{key!r} placed on nodes {placed}, wanted {nodes}"
        workload.start()
        readers.start()
        workload.sleep(1.0)
        kill_ns = time.monotonic_ns()
        cluster.nodes[victim].kill()
        down_s = wait_node(cluster, leader, victim, up=False, timeout_s=NODE_TTL_S + 20)
        workload.sleep(0.5)
        for key in only:
            record = run_until_ok(recorder, cluster, leader, "get", key)
            assert record.result is None, f"{key!r}: its only replica's node is down, " \
                f"yet: {record.describe()}"
        for key in elsewhere + both:
            for node in (leader, keeper):
                record = run_until_ok(recorder, cluster, node, "get", key)
                assert record.result == acked[key], record.describe()
        cluster.nodes[victim].start()
        up_s = wait_node(cluster, leader, victim, up=True, timeout_s=30)
        # New puts asking for its segment, from the moment it says it is back: they land on
        # it, and stay readable (it is alive: losing one would be losing an acknowledged put).
        fresh = [f"fresh{i}" for i in range(10)]
        landed = []
        for key in fresh:
            record = run_until_ok(recorder, cluster, keeper, "put", key, 64 << 10, on_victim)
            assert record.result is True, record.describe()
            if holders(cluster, leader, key) == {victim}:
                landed.append(key)
        assert landed, f"no new put landed on the restarted node {victim}"
        workload.sleep(1.0)
        readers.stop()
        finish(cluster, workload, recorder, strict_keys=busy + elsewhere + both + fresh,
               loss_keys=only)
        print(f"  node {victim} killed: declared down {down_s:.2f} s later (node_ttl "
              f"{NODE_TTL_S:.1f} s); restarted, it was up with its segment again in "
              f"{up_s:.2f} s; {len(landed)} of {len(fresh)} new puts landed on it")


def holders(cluster: Cluster, ask: int, key: str, timeout_s: float = 10.0) -> set[int]:
    """The nodes holding the key's replicas, as `ask` (the leader: it has applied the put
    before acknowledging it) sees them."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = connect(cluster, ask)
        try:
            if client is not None:
                with client:
                    return {c.node_of_segment(r["segment_id"]) for r in
                            client.call("object_stat", key)["replicas"]}
        except MooncakedError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def wait_node(cluster: Cluster, ask: int, node: int, up: bool, timeout_s: float) -> float:
    """Wait until `ask`'s cluster_status shows `node` up (with a segment) or down."""
    started = time.monotonic()
    while time.monotonic() < started + timeout_s:
        status = cluster.status(ask)
        entry = next((n for n in (status or {}).get("nodes", []) if n["node_id"] == node), None)
        if entry is not None and entry["up"] == up and (not up or entry["segments"] >= 1):
            if not up or (cluster.status(node) or {}).get("registered"):
                return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"node {node} not {'up' if up else 'down'} after {timeout_s} s: "
                         f"{cluster.status(ask)}")
