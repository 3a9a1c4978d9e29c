"""A disk tier killed with SIGKILL while many writes are in flight: after reopening, every
record whose write had returned reads back exactly, and no other record is ever served with
wrong bytes (a record that was written but not acknowledged may come back, with its own
bytes; one whose value is incomplete is DiskCorrupt, never served)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mooncaked.ssd import DiskCorrupt, DiskTier
from ssd_support import MIB, crash_value_size, require_io_uring, run, ssd_config, value_of

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.mark.parametrize("acks_before_kill", [1, 300])
def test_kill_9_mid_offload_keeps_every_acknowledged_record(tmp_path, acks_before_kill):
    require_io_uring()
    directory = str(tmp_path / "ssd")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]))
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "ssd_crash_writer.py"),
                              directory], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, text=True)
    acknowledged = {}
    try:
        assert child.stdout.readline().strip() == "READY", child.stderr.read()
        while len(acknowledged) < acks_before_kill:
            line = child.stdout.readline()
            assert line, f"the writer ended early: {child.stderr.read()}"
            _, key, region, offset, size, version = line.split()
            acknowledged[key] = (int(region), int(offset), int(size), int(version))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # Lines written before the kill that this side had not read yet are acknowledged too.
    for line in child.stdout.read().splitlines():
        if line.startswith("ACK ") and len(line.split()) == 6:
            _, key, region, offset, size, version = line.split()
            acknowledged[key] = (int(region), int(offset), int(size), int(version))
    assert child.returncode == -signal.SIGKILL

    config = ssd_config(directory, capacity_bytes=256 * MIB, file_bytes=64 * MIB,
                        region_bytes=4 * MIB)

    async def reopen():
        tier = await DiskTier.open(config)
        found = {r.key: r for r in tier.recovered}
        for key, (region, offset, size, version) in acknowledged.items():
            record = found.get(key)
            assert record is not None, f"acknowledged record {key} was not recovered"
            assert (record.locator.region, record.locator.offset, record.size_bytes,
                    record.version) == (region, offset, size, version)
            assert await tier.read(record.locator) == value_of(key, size)
        unacknowledged = [r for r in tier.recovered if r.key not in acknowledged]
        corrupt = 0
        for record in unacknowledged:
            number = int(record.key[1:])
            assert record.size_bytes == crash_value_size(number)
            try:
                data = await tier.read(record.locator)
            except DiskCorrupt:
                corrupt += 1
                continue
            assert data == value_of(record.key, record.size_bytes)
        status = tier.status()
        assert status["corrupt_records"] == corrupt
        print(f"acknowledged {len(acknowledged)}, recovered {len(found)}, not acknowledged "
              f"{len(unacknowledged)} of which corrupt {corrupt}, torn headers "
              f"{status['torn_records']}")
        # The tier goes on: new writes, and what it holds survives a clean restart.
        locator = await tier.write("ns", "after", 1, [memoryview(value_of("after", 4321))])
        await tier.close()
        tier = await DiskTier.open(config)
        assert {r.key for r in tier.recovered} >= set(acknowledged) | {"after"}
        assert await tier.read(locator) == value_of("after", 4321)
        await tier.close()

    run(reopen())
