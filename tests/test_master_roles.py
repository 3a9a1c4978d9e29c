"""The cluster master changes state only through the log (ISSUE point 6).

A single node's Master applies commands to its state at once. The cluster's ReplicatedMaster
must offer no such path: a handler that called a synchronous mutator on a follower (or on the
leader) would change that node's state outside the log, and it would diverge from its peers.
The daemon builds the master of its mode once, and cluster handlers use only public helpers of
the single-node handlers.
"""

from __future__ import annotations

import ast
import inspect
import os

from mooncaked.cluster.master import ReplicatedMaster
from mooncaked.config import StoreConfig
from mooncaked.meta import commands as c
from mooncaked.meta.master import Master
from mooncaked.meta.state_machine import StateMachine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What writes straight into the state machine (or through a local `propose`).
SYNCHRONOUS_MUTATORS = ("propose", "put_start", "put_end", "put_commit", "put_revoke",
                        "remove", "remove_matching", "set_quota", "tick", "evict")


def _state() -> StateMachine:
    from mooncaked._native import OffsetAllocator
    return StateMachine(lambda size, alignment, count: OffsetAllocator(size, alignment, count),
                        max_objects=100, put_start_discard_timeout_ms=1000,
                        put_start_release_timeout_ms=2000)


class _NoRaft:
    def propose(self, command):
        raise AssertionError(f"proposed {command!r}")


def test_replicated_master_has_no_synchronous_mutator():
    master = ReplicatedMaster(_state(), StoreConfig(), _NoRaft(), seed=1)
    assert not isinstance(master, Master)
    offered = [name for name in SYNCHRONOUS_MUTATORS if hasattr(master, name)]
    assert offered == [], f"ReplicatedMaster offers local mutators {offered}"


def test_replicated_master_reads_do_not_change_the_replicated_state():
    state = _state()
    state.apply(c.MountSegment(1, "n/0", "n", 1 << 20, 64, 100))
    state.apply(c.PutStart(("ns", "k"), 10, 1, (), None, False, False, 7, 5, 1))
    state.apply(c.PutEnd(("ns", "k"), 7, 6, 6))
    before = state.digest()
    master = ReplicatedMaster(state, StoreConfig(), _NoRaft(), seed=1)
    assert master.get(("ns", "k"), 10).size_bytes == 10
    assert master.get(("ns", "absent"), 10) is None
    master.choose_evictions(10, need_bytes=1 << 30)
    master.quota_report()
    assert state.digest() == before


def test_single_node_master_keeps_its_mutators():
    master = Master(_state(), StoreConfig(), seed=1)
    assert all(callable(getattr(master, name)) for name in SYNCHRONOUS_MUTATORS)


def _source(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _assignments(tree, names: tuple[str, ...]):
    """(owner name, attribute, enclosing function) of each `<owner>.<attribute> = ...`."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr in names \
                            and isinstance(target.value, ast.Name):
                        found.append((target.value.id, target.attr, function.name))
    return found


def test_the_daemon_never_replaces_its_master():
    """The daemon sets its master and clock once, when it is built; nothing else sets them."""
    daemon_module = ast.parse(_source("mooncaked/daemon/main.py"))
    daemon_class = next(node for node in daemon_module.body
                        if isinstance(node, ast.ClassDef) and node.name == "Daemon")
    assert {function for owner, _, function
            in _assignments(daemon_class, ("master", "now_ms"))} == {"__init__"}
    package = os.path.join(REPO, "mooncaked")
    for directory, _, files in os.walk(package):
        if os.path.relpath(directory, package).startswith("sim"):
            continue  # the simulator's world, which builds its own nodes
        for name in files:
            if name.endswith(".py"):
                path = os.path.relpath(os.path.join(directory, name), REPO)
                tree = ast.parse(_source(path))
                swaps = [a for a in _assignments(tree, ("master", "now_ms"))
                         if a[0] == "daemon"]
                assert swaps == [], f"{path} replaces the daemon's {swaps}"


def test_cluster_handlers_use_no_private_helper_of_the_single_node_handlers():
    from mooncaked.daemon import cluster_handlers, handlers
    tree = ast.parse(inspect.getsource(cluster_handlers))
    private = sorted({node.attr for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in ("single", "handlers")
                      and node.attr.startswith("_")})
    assert private == []
    assert handlers.HANDLERS  # the public table stays
