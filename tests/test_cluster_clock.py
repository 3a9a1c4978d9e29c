"""Reports of a cluster node read the log's clock, as its master does.

The cluster master's time is the log's (monotonic + an offset learned from the log); a report
computed on the process's own monotonic clock shows ages of minutes and no lease for an object
written a moment ago.
"""

import time

from cluster_harness import Cluster


def test_object_stat_ages_and_leases_are_on_the_masters_clock():
    cluster = Cluster(1).start()
    try:
        with cluster.client(1) as client:
            before = time.monotonic()
            assert client.put("fresh", b"x" * 100) is True
            assert client.get("fresh") == b"x" * 100  # grants a read lease
            stat = client.call("object_stat", "fresh")
            elapsed_ms = (time.monotonic() - before) * 1000
        # The object cannot be older than the time since the test wrote it.
        assert 0 <= stat["created_ms_ago"] <= elapsed_ms + 1
        lease_ttl_ms = 2000  # cluster_harness's [store] lease_ttl_ms
        assert 0 < stat["lease_expires_in_ms"] <= lease_ttl_ms
    finally:
        cluster.close()
