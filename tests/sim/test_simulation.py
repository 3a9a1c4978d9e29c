"""The deterministic simulation of real cluster daemons (mooncaked/sim) in CI.

- a fixed list of seeds, each a whole run of real Daemons in cluster mode (safety phase under
  its own fault schedule, then liveness, then the end checks); a failure prints the seed's
  report: parameters, fault schedule, the broken property, the last trace lines and the
  command that replays it;
- determinism: the same seed gives the same trace, in this process and in another one with a
  different hash seed;
- the checks can fail: a history with a wrong read, and a node that stops itself, are caught;
- a fault schedule given by hand replaces the seed's, and the shrinker keeps a failing one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from mooncaked.sim import SimFailure, run_seed
from mooncaked.sim.runner import FAULT_KINDS, Fault, Params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CI_SEEDS = range(0, 300)


def run_or_report(seed: int, **overrides):
    try:
        return run_seed(seed, **overrides)
    except SimFailure as failure:
        pytest.fail(failure.report(), pytrace=False)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_seed(seed):
    run_or_report(seed)


# -- determinism ----------------------------------------------------------------------------------

def test_same_seed_same_trace():
    for seed in (0, 7, 17, 57):
        first, second = run_or_report(seed), run_or_report(seed)
        assert first.trace_digest == second.trace_digest, seed
        assert first.as_dict() == second.as_dict(), seed
    assert run_or_report(1).trace_digest != run_or_report(2).trace_digest


def test_replay_in_another_process_gives_the_same_trace():
    seed = 7
    here = run_or_report(seed)
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", "mooncaked.sim", "--seed", str(seed)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"'trace_digest': '{here.trace_digest}'" in done.stdout, done.stdout


# -- the faults and the checks ---------------------------------------------------------------------

def test_seeds_inject_every_kind_of_fault():
    kinds = set()
    for seed in CI_SEEDS:
        kinds |= {f.kind for f in Params.draw(seed, random.Random(seed)).faults}
    assert kinds == set(FAULT_KINDS)


def test_a_crash_of_the_leader_elects_another():
    lines: list[str] = []
    run_or_report(3, echo=lines.append,
                  faults=[Fault(2000, "crash", "leader", 3000)])
    crashed = next(line.split()[-1] for line in lines if " crash node" in line)
    leaders = [line.split()[1] for line in lines if " leads term " in line]
    assert len(leaders) >= 2 and leaders[-1] != crashed, lines


def test_membership_change_replaces_a_node():
    lines: list[str] = []
    run_or_report(5, echo=lines.append, faults=[Fault(2000, "membership", "drain")])
    assert any("admin cluster_drain" in line for line in lines), lines
    assert any("start node4" in line for line in lines), lines


def test_a_wrong_read_is_caught(monkeypatch):
    """The checks can fail: values read back with one byte changed are wrong bytes."""
    from mooncaked.sim import client

    real = client.decode_value

    def corrupted(key, data):
        data = bytearray(data)
        data[-1] ^= 1
        return real(key, bytes(data))
    monkeypatch.setattr(client, "decode_value", corrupted)
    monkeypatch.setattr("mooncaked.sim.runner.decode_value", corrupted)
    with pytest.raises(SimFailure) as failure:
        run_seed(1, faults=[])
    assert failure.value.prop == "wrong bytes"


def test_a_node_that_stops_itself_is_caught(monkeypatch):
    """A node that halts (fail-stop on an entry it cannot apply) breaks the run."""
    from mooncaked.meta.state_machine import StateMachine

    real = StateMachine.apply
    calls = {"n": 0}

    def apply(self, command):
        calls["n"] += 1
        if calls["n"] == 40:
            raise ValueError("planted: an entry this node cannot apply")
        return real(self, command)
    monkeypatch.setattr(StateMachine, "apply", apply)
    with pytest.raises(SimFailure) as failure:
        run_seed(1, faults=[])
    assert failure.value.prop == "fail-stop"


def test_schedule_round_trips_and_shrinking_keeps_the_failure(monkeypatch):
    faults = [Fault(2000, "crash", "leader", 800), Fault(3000, "pause", "node2", 500)]
    assert Fault.parse_schedule(Fault.format_schedule(faults)) == faults
    with pytest.raises(ValueError):
        Fault.parse_schedule("explode:node1:1:1")

    from mooncaked.meta.state_machine import StateMachine
    from mooncaked.sim.__main__ import shrink

    real = StateMachine.apply

    def apply(self, command):  # fails once the cluster has applied some entries
        if type(command).__name__ == "ArenaPut" and len(self.objects) >= 2:
            raise ValueError("planted")
        return real(self, command)
    monkeypatch.setattr(StateMachine, "apply", apply)
    with pytest.raises(SimFailure) as failure:
        run_seed(2, faults=faults)
    smallest = shrink(2, {}, failure.value, lambda text: None)
    assert smallest.prop == failure.value.prop
    assert smallest.params.faults == []


def test_a_lost_value_is_caught_where_no_replica_node_was_lost(monkeypatch):
    """A key may lose its value only once no node holds a replica of it any more (each one
    crashed, was declared down or removed): with that bookkeeping switched off, a seed whose
    crash loses a value fails."""
    from mooncaked.sim.runner import Run

    scenario = dict(nodes=3, read_mode="lease", snapshot_entries=10_000, clients=3, ops=10,
                    keys=2, max_drift=0.0, client_abort_percent=0, safety_ms=5000,
                    faults=Fault.parse_schedule("crash:follower:2500:1000;"
                                                "crash:leader:3500:1000"))
    run_or_report(0, **scenario)
    monkeypatch.setattr(Run, "lose_replicas", lambda self, node_id, why: None)
    with pytest.raises(SimFailure) as failure:
        run_seed(0, **scenario)
    assert failure.value.prop == "linearizability"


def test_a_node_removed_while_cut_off_learns_it_after_the_leader_changed():
    """Found by the simulation (shrunk from seed 319): node2 is removed while a partition
    holds its removal, then every node restarts and a new node (node4) leads. node2's log
    still lists nodes 1-3, none of which leads; it must still learn from them that it is no
    member (they have applied more of the log than it has and do not list it), not campaign
    forever. Every parameter is given, so the scenario stays whatever Params.draw becomes."""
    run_or_report(32, nodes=3, read_mode="lease", snapshot_entries=10_000, clients=2, ops=6,
                  keys=4, max_drift=0.05, client_abort_percent=0, safety_ms=3885,
                  faults=Fault.parse_schedule(
                      "partition:follower:2277:806;partition:follower:2563:590;"
                      "membership:remove:2652:0;outage:all:2954:1251"))


def test_an_error_no_code_handles_is_caught(monkeypatch):
    """A callback that raises reaches the loop's exception handler: a daemon would log it and
    go on; the simulation fails the run."""
    from mooncaked.daemon.main import Daemon

    real = Daemon._tick
    calls = {"n": 0}

    def tick(self):
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("planted: a timer callback that fails")
        return real(self)
    monkeypatch.setattr(Daemon, "_tick", tick)
    with pytest.raises(SimFailure) as failure:
        run_seed(1, faults=[])
    assert failure.value.prop == "unhandled error"


def test_a_put_whose_local_replica_is_refused_sends_nothing_and_leaks_no_coroutine():
    """Found by the simulation (seed 73): a put reaches node1 before it has applied its own
    registration; the leader placed one replica on node1 (refused locally: SEGMENT_NOT_FOUND)
    and one on node2, whose send had been created as a coroutine and was then dropped,
    never awaited (a RuntimeWarning in the daemon's log)."""
    run_or_report(73, nodes=3, read_mode="lease", snapshot_entries=10, clients=3, ops=10,
                  keys=2, max_drift=0.05, client_abort_percent=5, safety_ms=5403, faults=[])


def test_a_removed_node_still_knows_it_after_a_restart():
    """Found by the simulation (shrunk from seed 3757): node2 is drained (it applies its own
    removal and says so), then every node restarts. node2's own log no longer lists it (the
    removal is in its snapshot), it hears from no leader, and it took itself for a node still
    joining: role follower, removed false, ready to serve its stale copy of the log. It must
    stay removed."""
    run_or_report(3757, nodes=5, read_mode="lease", snapshot_entries=10, clients=3, ops=8,
                  keys=4, max_drift=0.0, client_abort_percent=0, safety_ms=6826,
                  faults=Fault.parse_schedule("membership:drain:2550:0;outage:all:5655:89"))


def test_a_disk_fault_stops_the_node_and_the_cluster_goes_on():
    """EIO on the Raft log's sync (the simulated disk, sim/disk.py): the leader must stop
    itself (fail-stop, excused because its disk failed), the others elect a leader and serve,
    and the node, started again once its disk is fixed, catches up; every check holds."""
    lines: list[str] = []
    run_or_report(2, echo=lines.append, faults=Fault.parse_schedule("disk:leader:2000:1500"))
    stopped = [line for line in lines if "stopped itself after a disk fault" in line]
    assert stopped, "the injected disk fault never reached the log store"
    name = stopped[0].split()[1]
    assert any(f"start {name} (incarnation 2)" in line for line in lines), lines[-20:]
    assert len([line for line in lines if " leads term " in line]) >= 2



# -- repair and reconciliation: no acknowledged value lost, one failure at a time ---------------

ONE_AT_A_TIME = dict(nodes=3, replica_num=2, safety_ms=16000, clients=3, ops=10, keys=8,
                     max_drift=0.0, client_abort_percent=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repair_keeps_every_value_when_nodes_are_lost_one_at_a_time(seed):
    """Each node in turn crashes (its memory gone) and restarts, with time between for the
    leader to declare it down and repair: every value put with two replicas survives, as long
    as repair runs. With repair off the same schedule loses values (the check can fail)."""
    crashes = Fault.parse_schedule("crash:node1:2000:1500;crash:node2:8000:1500;"
                                   "crash:node3:14000:1500")
    kept = run_or_report(seed, faults=crashes, **ONE_AT_A_TIME)
    assert kept.crashes == 3 and kept.lossy_keys == []
    assert run_or_report(seed, faults=crashes, repair=False, **ONE_AT_A_TIME).lossy_keys


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_node_cut_off_past_its_ttl_returns_with_its_replicas(seed):
    """node1 is cut off past node_ttl_ms (declared down) and comes back with its memory; then
    node2 crashes. Repair is off, so only node1's return (reconciliation) can keep the values
    whose replicas were on node1 and node2: none is lost. With nothing kept for a returning
    node (node_return_grace_ms 0) some are (the check can fail)."""
    cut = Fault.parse_schedule("partition:node1:2000:5000;crash:node2:10000:1500")
    kept = run_or_report(seed, faults=cut, repair=False, **ONE_AT_A_TIME)
    assert kept.lossy_keys == []
    assert run_or_report(seed, faults=cut, repair=False, node_return_grace_ms=0,
                         **ONE_AT_A_TIME).lossy_keys


def test_a_run_leaves_the_loggers_as_it_found_them():
    """A seed quiets the daemons' loggers for its run only: afterwards a warning of the
    process's own mooncaked code is logged again (pytest's caplog, a daemon in-process)."""
    import logging

    before = {name: logging.getLogger(name).level for name in ("mooncaked", "asyncio")}
    run_or_report(1, faults=[])
    after = {name: logging.getLogger(name).level for name in ("mooncaked", "asyncio")}
    assert after == before
