"""Tests of the Prometheus exposition (mooncaked/daemon/metrics.py), scraped from a real daemon.

Known traffic (puts, gets, a miss, an exists) is sent with BlockingClient, then GET /metrics is
parsed with prometheus_client's parser and each family is checked against that traffic: request
counts by method and result, payload bytes in and out, segment usage and capacity, leases, the
latency histogram, the object count, and eviction counters after filling a small daemon past its
high watermark. Also: naming rules, /health and 404 for other paths.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncaked.client.blocking import BlockingClient
from mooncaked.errors import ErrorCode, MooncakedError

SEGMENT_BYTES = 64 << 20  # the conftest default
VALUES = {"k/1": b"1" * 1000, "k/2": b"2" * 2000, "k/3": b"3" * 3000}
READ_KEYS = ["k/1", "k/2"]


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(daemon) -> tuple[str, dict]:
    """The exposition text, and its families by name."""
    status, text = http_get(daemon.metrics_port, "/metrics")
    assert status == 200
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def samples(families: dict, family: str, sample: str | None = None, **labels) -> list:
    """The samples of a family whose name is `sample` (default: the family's own name with
    `_total` for counters) and whose labels include `labels`."""
    found = families[family]
    if sample is None:
        sample = family + "_total" if found.type == "counter" else family
    return [s for s in found.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    matching = samples(families, family, sample, **labels)
    assert len(matching) == 1, (family, sample, labels, matching)
    return matching[0].value


@pytest.fixture
def traffic(daemon):
    """Three puts, two gets, one get of a missing key and one exists, over TCP."""
    with BlockingClient.connect(daemon.tcp_address) as client:
        for key, data in VALUES.items():
            assert client.put(key, data) is True
        for key in READ_KEYS:
            assert client.get(key) == VALUES[key]
        with pytest.raises(MooncakedError) as missing:
            client.get("no-such-key")
        assert missing.value.code == ErrorCode.OBJECT_NOT_FOUND
        assert client.exists("k/3") is True
    return daemon


def test_request_counters(traffic):
    _, families = scrape(traffic)
    requests = "mooncaked_requests"
    assert families[requests].type == "counter"
    assert value(families, requests, method="put", result="ok") == len(VALUES)
    assert value(families, requests, method="get", result="ok") == len(READ_KEYS)
    assert value(families, requests, method="get", result="OBJECT_NOT_FOUND") == 1
    assert value(families, requests, method="exists", result="ok") == 1
    assert value(families, requests, method="hello", result="ok") == 1
    assert samples(families, requests, method="put", result="OBJECT_NOT_FOUND") == []


def test_payload_bytes(traffic):
    _, families = scrape(traffic)
    payload = "mooncaked_payload_bytes"
    assert value(families, payload, direction="in") == sum(len(v) for v in VALUES.values())
    assert value(families, payload, direction="out") == sum(len(VALUES[k]) for k in READ_KEYS)


def test_segment_objects_and_lease_gauges(traffic):
    _, families = scrape(traffic)
    segment = "test-node/0"
    used = value(families, "mooncaked_segment_used_bytes", segment=segment)
    assert used >= sum(len(v) for v in VALUES.values())
    assert value(families, "mooncaked_segment_capacity_bytes", segment=segment) == SEGMENT_BYTES
    assert value(families, "mooncaked_objects") == len(VALUES)
    assert value(families, "mooncaked_leases") >= 1  # the gets leased k/1 and k/2 for 10 s
    with BlockingClient.connect(traffic.tcp_address) as client:
        report = client.segment_report()
        status = client.status()
    assert used == report[0]["used_bytes"]
    assert value(families, "mooncaked_objects") == status["objects"]


def test_connection_counters(traffic):
    _, families = scrape(traffic)
    accepted = value(families, "mooncaked_connections_accepted")
    assert accepted == 1  # the traffic fixture's one client
    with BlockingClient.connect(traffic.unix_address) as client:
        _, families = scrape(traffic)
        assert value(families, "mooncaked_connections_accepted") == accepted + 1
        assert value(families, "mooncaked_connections") == 1
        client.ping()


def test_request_duration_histogram(traffic):
    _, families = scrape(traffic)
    histogram = "mooncaked_request_duration_seconds"
    assert families[histogram].type == "histogram"
    gets = len(READ_KEYS) + 1  # the miss is a get too
    assert value(families, histogram, histogram + "_count", method="get") == gets
    assert value(families, histogram, histogram + "_count", method="put") == len(VALUES)
    assert value(families, histogram, histogram + "_sum", method="get") > 0
    for method in ("get", "put", "exists"):
        buckets = sorted(((float(s.labels["le"]), s.value) for s in
                          samples(families, histogram, histogram + "_bucket", method=method)))
        assert len(buckets) > 2
        assert buckets[-1][0] == math.inf
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), (method, buckets)  # cumulative: never decreasing
        assert counts[-1] == value(families, histogram, histogram + "_count", method=method)


def test_names_follow_prometheus_practice(traffic):
    text, families = scrape(traffic)
    assert families
    for name, family in families.items():
        assert name.startswith("mooncaked_"), name
        if family.type == "counter":
            assert family.samples, name
            for sample in family.samples:
                assert sample.name == name + "_total", sample
    sample_names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                    if line and not line.startswith("#")}
    assert all(name.startswith("mooncaked_") for name in sample_names), sample_names
    # "# TYPE x counter" names the family with or without _total, by prometheus_client version.
    counters = {line.split()[2].removesuffix("_total") for line in text.splitlines()
                if line.startswith("# TYPE ") and line.split()[3] == "counter"}
    assert {"mooncaked_requests", "mooncaked_payload_bytes", "mooncaked_evictions"} <= counters
    for name in counters:
        assert name + "_total" in sample_names, name
        assert name not in sample_names, name

def test_health_and_unknown_path(daemon):
    assert http_get(daemon.metrics_port, "/health") == (200, "ok\n")
    status, _ = http_get(daemon.metrics_port, "/no-such-path")
    assert status == 404
    status, _ = http_get(daemon.metrics_port, "/metrics/extra")
    assert status == 404


def test_eviction_counters(make_daemon):
    small = make_daemon(segments={"size_bytes": 1 << 20}, store={"lease_ttl_ms": 1})
    _, before = scrape(small)
    assert value(before, "mooncaked_evictions") == 0
    assert value(before, "mooncaked_evicted_objects") == 0
    value_bytes = 64 << 10
    puts = 2 * (1 << 20) // value_bytes  # twice the segment
    with BlockingClient.connect(small.tcp_address) as client:
        for i in range(puts):
            assert client.put(f"fill/{i}", bytes([i]) * value_bytes) is True
        status = client.status()
    _, families = scrape(small)
    assert value(families, "mooncaked_evicted_objects") > 0
    assert value(families, "mooncaked_evictions") > 0
    assert value(families, "mooncaked_evicted_bytes") >= value_bytes
    objects = value(families, "mooncaked_objects")
    assert objects < puts
    assert objects == status["objects"]
    # Every put was stored, so what is left plus what was evicted is what was put.
    assert objects + value(families, "mooncaked_evicted_objects") == puts
    assert value(families, "mooncaked_segment_capacity_bytes", segment="test-node/0") == 1 << 20
    assert value(families, "mooncaked_segment_used_bytes", segment="test-node/0") <= 1 << 20


def test_unknown_method_names_are_not_kept(daemon):
    """Request counters are kept per method: a method that does not exist is counted under
    one `unknown` label, so a client sending ever new names grows neither the daemon's memory
    nor the exposition."""
    from wire_helpers import connect, read_response, request_frame

    names = [f"no-such-method-{n}-" + "x" * 1000 for n in range(50)]
    with connect(daemon, "tcp", 10) as sock:
        # Before hello (HANDSHAKE_REQUIRED), then after it (UNKNOWN_METHOD).
        frames = [request_frame(msgid, name, []) for msgid, name in enumerate(names)]
        frames.append(request_frame(len(names), "hello", [{"protocol": 1}]))
        frames += [request_frame(len(names) + 1 + msgid, name, [])
                   for msgid, name in enumerate(names)]
        sock.sendall(b"".join(frames))
        for msgid in range(2 * len(names) + 1):
            answered, error, _, _ = read_response(sock)
            assert answered == msgid
            if msgid < len(names):
                assert error[0] == ErrorCode.HANDSHAKE_REQUIRED
            elif msgid > len(names):
                assert error[0] == ErrorCode.UNKNOWN_METHOD
    text, families = scrape(daemon)
    assert "no-such-method" not in text
    assert value(families, "mooncaked_requests", method="unknown",
                 result="HANDSHAKE_REQUIRED") == len(names)
    assert value(families, "mooncaked_requests", method="unknown",
                 result="UNKNOWN_METHOD") == len(names)
