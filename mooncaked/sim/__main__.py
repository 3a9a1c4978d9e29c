"""Run the deterministic cluster simulation from the command line.

    python -m mooncaked.sim --seeds 200            # seeds 0..199; stops at the first failure
    python -m mooncaked.sim --seeds 1000 --start 5000 --keep-going
    python -m mooncaked.sim --seed 1234 --trace    # replay one seed, printing every event
    python -m mooncaked.sim --seed 1234 --nodes 5 --ops 300
    python -m mooncaked.sim --seeds 50 --mutant ack_before_sync   # test the tester

Each seed draws its own cluster (3 or 5 voters, maybe a learner that joins and is promoted,
safe or lease reads) and fault mix (message loss, duplication and late replay, delay,
partitions, crashes that lose unsynced writes, crashes right after a vote, whole-cluster
outages, pauses, clock drift, snapshots, leadership transfers), runs a client workload under
faults (the safety phase), heals everything and requires a leader and an answer for every
client within 10 election timeouts (the liveness phase), lets the nodes settle, reads every
key, and checks the history for linearizability. Options override what the seed draws. A seed
replays exactly: the same seed gives the same trace (its digest is printed with --seed).

The nodes run the real Raft core (raft/core.py) and state machine (meta/state_machine.py);
the driver, leader and client logic of the daemon (cluster/*.py, daemon/cluster_handlers.py)
is re-written here with callbacks, with the fixes listed in sim/params.py FIXES for the bugs
the simulation found in it (--daemon-as-is turns them off).

A failure prints the seed, its parameters, the broken property and the last trace lines, and
the command that replays it. Exit status: 0 if every seed passed, 1 otherwise.

Options:
  --seeds N          run N seeds, from --start (default 0)
  --seed S           run one seed
  --trace            print every event of the run (with --seed)
  --nodes 3|5        voters (default: drawn per seed)
  --ops N            client operations in the safety phase (default 100)
  --clients N        clients (default: drawn per seed, 1-8)
  --read-mode M      safe or lease (default: drawn per seed): how the leader confirms reads
  --mutant NAME      ack_before_sync or vote_not_persisted: a planted bug the checks must catch
  --without-fix NAME  run the daemon's cluster logic without one of the fixes this simulation
                     proposes for bugs it found there (repeatable): replica_generation,
                     lease_after_barrier, writer_per_put, reregister (sim/params.py FIXES)
  --daemon-as-is     without any of them: the daemon's cluster logic exactly as it is
  --keep-going       run every seed and report all failures
"""

from __future__ import annotations

import argparse
import sys
import time

from mooncaked.sim.params import FIXES, MUTANTS
from mooncaked.sim.run import SimFailure, run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mooncaked.sim",
                                     description="deterministic simulation of a mooncaked cluster",
                                     epilog="exit status: 0 if every seed passed, 1 otherwise")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="run N seeds, from --start (default 20)")
    parser.add_argument("--start", type=int, default=0, metavar="S",
                        help="first seed of --seeds (default 0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="run one seed (replays it exactly)")
    parser.add_argument("--trace", action="store_true",
                        help="print every event of the run (use with --seed)")
    parser.add_argument("--nodes", type=int, choices=(3, 5), default=None,
                        help="voters (default: drawn per seed)")
    parser.add_argument("--ops", type=int, default=None, metavar="N",
                        help="client operations in the safety phase (default 100)")
    parser.add_argument("--clients", type=int, default=None, metavar="N",
                        help="concurrent clients (default: drawn per seed, 1-8)")
    parser.add_argument("--read-mode", choices=("safe", "lease"), default=None,
                        help="how the leader confirms reads (default: drawn per seed)")
    parser.add_argument("--mutant", choices=MUTANTS, default=None,
                        help="plant a known bug the checks must catch (tests the tester)")
    parser.add_argument("--without-fix", choices=FIXES, action="append", default=[],
                        help="run the daemon's cluster logic without this fix the simulation "
                        "proposes (repeatable; sim/params.py FIXES)")
    parser.add_argument("--daemon-as-is", action="store_true",
                        help="run the daemon's cluster logic exactly as it is, without any fix")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every seed and report all failures, not only the first")
    args = parser.parse_args(argv)

    overrides = dict(voters=args.nodes, ops=args.ops, clients=args.clients,
                     read_mode=args.read_mode, mutant=args.mutant,
                     fixes=() if args.daemon_as_is else (
                         tuple(f for f in FIXES if f not in args.without_fix)
                         if args.without_fix else None))
    if args.seed is not None:
        seeds = [args.seed]
    else:
        seeds = range(args.start, args.start + (args.seeds if args.seeds is not None else 20))
    echo = print if args.trace else None

    started = time.perf_counter()
    passed = failed = events = elections = virtual_ms = 0
    for seed in seeds:
        try:
            stats = run_seed(seed, echo=echo, **overrides)
        except SimFailure as failure:
            failed += 1
            print(failure.report(), file=sys.stderr, flush=True)
            if not args.keep_going:
                break
            continue
        passed += 1
        events += stats.events
        elections += stats.elections
        virtual_ms += stats.virtual_ms
        if len(seeds) == 1:
            print(f"seed {seed}: ok {stats.as_dict()}  trace digest {stats.trace_digest[:16]}")
    elapsed = time.perf_counter() - started
    ran = passed + failed
    print(f"{ran} seeds ({passed} passed, {failed} failed) in {elapsed:.1f} s: "
          f"{ran / elapsed:.2f} seeds/s, {events} events ({events / elapsed:.0f}/s), "
          f"{elections} elections, {virtual_ms / 1000:.1f} virtual s "
          f"({virtual_ms / 1000 / elapsed:.1f}x real time)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
