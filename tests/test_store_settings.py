"""A cluster's state machine decides by settings from its log, not by each node's config.

The `[store]` values the state machine decides by (max_objects, the put timeouts,
allocation_strategy) are one cluster-wide setting (SetStoreSettings in the log, carried in
snapshots); two nodes whose configs differ apply the same commands to the same state. A single
node keeps deciding by its own config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib

import pytest

from cluster_harness import Cluster
from conftest import write_config
from mooncaked import config as config_module
from mooncaked.client.calls import ReplicateConfig
from mooncaked.daemon.main import Daemon
from mooncaked.errors import ErrorCode, MooncakedError
from mooncaked.meta import codec
from mooncaked.meta import commands as c

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"max_objects": 3, "put_start_discard_timeout_ms": 100,
         "put_start_release_timeout_ms": 200, "allocation_strategy": "free_ratio_first"}


def ctl(node, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncaked.ctl", "-a", node.tcp_address,
                           *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))


def state_of_node(cluster: bool, **store):
    """The state machine a daemon builds for this config (nothing is started)."""
    sections = {"segments": {"size_bytes": 1 << 20, "max_allocations": 64}, "store": store}
    if cluster:
        sections["cluster"] = {"enabled": True, "node_id": 1}
    return Daemon(config_module.from_dict(sections)).master.state


def log_of_puts() -> list:
    """Registrations and puts whose outcome depends on every store setting."""
    log = [c.NodeUp(1, "n1", "a", "b"),
           c.MountSegment(c.segment_id_of(1, 0, 1), "n1/0", "n1", 1 << 16, 64, 64),
           c.MountSegment(c.segment_id_of(1, 1, 1), "n1/1", "n1", 1 << 16, 64, 64)]
    for i in range(5):  # more objects than max_objects
        key = ("ns", f"k{i}")
        log += [c.PutStart(key, 1000, 1, (), None, False, False, i, i, i),
                c.PutEnd(key, i, i, i)]
    stale = ("ns", "stale")
    log += [c.PutStart(stale, 1000, 1, (), None, False, False, 10, 10, 0),
            c.PutStart(stale, 1000, 1, (), None, False, False, 11, 150, 0),  # preempts?
            c.ReleaseExpired(400)]  # released?
    return log


def run(state, log) -> list:
    outcomes = []
    for command in log:
        command = codec.decode(codec.encode(command))
        try:
            result = state.apply(command)
            outcomes.append(("ok", [r.segment_id for r in result]
                             if isinstance(result, list) else result))
        except MooncakedError as exc:
            outcomes.append(("error", exc.code))
    return outcomes


def test_cluster_nodes_with_different_store_configs_apply_the_log_alike():
    """Before: each node built its state machine from its own [store] values, so the same log
    gave two states (one node refused the 4th object, the other stored it)."""
    small, default = state_of_node(True, **SMALL), state_of_node(True)
    assert run(small, log_of_puts()) == run(default, log_of_puts())
    assert small.digest() == default.digest()
    # The log sets them, the same for both.
    small, default = state_of_node(True, **SMALL), state_of_node(True)
    setting = [c.SetStoreSettings(**SMALL)]
    outcomes = run(small, setting + log_of_puts())
    assert outcomes == run(default, setting + log_of_puts())
    assert small.digest() == default.digest()
    assert small.store_settings() == c.SetStoreSettings(**SMALL)
    assert [o for o in outcomes if o == ("error", ErrorCode.NO_AVAILABLE_HANDLE)]  # 3 at most
    assert len(small.objects) <= 3


def test_a_single_node_decides_by_its_config():
    state = state_of_node(False, **SMALL)
    assert state.store_settings() == c.SetStoreSettings(**SMALL)
    assert not state.store_settings_from_log


@pytest.mark.parametrize("bad", [
    {"max_objects": 0}, {"put_start_discard_timeout_ms": 300},  # above the release timeout
    {"put_start_release_timeout_ms": 0}, {"allocation_strategy": "biggest_first"},
])
def test_bad_store_settings_change_nothing(bad):
    state = state_of_node(True)
    before = state.digest()
    with pytest.raises(MooncakedError) as refused:
        state.apply(c.SetStoreSettings(**{**SMALL, **bad}))
    assert refused.value.code == ErrorCode.INVALID_PARAMS
    assert state.digest() == before


def test_store_settings_travel_in_the_log_format():
    command = c.SetStoreSettings(**SMALL)
    assert codec.decode(codec.encode(command)) == command
    for bad in (c.SetStoreSettings(3, 100, 200, 5), c.SetStoreSettings(3, "100", 200, "random"),
                c.SetStoreSettings(-1, 100, 200, "random")):
        with pytest.raises(ValueError):
            codec.encode(bad)


def test_a_node_whose_config_differs_follows_the_clusters_settings():
    """Nodes 1 and 2 (the first to run, so the first leader is one of them) say max_objects =
    3; node 3 says 1000. Node 3, leading, still keeps at most 3 objects, and says why."""
    cluster = Cluster(3, store={"max_objects": 3})
    try:
        node3 = cluster.nodes[3]
        with open(node3.config_path, "rb") as f:
            sections = tomllib.load(f)
        sections["store"]["max_objects"] = 1000
        write_config(node3.config_path, sections)
        cluster.nodes[1].start()
        cluster.nodes[2].start()
        leader = cluster.wait_for_leader(among=[1, 2])
        deadline = time.monotonic() + 30
        while not cluster.status(leader).get("store_settings", {}).get("from_log", True):
            assert time.monotonic() < deadline, cluster.status(leader)
            time.sleep(0.1)
        node3.start()
        cluster.wait_for_leader()
        with cluster.client(1) as client:
            client.call("cluster_transfer_leader", 3)
        deadline = time.monotonic() + 30
        while cluster.wait_for_leader() != 3:
            assert time.monotonic() < deadline, "leadership did not move to node 3"
            time.sleep(0.1)
        with cluster.client(3) as client:
            for i in range(6):
                try:
                    client.put(f"k{i}", b"v" * 100, ReplicateConfig(replica_num=1))
                except MooncakedError as exc:
                    assert exc.code == ErrorCode.NO_AVAILABLE_HANDLE, exc
            stored = sum(client.exists(f"k{i}") for i in range(6))
        assert 1 <= stored <= 3
        status = cluster.status(3)
        assert status["store_settings"]["max_objects"] == 3
        assert status["store_settings"]["from_log"] is True
        with open(node3.log_path, errors="replace") as f:
            assert "max_objects=3 (config: 1000)" in f.read()
        # Changed through the log, from any node, for every node.
        out = ctl(cluster.nodes[1], "-o", "json", "cluster", "settings", "--max-objects", "5")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["max_objects"] == 5
        deadline = time.monotonic() + 30
        while cluster.status(3)["store_settings"]["max_objects"] != 5:
            assert time.monotonic() < deadline, cluster.status(3)
            time.sleep(0.1)
        out = ctl(node3, "cluster", "settings", "--put-start-discard-timeout-ms", "9000000")
        assert out.returncode != 0 and "put_start_discard_timeout_ms" in out.stderr, out
        out = ctl(node3, "-o", "json", "cluster", "settings")
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        assert shown["max_objects"] == 5 and shown["from_log"] is True
        assert shown["put_start_discard_timeout_ms"] == 2000  # the harness's, unchanged
    finally:
        cluster.close()
