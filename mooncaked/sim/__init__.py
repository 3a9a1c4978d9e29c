"""A deterministic simulation of a mooncaked cluster that runs the daemon's own code: real
Daemons in cluster mode, several in one process, on a virtual-time event loop with simulated
streams, clocks and crashes, run from a seed.

    from mooncaked.sim import run_seed
    stats = run_seed(1234)          # raises SimFailure naming the seed and the broken property

`python -m mooncaked.sim --help` runs many seeds, replays one with its trace, or shrinks a
failing seed's fault schedule. The world: loop.py (event loop), streams.py (network), world.py
(nodes, their clocks, crashes), client.py (a wire-protocol client), runner.py (workload, faults,
phases), safety.py (the properties); no node logic lives here.
"""

from mooncaked.sim.runner import SimFailure, Stats, run_seed

__all__ = ["SimFailure", "Stats", "run_seed"]
