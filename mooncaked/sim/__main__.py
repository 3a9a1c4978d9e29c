"""Run the deterministic simulation of real mooncaked cluster daemons from the command line.

    python -m mooncaked.sim --seeds 1000                 # seeds 0..999; stops at the first failure
    python -m mooncaked.sim --seeds 1000 --start 5000 --keep-going
    python -m mooncaked.sim --seed 1234 --trace          # replay one seed, printing every event
    python -m mooncaked.sim --seed 1234 --trace --log debug   # and the daemons' own log lines
    python -m mooncaked.sim --seed 1234 --shrink         # the smallest fault schedule that fails
    python -m mooncaked.sim --seed 1234 --schedule "crash:leader:2000:800;pause:node2:3000:500"

Each seed builds a cluster of real daemons (mooncaked/daemon/main.py Daemon in cluster mode:
the Raft driver, the leader's master, forwarding, the peer transport, the client handlers) in
one process, on a virtual-time event loop with simulated streams (mooncaked/sim/loop.py,
streams.py, world.py). It draws a client workload and a fault schedule (crash and restart,
pause and resume, partitions, a slow network, leader transfers, a membership change: remove or
drain a node and add a new one; clients that drop their connection mid-put; clock drift),
runs the workload under the faults, heals everything and requires the cluster to settle
(a leader, every request answered, every member at one state), then checks the client history
for linearizability. Raft's and the store's safety properties are checked every 10 virtual ms.
A seed replays exactly: the same seed gives the same trace (its digest is printed with --seed).

A failure prints the seed, its parameters and fault schedule, the broken property, the last
trace lines and the command that replays it. Exit status: 0 if every seed passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from mooncaked.sim.runner import FAULT_KINDS, Fault, SimFailure, run_seed


def shrink(seed: int, overrides: dict, failure: SimFailure, say) -> SimFailure:
    """Drop faults (then shorten them) while the seed still breaks the same property."""
    best = failure
    faults = list(failure.params.faults)
    changed = True
    while changed:
        changed = False
        candidates = [faults[:i] + faults[i + 1:] for i in range(len(faults))]
        candidates += [faults[:i] + [Fault(f.at_ms, f.kind, f.target, f.duration_ms // 2)]
                       + faults[i + 1:] for i, f in enumerate(faults) if f.duration_ms > 100]
        for candidate in candidates:
            try:
                run_seed(seed, **{**overrides, "faults": candidate})
            except SimFailure as again:
                if again.prop == best.prop:
                    best, faults, changed = again, candidate, True
                    say(f"  still fails with {len(faults)} fault(s): "
                        f"{Fault.format_schedule(faults) or 'none'}")
                    break
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mooncaked.sim",
        description="deterministic simulation of a cluster of real mooncaked daemons",
        epilog="exit status: 0 if every seed passed, 1 otherwise")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="run N seeds, from --start (default 20)")
    parser.add_argument("--start", type=int, default=0, metavar="S",
                        help="first seed of --seeds (default 0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="run one seed (replays it exactly)")
    parser.add_argument("--trace", action="store_true",
                        help="print every event of the run (use with --seed)")
    parser.add_argument("--log", choices=("debug", "info", "warning"), default=None,
                        help="also print the daemons' log lines at this level, each with its "
                        "virtual time and node (use with --seed)")
    parser.add_argument("--shrink", action="store_true",
                        help="for a failing seed: find a smaller fault schedule that still "
                        "breaks the same property, and print it")
    parser.add_argument("--schedule", default=None, metavar="FAULTS",
                        help="run this fault schedule instead of the seed's: "
                        "kind:target:at_ms:duration_ms separated by ';' (kinds: "
                        + ", ".join(FAULT_KINDS) + "); empty = no faults")
    parser.add_argument("--no-faults", action="store_true",
                        help="run without faults (the workload and checks only)")
    parser.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="voters of the initial cluster (default: drawn per seed, 3 or 5)")
    parser.add_argument("--clients", type=int, default=None, metavar="N",
                        help="concurrent clients (default: drawn per seed, 2-3)")
    parser.add_argument("--ops", type=int, default=None, metavar="N",
                        help="operations per client in the safety phase (default: drawn "
                        "per seed)")
    parser.add_argument("--keys", type=int, default=None, metavar="N",
                        help="keys the clients share (default: drawn per seed, 2-4)")
    parser.add_argument("--safety-ms", type=int, default=None, metavar="MS",
                        help="virtual milliseconds of the safety phase (default: drawn per "
                        "seed)")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every seed and report all failures, not only the first")
    args = parser.parse_args(argv)

    overrides = {name: value for name, value in (
        ("nodes", args.nodes), ("clients", args.clients), ("ops", args.ops),
        ("keys", args.keys), ("safety_ms", args.safety_ms)) if value is not None}
    if args.no_faults:
        overrides["faults"] = []
    elif args.schedule is not None:
        try:
            overrides["faults"] = Fault.parse_schedule(args.schedule)
        except ValueError as exc:
            parser.error(f"--schedule: {exc}")
    if args.seed is not None:
        seeds = [args.seed]
    else:
        seeds = range(args.start, args.start + (args.seeds if args.seeds is not None else 20))
    echo = print if args.trace else None
    log_level = getattr(logging, args.log.upper()) if args.log else None
    if log_level is None:
        # The daemons' log lines are for --log: a node stopping itself on an injected disk
        # fault logs at CRITICAL, which Python would otherwise print to stderr.
        logging.getLogger().addHandler(logging.NullHandler())

    started = time.perf_counter()
    passed = failed = callbacks = virtual_ms = 0
    for seed in seeds:
        try:
            stats = run_seed(seed, echo=echo, log_level=log_level, **overrides)
        except SimFailure as failure:
            failed += 1
            print(failure.report(), file=sys.stderr, flush=True)
            if args.shrink:
                print("shrinking the fault schedule...", file=sys.stderr, flush=True)
                smallest = shrink(seed, overrides, failure,
                                  lambda text: print(text, file=sys.stderr, flush=True))
                print(f"smallest schedule: python -m mooncaked.sim --seed {seed} --trace "
                      f"--schedule \"{Fault.format_schedule(smallest.params.faults)}\"",
                      file=sys.stderr, flush=True)
            if not args.keep_going:
                break
            continue
        passed += 1
        callbacks += stats.callbacks
        virtual_ms += stats.virtual_ms
        if len(seeds) == 1:
            print(f"seed {seed}: ok {stats.as_dict()}")
    elapsed = time.perf_counter() - started
    ran = passed + failed
    print(f"{ran} seeds ({passed} passed, {failed} failed) in {elapsed:.1f} s: "
          f"{elapsed / max(ran, 1):.2f} s per seed, {callbacks} callbacks, "
          f"{virtual_ms / 1000:.1f} virtual s ({virtual_ms / 1000 / elapsed:.1f}x real time)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
