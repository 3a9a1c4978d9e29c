"""Counters kept on the request path, and their Prometheus exposition.

The request path only adds to plain integers (a dict lookup and an add); the Prometheus
families are built when a scrape asks (`StatsCollector`). Names follow Prometheus practice:
`mooncaked_` prefix, base units, `_total` on counters.
"""

from __future__ import annotations

import asyncio
import bisect
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

log = logging.getLogger(__name__)

# Request latency buckets, seconds: 10 µs .. 10 s.
LATENCY_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                     5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BUCKET_BOUNDS_NS = [int(b * 1e9) for b in LATENCY_BUCKETS_S]


# The method label of requests naming no method: names come from clients, so each new one
# kept as a label would grow the daemon's memory and the exposition without bound.
UNKNOWN_METHOD = "unknown"


class Stats:
    def __init__(self, methods) -> None:
        self.methods = frozenset(methods)  # the labels kept; others count as UNKNOWN_METHOD
        self.requests: dict[tuple[str, str], int] = {}  # (method, result) -> count
        # method -> [bucket counts..., +Inf count], sum in ns
        self.latency_buckets: dict[str, list[int]] = {}
        self.latency_sum_ns: dict[str, int] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.connections_total = 0
        self.protocol_errors = 0

    def record(self, method: str, result: str, duration_ns: int) -> None:
        if method not in self.methods:
            method = UNKNOWN_METHOD
        key = (method, result)
        self.requests[key] = self.requests.get(key, 0) + 1
        buckets = self.latency_buckets.get(method)
        if buckets is None:
            buckets = self.latency_buckets[method] = [0] * (len(_BUCKET_BOUNDS_NS) + 1)
            self.latency_sum_ns[method] = 0
        buckets[bisect.bisect_left(_BUCKET_BOUNDS_NS, duration_ns)] += 1
        self.latency_sum_ns[method] += duration_ns


