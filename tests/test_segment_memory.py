"""Segment memory: shared-memory files, NUMA binding, huge pages and prefault.

Method: create SegmentMemory objects in a temp directory and ask the kernel (move_pages) which
node holds their pages; start the daemon with bad placement settings and check it refuses with
a message. This machine has one NUMA node, so placement on another node is checked only as a
refusal.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, write_config
from mooncaked._native import numa_node_count, numa_usable, nodes_of_pages
from mooncaked.daemon.segment_memory import SegmentMemory, remove_stale_files

SIZE = 4 << 20

needs_numa = pytest.mark.skipif(not numa_usable(), reason="the kernel has no NUMA support")


def test_file_is_shared_and_removed(tmp_path):
    memory = SegmentMemory(0, str(tmp_path), SIZE, 0o600)
    assert os.stat(memory.path).st_size == SIZE
    assert oct(os.stat(memory.path).st_mode & 0o777) == "0o600"
    memory.view[0:5] = b"hello"
    with open(memory.path, "rb") as f:
        assert f.read(5) == b"hello"
    memory.close()
    assert not os.path.exists(memory.path)


def test_without_prefault_no_page_is_present(tmp_path):
    memory = SegmentMemory(0, str(tmp_path), SIZE, 0o600)
    try:
        assert nodes_of_pages(memory.address, SIZE) == {}
        memory.view[0:1] = b"x"
        assert nodes_of_pages(memory.address, SIZE) == {0: 1} or numa_node_count() > 1
    finally:
        memory.close()


@needs_numa
def test_prefault_places_every_page_on_the_bound_node(tmp_path):
    memory = SegmentMemory(0, str(tmp_path), SIZE, 0o600, numa_node=0, prefault=True)
    try:
        assert nodes_of_pages(memory.address, SIZE) == {0: SIZE // 4096}
    finally:
        memory.close()


@needs_numa
def test_a_node_the_machine_lacks_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"NUMA node {numa_node_count()} does not exist"):
        SegmentMemory(0, str(tmp_path), SIZE, 0o600, numa_node=numa_node_count())
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_hugetlbfs_needs_a_hugetlbfs_mount(tmp_path):
    with pytest.raises(ValueError, match="hugetlbfs"):
        SegmentMemory(0, str(tmp_path), SIZE, 0o600, huge_pages="hugetlbfs")
    assert os.listdir(tmp_path) == []


def test_transparent_huge_pages_map_and_work(tmp_path):
    memory = SegmentMemory(0, str(tmp_path), SIZE, 0o600, huge_pages="transparent")
    try:
        memory.view[:4] = b"data"
        assert bytes(memory.view[:4]) == b"data"
    finally:
        memory.close()


def test_stale_files_of_dead_daemons_are_removed(tmp_path):
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1
    stale = tmp_path / f"mooncaked-{dead_pid}-seg0"
    stale.write_bytes(b"x")
    mine = tmp_path / f"mooncaked-{os.getpid()}-seg0"
    mine.write_bytes(b"x")
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    # Only the whole name counts: a name with one more character is another file.
    lookalike = tmp_path / f"mooncaked-{dead_pid}-seg0\n"
    lookalike.write_bytes(b"x")
    assert remove_stale_files(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name,
                                                                 lookalike.name])


@needs_numa
def test_daemon_refuses_a_missing_numa_node(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    config = tmp_path / "bad.toml"
    write_config(str(config), {
        "server": {"tcp_port": 0, "unix_socket": str(tmp_path / "s.sock")},
        "segments": {"size_bytes": SIZE, "shm_dir": str(shm), "numa_node": numa_node_count()},
        "metrics": {"enabled": False}})
    result = subprocess.run([sys.executable, "-m", "mooncaked", "--config", str(config)],
                            cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 1
    assert "NUMA node" in result.stderr and "does not exist" in result.stderr
    assert list(shm.iterdir()) == []


@needs_numa
def test_daemon_runs_with_numa_binding_and_prefault(make_daemon):
    from mooncaked import BlockingClient
    daemon = make_daemon(segments={"numa_node": 0, "prefault": True,
                                   "huge_pages": "transparent"})
    with BlockingClient.connect(daemon.unix_address) as client:
        assert client.put("k", b"v" * 10000)
        assert client.get("k") == b"v" * 10000
