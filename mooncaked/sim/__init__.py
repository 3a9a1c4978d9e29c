"""A deterministic simulation of a mooncaked metadata cluster (the real Raft core and state
machine on simulated network, disks, clocks and clients), run from a seed.

    from mooncaked.sim import run_seed
    stats = run_seed(1234)          # raises SimFailure naming the seed and the broken property

`python -m mooncaked.sim --help` runs many seeds or replays one with its trace.
"""

from mooncaked.sim.run import SimFailure, Stats, run_seed

__all__ = ["SimFailure", "Stats", "run_seed"]