class StatsCollector:
    """Builds the metric families from the daemon's state at scrape time."""

    def __init__(self, daemon) -> None:
        self._daemon = daemon

    def collect(self):
        daemon = self._daemon
        stats: Stats = daemon.stats
        requests = CounterMetricFamily("mooncaked_requests", "Requests handled, by method and "
                                       "result (ok or an error name)", labels=["method", "result"])
        for (method, result), count in list(stats.requests.items()):
            requests.add_metric([method, result], count)
        yield requests
        latency = HistogramMetricFamily("mooncaked_request_duration_seconds",
                                        "Time from a request's header to its response",
                                        labels=["method"])
        for method, buckets in list(stats.latency_buckets.items()):
            cumulative, running = [], 0
            for bound, count in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), buckets):
                running += count
                cumulative.append((bound, running))
            latency.add_metric([method], cumulative, stats.latency_sum_ns[method] / 1e9)
        yield latency
        payload = CounterMetricFamily("mooncaked_payload_bytes", "Payload bytes read from "
                                      "(in) and written to (out) client sockets", labels=["direction"])
        payload.add_metric(["in"], stats.bytes_in)
        payload.add_metric(["out"], stats.bytes_out)
        yield payload
        used = GaugeMetricFamily("mooncaked_segment_used_bytes", "Bytes allocated in a segment",
                                 labels=["segment"])
        capacity = GaugeMetricFamily("mooncaked_segment_capacity_bytes", "Size of a segment",
                                     labels=["segment"])
        for segment in daemon.master.state.segment_list:
            used.add_metric([segment.name], segment.allocator.used_bytes)
            capacity.add_metric([segment.name], segment.allocator.capacity_bytes)
        yield used
        yield capacity
        evictions = daemon.master.evictions
        yield CounterMetricFamily("mooncaked_evictions", "Eviction runs that freed something",
                                  value=evictions.runs)
        yield CounterMetricFamily("mooncaked_evicted_objects", "Objects evicted",
                                  value=evictions.objects)
        yield CounterMetricFamily("mooncaked_evicted_bytes", "Bytes freed by eviction",
                                  value=evictions.bytes)
        now_ms = daemon.now_ms()
        yield GaugeMetricFamily("mooncaked_leases", "Objects under a read lease",
                                value=daemon.master.active_leases(now_ms))
        yield GaugeMetricFamily("mooncaked_objects", "Objects in the store (all namespaces)",
                                value=daemon.objects_count())
        yield from self._namespaces(daemon.master.quota_report())
        yield GaugeMetricFamily("mooncaked_connections", "Open client connections",
                                value=len(daemon.connections))
        yield CounterMetricFamily("mooncaked_connections_accepted", "Client connections "
                                  "accepted since start", value=stats.connections_total)
        yield CounterMetricFamily("mooncaked_protocol_errors", "Connections closed for "
                                  "malformed input", value=stats.protocol_errors)
        if daemon.cluster is not None and daemon.cluster.raft is not None:
            yield from self._cluster(daemon.cluster)
        if daemon.tiering is not None:
            yield from self._tiers(daemon.tiering.status(latency=True))

    @staticmethod
    def _tiers(tiers: dict):
        """Both tiers side by side (label tier = dram or ssd), the disk tier's traffic, and
        its I/O latency."""
        dram, ssd = tiers["dram"], tiers["ssd"]
        for name, help_text, kind, dram_value, ssd_value in (
                ("mooncaked_tier_used_bytes", "Bytes used in a tier (DRAM: allocated segment "
                 "bytes; SSD: written region bytes)", GaugeMetricFamily, dram["used_bytes"],
                 ssd.get("used_bytes", 0)),
                ("mooncaked_tier_capacity_bytes", "Capacity of a tier", GaugeMetricFamily,
                 dram["capacity_bytes"], ssd.get("capacity_bytes", 0)),
                ("mooncaked_tier_objects", "Objects with their bytes in a tier (one with a "
                 "DRAM replica and a disk copy counts in both)", GaugeMetricFamily,
                 dram["objects"], ssd["objects"]),
                ("mooncaked_tier_hits", "Reads served from a tier", CounterMetricFamily,
                 dram["hits"], ssd["hits"])):
            family = kind(name, help_text, labels=["tier"])
            family.add_metric(["dram"], dram_value)
            family.add_metric(["ssd"], ssd_value)
            yield family
        offload, promotion = tiers["offload"], tiers["promotion"]
        eviction = tiers["eviction"]
        for name, help_text, value in (
                ("mooncaked_ssd_misses", "Disk reads that failed (the record is dropped, "
                 "the read is a miss)", ssd["misses"]),
                ("mooncaked_ssd_evictions", "Disk-only objects lost to region reclaim",
                 ssd["evictions"]),
                ("mooncaked_ssd_offloads", "Values written to the disk tier and recorded",
                 offload["done"]),
                ("mooncaked_ssd_offload_bytes", "Bytes of values written to the disk tier",
                 offload["bytes"]),
                ("mooncaked_ssd_offload_failures", "Writes to the disk tier that failed",
                 offload["failed"]),
                ("mooncaked_ssd_offload_disk_full", "Writes refused for want of disk space",
                 offload["disk_full"]),
                ("mooncaked_ssd_promotions", "Values read from disk that got a DRAM replica",
                 promotion["done"]),
                ("mooncaked_evicted_to_disk_objects", "Objects whose DRAM eviction kept "
                 "them readable from disk", eviction["to_disk"]),
                ("mooncaked_evicted_without_offload_objects", "Objects evicted with no disk "
                 "copy (lost)", eviction["without_offload"])):
            yield CounterMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily("mooncaked_ssd_offload_in_flight_bytes", "Value bytes being "
                                "written to the disk tier", value=offload["in_flight_bytes"])
        for name, key in (("mooncaked_ssd_write_duration_seconds", "write_latency_us"),
                          ("mooncaked_ssd_read_duration_seconds", "read_latency_us")):
            histogram = ssd.get(key) or {}
            if "bounds_us" not in histogram:
                continue
            family = HistogramMetricFamily(name, "Disk tier I/O time, request to completion "
                                           "(a write: until durable)")
            cumulative, running = [], 0
            bounds = [str(b / 1e6) for b in histogram["bounds_us"]] + ["+Inf"]
            for bound, count in zip(bounds, histogram["counts"]):
                running += count
                cumulative.append((bound, running))
            family.add_metric([], cumulative, histogram["sum_us"] / 1e6)
            yield family

    @staticmethod
    def _namespaces(report: list[dict]):
        """Usage and limits by namespace (limits 0 = unlimited; "*" is the default's)."""
        families = [
            ("mooncaked_namespace_bytes", "Value bytes x replicas a namespace holds "
             "(reservations included)", "bytes"),
            ("mooncaked_namespace_objects", "Objects a namespace holds", "objects"),
            ("mooncaked_namespace_max_bytes", "A namespace's byte quota; 0 = unlimited",
             "max_bytes"),
            ("mooncaked_namespace_max_objects", "A namespace's object quota; 0 = unlimited",
             "max_objects"),
        ]
        for name, help_text, field in families:
            family = GaugeMetricFamily(name, help_text, labels=["namespace"])
            for row in report:
                if field.startswith("max_") or row["namespace"] != "*":
                    family.add_metric([row["namespace"]], row[field])
            yield family

    @staticmethod
    def _cluster(cluster):
        raft = cluster.raft
        core = raft.core
        yield GaugeMetricFamily("mooncaked_raft_term", "Current Raft term", value=core.term)
        yield GaugeMetricFamily("mooncaked_raft_is_leader", "1 on the leader, else 0",
                                value=int(raft.role.name == "LEADER"))
        yield GaugeMetricFamily("mooncaked_raft_commit_index", "Highest committed log index",
                                value=core.commit_index)
        yield GaugeMetricFamily("mooncaked_raft_applied_index", "Highest applied log index",
                                value=raft.applied_index)
        yield GaugeMetricFamily("mooncaked_raft_voters", "Voting members",
                                value=len(core.conf_state.voters))
        counters = [
            ("mooncaked_raft_proposals", "Log entries proposed on this node",
             raft.stats["proposals"]),
            ("mooncaked_raft_leader_changes", "Leaders this node has seen elected",
             raft.stats["elections_seen"]),
            ("mooncaked_raft_snapshots", "State machine snapshots taken",
             raft.stats["snapshots"]),
            ("mooncaked_raft_messages_dropped", "Raft messages not sent (peer unreachable)",
             raft.stats["messages_dropped"]),
            ("mooncaked_cluster_forwarded", "Metadata requests forwarded to the leader",
             cluster.stats["forwarded"]),
            ("mooncaked_cluster_replica_bytes_sent", "Value bytes written to other nodes",
             cluster.stats["replica_bytes_sent"]),
            ("mooncaked_cluster_replica_bytes_received", "Value bytes other nodes wrote here",
             cluster.stats["replica_bytes_received"]),
            ("mooncaked_cluster_replica_read_failovers", "Reads that moved to another replica",
             cluster.stats["replica_read_failovers"]),
            ("mooncaked_cluster_nodes_declared_down", "Nodes this leader declared down",
             cluster.stats["nodes_declared_down"]),
        ]
        repair = cluster.repair
        counters += [
            ("mooncaked_cluster_repair_objects", "Values this leader gave back missing replicas",
             repair.stats["objects_repaired"]),
            ("mooncaked_cluster_repair_replicas_added", "Replicas this leader's repair added",
             repair.stats["replicas_added"]),
            ("mooncaked_cluster_repair_bytes_copied", "Value bytes this leader's repair wrote",
             repair.stats["bytes_copied"]),
            ("mooncaked_cluster_repair_failures", "Repair copies that failed (tried again later)",
             repair.stats["failures"]),
        ]
        for name, help_text, value in counters:
            yield CounterMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily("mooncaked_cluster_repair_queued", "Values waiting for repair "
                                "on this leader (copies in progress included)",
                                value=len(repair.queue) + repair.in_progress)


def make_registry(daemon) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(daemon))
    return registry


class MetricsServer:
    """A minimal HTTP/1.0 server for GET /metrics (and /health), on the daemon's own loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.split()
            path = parts[1].decode("latin-1").split("?")[0] if len(parts) >= 2 else ""
            if parts[:1] == [b"GET"] and path == "/metrics":
                status, body = "200 OK", generate_latest(self._registry)
                content_type = "text/plain; version=0.0.4; charset=utf-8"
            elif parts[:1] == [b"GET"] and path == "/health":
                status, body, content_type = "200 OK", b"ok\n", "text/plain"
            else:
                status, body, content_type = "404 Not Found", b"not found\n", "text/plain"
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:  # a scrape must never take the daemon down
            log.exception("metrics request failed")
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
