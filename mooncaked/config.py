"""The daemon's configuration: every key, its default, unit and bounds, and the loader.

The dataclasses below are the schema. `mooncaked.toml` at the repository root documents the
same keys with the same defaults (a test checks they agree). Loading is strict: an unknown
section or key, a wrong type or an out-of-range value stops start-up with a message that names
the key and the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


class ConfigError(Exception):
    pass


# The environment variable that overrides [server] loop; it takes the same values.
LOOP_ENV = "MOONCAKED_LOOP"


def _key(default, minimum=None, maximum=None, choices=None, unit="", doc="", octal=False):
    return field(default=default, metadata={
        "min": minimum, "max": maximum, "choices": choices, "unit": unit, "doc": doc,
        "octal": octal})


@dataclass(frozen=True)
class NodeConfig:
    name: str = _key("", doc="node name; empty = the host name")


@dataclass(frozen=True)
class ServerConfig:
    tcp_host: str = _key("127.0.0.1", doc="TCP listen address")
    tcp_port: int = _key(50051, 0, 65535, doc="TCP listen port; 0 = any free port")
    unix_socket: str = _key("/run/mooncaked/mooncaked.sock",
                            doc="Unix socket path; empty = no Unix socket")
    max_connections: int = _key(1024, 1, 1 << 20, doc="open client connections at most")
    admin_connections: int = _key(4, 0, 64,
                                  doc="Unix socket connections taken beyond max_connections, "
                                  "for the administration methods (mooncakectl) only")
    max_header_bytes: int = _key(MIB, 256, 64 * MIB, unit="bytes", doc="largest frame header")
    max_payload_bytes: int = _key(GIB, 1, 0xFFFFFFFF, unit="bytes",
                                  doc="largest frame payload (value bytes of one request)")
    max_key_bytes: int = _key(4096, 1, 65536, unit="bytes", doc="longest key (UTF-8)")
    max_batch_keys: int = _key(8192, 1, 1 << 20, doc="keys in one batch request at most")
    max_puts_in_progress: int = _key(65536, 1, 1 << 24,
                                     doc="unfinished puts (all connections) at most")
    max_reserved_bytes_per_connection: int = _key(
        64 * MIB, 0, 1 << 40, unit="bytes",
        doc="segment space one local connection may hold reserved for its next puts; "
        "0 = no reservations")
    max_response_bytes_per_connection: int = _key(
        64 * MIB, 64 * 1024, 1 << 40, unit="bytes",
        doc="a connection's requests wait while more than this of its responses is unsent")
    hello_timeout_ms: int = _key(10_000, 1, 3_600_000, unit="ms",
                                 doc="a connection that has not said hello by then is closed")
    frame_timeout_ms: int = _key(30_000, 1, 3_600_000, unit="ms",
                                 doc="a connection whose half-sent frame (prefix, header or "
                                 "payload) receives no byte for this long is closed")
    payload_timeout_ms: int = _key(60_000, 1, 86_400_000, unit="ms",
                                   doc="a request's payload must arrive within this after its "
                                   "header (a put's: also within half of [store] "
                                   "put_start_release_timeout_ms), or the connection is closed")
    shutdown_grace_ms: int = _key(5000, 0, 3_600_000, unit="ms",
                                  doc="on SIGTERM, time given to in-flight requests")
    loop: str = _key("auto", choices=("auto", "uring", "asyncio"),
                     doc="event loop: the io_uring loop, stdlib asyncio, or auto (io_uring "
                     "when usable); $MOONCAKED_LOOP overrides")
    busy_poll_us: int = _key(0, 0, 10_000, unit="us",
                             doc="io_uring loop: poll for completions this long before "
                             "sleeping; for a daemon with CPUs of its own")
    fd_token_ttl_ms: int = _key(10_000, 1, 600_000, unit="ms",
                                doc="a segment token from hello must be redeemed for the "
                                "segment's file descriptor within this time")


@dataclass(frozen=True)
class SegmentsConfig:
    count: int = _key(1, 1, 256, doc="DRAM segments this node contributes")
    size_bytes: int = _key(GIB, 4096, 1 << 40, unit="bytes", doc="size of each segment")
    alignment_bytes: int = _key(64, 8, 2 * MIB, unit="bytes",
                                doc="allocation granularity (power of two)")
    max_allocations: int = _key(1 << 20, 1, 1 << 28, doc="live allocations per segment at most")
    shm_dir: str = _key("/dev/shm", doc="directory of the segments' shared-memory files")
    shm_mode: int = _key(0o600, 0, 0o777, octal=True,
                         doc="permission bits of the segment files (octal); never for "
                         "other users")
    numa_node: int = _key(-1, -1, 1023, doc="NUMA node the segments' pages are bound to; "
                          "-1 = the kernel's default policy")
    huge_pages: str = _key("off", choices=("off", "transparent", "hugetlbfs"),
                           doc="off; transparent = madvise(MADV_HUGEPAGE); hugetlbfs = shm_dir "
                           "is a hugetlbfs mount")
    prefault: bool = _key(False, doc="touch every page at start, so no request pays a page fault")
    share_with_local_clients: bool = _key(
        True, doc="local clients of namespaces without a pool of their own may map the shared "
        "segments (with [auth] on: only principals with a role on \"*\"); false = their values "
        "go through the socket")
    namespace_pools: str = _key(
        "", doc="namespaces with a memory pool of their own, comma-separated name=size_bytes: "
        "one memfd segment each, holding that namespace's objects alone, mapped only by its "
        "clients; empty = none")


@dataclass(frozen=True)
class StoreConfig:
    lease_ttl_ms: int = _key(10_000, 1, 3_600_000, unit="ms", doc="read lease length")
    put_start_discard_timeout_ms: int = _key(
        30_000, 1, 86_400_000, unit="ms",
        doc="an unfinished put older than this may be preempted by a new put of its key")
    put_start_release_timeout_ms: int = _key(
        600_000, 1, 86_400_000, unit="ms",
        doc="an unfinished put older than this is revoked and its space freed")
    soft_pin_ttl_ms: int = _key(1_800_000, 1, 86_400_000 * 365, unit="ms",
                                doc="default soft pin length")
    max_soft_pin_ttl_ms: int = _key(86_400_000, 1, 86_400_000 * 365, unit="ms",
                                    doc="longest soft pin a client may ask for")
    eviction_high_watermark_ratio: float = _key(0.9, 0.0, 1.0, unit="ratio",
                                                doc="evict when used/capacity exceeds this")
    eviction_ratio: float = _key(0.05, 0.0, 1.0, unit="ratio",
                                 doc="fraction of capacity one eviction run frees")
    eviction_interval_ms: int = _key(100, 1, 60_000, unit="ms",
                                     doc="period of the eviction and expiry sweep")
    allocation_strategy: str = _key("random", choices=("random", "free_ratio_first",
                                                       "local_first"),
                                    doc="how replicas pick segments; local_first = the "
                                    "writer's node first, then random")
    max_objects: int = _key(4_194_304, 1, 1 << 32, doc="objects (all namespaces) at most")


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = _key(False, doc="run as a member of a Raft cluster; off = a cluster of "
                         "one with no log on disk")
    node_id: int = _key(0, 0, 65535, doc="this node's id in the cluster, unique, 1-65535")
    peer_host: str = _key("127.0.0.1", doc="address the peer listener binds to")
    peer_port: int = _key(50151, 0, 65535, doc="peer listen port (Raft messages and replica "
                          "bytes); 0 = any free port")
    advertise_host: str = _key("", doc="host other nodes use to reach this one; empty = "
                               "peer_host (tcp_host for clients)")
    initial_members: str = _key("", doc="a new cluster's voters, comma-separated "
                                "id@host:peer_port; empty = a new cluster of this node")
    join: str = _key("", doc="host:peer_port of a member to join through; --join overrides")
    data_dir: str = _key("/var/lib/mooncaked", doc="directory of the Raft log and snapshots")
    fsync: str = _key("batch", choices=("batch", "none"),
                      doc="batch = one fdatasync per batch of log writes before anything that "
                      "depends on them is sent; none = never (tests and benchmarks only)")
    tick_ms: int = _key(100, 1, 10_000, unit="ms", doc="Raft tick period")
    election_ticks: int = _key(10, 2, 1000, doc="election timeout, in ticks (randomised up "
                               "to twice this)")
    heartbeat_ticks: int = _key(1, 1, 100, doc="leader heartbeat period, in ticks")
    read_mode: str = _key("lease", choices=("lease", "safe"),
                          doc="linearizable reads: lease = the leader's check-quorum lease; "
                          "safe = a heartbeat round per batch of reads")
    node_ttl_ms: int = _key(5000, 100, 3_600_000, unit="ms",
                            doc="a node silent this long is declared down: its replicas "
                            "leave reads and placement (repair copies them elsewhere)")
    node_return_grace_ms: int = _key(600_000, 0, 86_400_000, unit="ms",
                                     doc="how long the log keeps what a node declared down "
                                     "held, for its return with its memory (a partition, a "
                                     "pause); 0 = dropped at once")
    snapshot_entries: int = _key(10_000, 1, 1 << 30,
                                 doc="applied entries between state machine snapshots")
    max_pending_proposals: int = _key(10_000, 1, 1 << 24,
                                      doc="proposals waiting to commit at most")
    rpc_timeout_ms: int = _key(5000, 1, 600_000, unit="ms",
                               doc="a request to another node fails after this")
    data_connections: int = _key(4, 1, 64, doc="connections per peer for replica bytes")
    stripe_bytes: int = _key(4 * MIB, 4096, GIB, unit="bytes",
                             doc="values larger than this go over several data connections")
    get_staging_bytes: int = _key(64 * MIB, 0, 1 << 40, unit="bytes",
                                  doc="shared memory local clients map to receive gets of "
                                  "other nodes' replicas without a socket copy (get_staged); "
                                  "0 = off, values go through the socket")
    arena_bytes: int = _key(4 * MIB, 4096, GIB, unit="bytes",
                            doc="the leader takes segment space for puts in ranges of this "
                            "size (arenas), one log command per arena, and hands out parts "
                            "of them; a value over a quarter of it gets a range of its own")
    repair_bytes_per_s: int = _key(256 * MIB, 0, 1 << 40, unit="bytes/s",
                                   doc="the leader copies values that lost a replica with a "
                                   "node to other nodes, at most this fast; 0 = no repair")
    repair_concurrency: int = _key(4, 1, 1024, doc="values the leader copies at once when "
                                   "repairing replicas")
    secret_file: str = _key("", doc="file holding the cluster secret (owner-only, 16+ bytes): "
                            "peers prove they know it in the peer handshake; empty = none")


@dataclass(frozen=True)
class SsdConfig:
    enabled: bool = _key(False, doc="keep a disk tier on local SSD (README, \"SSD tier\")")
    directory: str = _key("/var/lib/mooncaked/ssd", doc="directory of the tier's data files "
                          "and ssd.meta; on the SSD, not on tmpfs (O_DIRECT is refused there)")
    capacity_bytes: int = _key(0, 0, 1 << 50, unit="bytes",
                               doc="disk space the tier uses, rounded down to whole regions; "
                               "0 = no disk tier")
    file_bytes: int = _key(GIB, 4096, 1 << 44, unit="bytes",
                           doc="size of each preallocated data file; a multiple of "
                           "region_bytes")
    region_bytes: int = _key(64 * MIB, 8192, 1 << 34, unit="bytes",
                             doc="unit of append and reclaim; a multiple of block_bytes")
    block_bytes: int = _key(4096, 4096, MIB, unit="bytes",
                            doc="I/O alignment and record granularity (power of two); a "
                            "record's header and namespace + key fit one block")
    queue_depth: int = _key(32, 1, 4096, doc="disk reads and writes in flight at most")
    bounce_bytes: int = _key(64 * MIB, 4096, 1 << 40, unit="bytes",
                             doc="aligned staging memory for record headers, values' last "
                             "partial blocks and values whose memory is not page-aligned")
    reclaim_free_regions: int = _key(2, 1, 1 << 20,
                                     doc="reclaim the oldest region when fewer regions "
                                     "than this are free")
    reformat_on_mismatch: bool = _key(False, doc="a directory formatted with other sizes is "
                                      "erased and formatted anew instead of refused at start")
    offload_watermark_ratio: float = _key(0.7, 0.0, 1.0, unit="ratio",
                                          doc="above this share of DRAM used, the coldest "
                                          "objects are written to disk in the background, so "
                                          "that eviction frees their DRAM without losing them")
    offload_bytes_in_flight: int = _key(256 * MIB, 4096, 1 << 40, unit="bytes",
                                        doc="value bytes being written to disk at most "
                                        "(each copied out of DRAM while written)")
    promote: bool = _key(True, doc="a value read from disk often enough gets a DRAM replica "
                         "again")
    promote_threshold: int = _key(2, 1, 15, doc="disk hits (Count-Min estimate) that promote "
                                  "a value to DRAM")
    promote_sketch_width: int = _key(65536, 64, 1 << 26,
                                     doc="counters per row of the Count-Min admission sketch "
                                     "(4 rows of 4-bit counters, halved every 10 x width "
                                     "hits)")
    write_through: bool = _key(False, doc="every put is written to disk at its end as well; "
                               "a put's config (write_through) overrides it")


@dataclass(frozen=True)
class TLSConfig:
    enabled: bool = _key(False, doc="TLS on the TCP listener and, in a cluster, mutual TLS on "
                         "the peer links; the Unix socket stays plain")
    cert_file: str = _key("", doc="this node's certificate (PEM, chain after it)")
    key_file: str = _key("", doc="its private key (PEM), readable by the daemon's user alone")
    ca_file: str = _key("", doc="CA certificates (PEM) that client certificates, and in a "
                        "cluster the other nodes' certificates, must be signed by")
    require_client_cert: bool = _key(False, doc="refuse TCP clients without a certificate "
                                     "signed by ca_file")
    handshake_timeout_ms: int = _key(10_000, 1, 600_000, unit="ms",
                                     doc="a TLS handshake not done in this time closes the "
                                     "connection")


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = _key(True, doc="serve Prometheus metrics over HTTP")
    host: str = _key("127.0.0.1", doc="metrics listen address")
    port: int = _key(9781, 0, 65535, doc="metrics listen port; 0 = any free port")


@dataclass(frozen=True)
class TransferConfig:
    enabled: bool = _key(True, doc="serve transfer segments (Mooncake's TransferEngine API) "
                         "to local clients on the Unix socket; nothing listens until a client "
                         "opens one")
    bind_host: str = _key("", doc="address a segment's handshake and data listeners bind to; "
                          "empty = the address the client advertises (its local_hostname)")
    port_min: int = _key(0, 0, 65535, doc="first port of the range segment listeners take; "
                         "0 (with port_max 0) = any free port")
    port_max: int = _key(0, 0, 65535, doc="last port of that range; 0 = any free port")
    max_segments: int = _key(64, 1, 4096, doc="transfer segments (clients) open at most")
    staging_bytes: int = _key(MIB, 4096, GIB, unit="bytes",
                              doc="staging buffer per data connection and per request piece "
                              "between a client's memory and the network")
    max_requests_per_segment: int = _key(65536, 1, 1 << 24,
                                         doc="requests a segment holds (in flight or not "
                                         "yet freed) at most")
    max_in_flight_requests: int = _key(256, 1, 1 << 16,
                                       doc="requests of one segment on the wire at once")
    connections_per_peer: int = _key(4, 1, 256,
                                     doc="data connections one segment opens to one peer")
    max_data_connections: int = _key(1024, 1, 1 << 16,
                                     doc="incoming data connections per segment at most")
    connect_timeout_ms: int = _key(5000, 1, 600000, unit="ms",
                                   doc="connecting to a peer's handshake or data port")
    request_timeout_ms: int = _key(30000, 1, 3600000, unit="ms",
                                   doc="one request, plus 1 ns per byte (as Mooncake's)")
    receive_timeout_ms: int = _key(30000, 1, 3600000, unit="ms",
                                   doc="a peer's request that stops arriving part-way is "
                                   "dropped after this")


@dataclass(frozen=True)
class AuthConfig:
    credentials_file: str = _key("", doc="principals, their secrets' verifiers and roles "
                                 "(mode 600, owned by the daemon's user); empty = no "
                                 "authentication: every client may do everything")


@dataclass(frozen=True)
class LogConfig:
    level: str = _key("info", choices=("debug", "info", "warning", "error"), doc="log level")


@dataclass(frozen=True)
class NamespaceQuotaConfig:
    """One `[namespaces.<name>]` table: a namespace's quota (README, "Quotas")."""
    max_bytes: int = _key(0, 0, 1 << 60, unit="bytes",
                          doc="value bytes x replicas the namespace may hold; 0 = unlimited")
    max_objects: int = _key(0, 0, 1 << 40, doc="objects the namespace may hold; 0 = unlimited")


# The `[namespaces]` name that stands for every namespace without a table of its own.
DEFAULT_NAMESPACE_QUOTA = "*"
_NAMESPACE_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                  "0123456789._:/-")


@dataclass(frozen=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    segments: SegmentsConfig = field(default_factory=SegmentsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # Quotas by namespace name ("*": the default), from the `[namespaces.<name>]` tables.
    namespaces: dict[str, NamespaceQuotaConfig] = field(default_factory=dict)
    source: str = ""

    @property
    def node_name(self) -> str:
        return self.node.name or socket.gethostname()

    def __post_init__(self) -> None:
        # The loop override is part of the effective configuration: a bad value must stop
        # start-up and --check-config here, not surface later as a loop choice error.
        _check_environment(self.source or "<config>")

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Every section and key. Octal keys (shm_mode) are strings such as "0o600", as
        mooncaked.toml writes them, so --check-config and `mooncakectl config show` print
        the mode the way it is configured."""
        result = {}
        for section in sections():
            values = getattr(self, section.name)
            octal = {f.name for f in dataclasses.fields(values) if f.metadata["octal"]}
            result[section.name] = {name: f"0o{value:o}" if name in octal else value
                                    for name, value in dataclasses.asdict(values).items()}
        result["namespaces"] = {name: dataclasses.asdict(quota)
                                for name, quota in self.namespaces.items()}
        return result


def sections() -> list[dataclasses.Field]:
    """The sections of one table of keys each (`[namespaces]` holds a table per namespace,
    and is read by `_namespaces`)."""
    return [f for f in dataclasses.fields(Config) if f.name not in ("source", "namespaces")]


def _check_environment(path: str) -> None:
    value = os.environ.get(LOOP_ENV)
    if not value:  # unset or empty: [server] loop applies (as in io/loops.py)
        return
    choices = {f.name: f for f in dataclasses.fields(ServerConfig)}["loop"].metadata["choices"]
    if value.strip().lower() not in choices:
        raise ConfigError(f"environment variable {LOOP_ENV}={value!r} (which overrides "
                          f"[server] loop in {path}) is not one of {', '.join(choices)}; "
                          f"unset it to use [server] loop")


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _check_value(path: str, section: str, key: str, spec: dataclasses.Field, value: Any) -> Any:
    where = f"{path}: [{section}] {key}"
    expected = _TYPES[spec.type]
    if expected is float and type(value) is int:
        try:
            value = float(value)
        except OverflowError:  # TOML integers have no size limit
            raise ConfigError(f"{where} = {value} is too large for a number") from None
    if type(value) is not expected:
        raise ConfigError(f"{where} must be {expected.__name__}, not {type(value).__name__}")
    if expected is float and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {value!r}")
    meta = spec.metadata
    if meta["octal"]:
        _check_octal(where, value, meta["min"], meta["max"])
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{where} = {value!r} is not one of {', '.join(meta['choices'])}")
    if meta["min"] is not None and value < meta["min"]:
        raise ConfigError(f"{where} = {value!r} is below the minimum {meta['min']}")
    if meta["max"] is not None and value > meta["max"]:
        raise ConfigError(f"{where} = {value!r} is above the maximum {meta['max']}")
    return value


def _check_octal(where: str, value: int, minimum: int, maximum: int) -> None:
    """Bounds of a permission mode, said in octal. A decimal literal such as 600 is the
    usual mistake (TOML reads it as decimal 600 = 0o1130): suggest the 0o literal meant."""
    if value > maximum:
        message = f"{where} = {value} (0o{value:o}) is above the maximum 0o{maximum:o}"
    elif value < minimum:
        message = f"{where} = {value} is below the minimum 0o{minimum:o}"
    else:
        return
    message += "; a mode is octal, and TOML reads it as octal only with the 0o prefix"
    digits = str(value)
    if set(digits) <= set("01234567") and minimum <= int(digits, 8) <= maximum:
        message += f" (for mode {digits}, write 0o{digits})"
    raise ConfigError(message)


def from_dict(data: dict[str, Any], path: str = "<config>") -> Config:
    known = {s.name: s for s in sections()}
    built = {}
    data = dict(data)
    if "namespaces" in data:
        built["namespaces"] = _namespaces(data.pop("namespaces"), path)
    for section_name, table in data.items():
        if section_name not in known and not isinstance(table, dict):
            # `size_bytes = 1` above every [section] header: a key, not a section.
            owners = [s for s, f in known.items() if section_name in
                      {k.name for k in dataclasses.fields(f.default_factory)}]
            where = (f"; it belongs in [{'] or ['.join(owners)}]" if owners
                     else " and no section has such a key")
            raise ConfigError(f"{path}: key {section_name} is outside any section (above the "
                              f"first [section] header){where}")
        if section_name not in known:
            raise ConfigError(f"{path}: unknown section [{section_name}] "
                              f"(known: {', '.join(known)}, namespaces)")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section_name}] must be a table")
        section_type = known[section_name].default_factory
        specs = {f.name: f for f in dataclasses.fields(section_type)}
        values = {}
        for key, value in table.items():
            if key not in specs:
                raise ConfigError(f"{path}: unknown key [{section_name}] {key} "
                                  f"(known: {', '.join(specs)})")
            values[key] = _check_value(path, section_name, key, specs[key], value)
        built[section_name] = section_type(**values)
    config = Config(**built, source=path)
    _check_relations(config, path)
    return config


def _namespaces(value: Any, path: str) -> dict[str, NamespaceQuotaConfig]:
    """The `[namespaces.<name>]` tables: max_bytes and max_objects of each namespace."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: namespaces must be tables [namespaces.<name>], each with "
                          "max_bytes and max_objects")
    specs = {f.name: f for f in dataclasses.fields(NamespaceQuotaConfig)}
    quotas = {}
    for name, table in value.items():
        section = f'namespaces."{name}"'
        if name != DEFAULT_NAMESPACE_QUOTA and not (
                1 <= len(name) <= 255 and set(name) <= _NAMESPACE_CHARACTERS):
            raise ConfigError(f"{path}: [{section}]: {name!r} is not a namespace (1-255 "
                              f"characters of [A-Za-z0-9._:/-]) nor {DEFAULT_NAMESPACE_QUOTA!r} "
                              "(the default of every other namespace)")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table with max_bytes and "
                              "max_objects")
        values = {}
        for key, item in table.items():
            if key not in specs:
                raise ConfigError(f"{path}: unknown key [{section}] {key} "
                                  f"(known: {', '.join(specs)})")
            values[key] = _check_value(path, section, key, specs[key], item)
        quotas[name] = NamespaceQuotaConfig(**values)
    return quotas


NAMESPACE_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,255}")


def parse_namespace_pools(text: str, minimum_bytes: int = 4096) -> dict[str, int]:
    """`a=1073741824,b=536870912` -> {"a": 1073741824, ...}; ValueError when malformed."""
    pools: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, size = (part.strip() for part in item.partition("="))
        if not equals or not NAMESPACE_NAME.fullmatch(name) or not size.isdigit():
            raise ValueError(f"{item!r} is not namespace=size_bytes")
        if name in pools:
            raise ValueError(f"namespace {name!r} is named twice")
        if not minimum_bytes <= int(size) <= 1 << 40:
            raise ValueError(f"{item!r}: size_bytes must be {minimum_bytes}-{1 << 40}")
        pools[name] = int(size)
    return pools


def _check_relations(config: Config, path: str) -> None:
    segments, store = config.segments, config.store
    if segments.shm_mode & 0o007:
        raise ConfigError(f"{path}: [segments] shm_mode = 0o{segments.shm_mode:o} gives other "
                          "users access to the segment files (every namespace's values); "
                          "use 0o600, or 0o660 for clients in the daemon's group")
    try:
        pools = parse_namespace_pools(segments.namespace_pools,
                                      max(4096, segments.alignment_bytes))
    except ValueError as exc:
        raise ConfigError(f"{path}: [segments] namespace_pools: {exc}") from None
    if pools and config.cluster.enabled:
        raise ConfigError(f"{path}: [segments] namespace_pools is not supported with "
                          "[cluster] enabled (a cluster moves values through the socket); "
                          "leave it empty")
    if segments.alignment_bytes & (segments.alignment_bytes - 1):
        raise ConfigError(f"{path}: [segments] alignment_bytes = {segments.alignment_bytes} "
                          "must be a power of two")
    if segments.size_bytes < segments.alignment_bytes:
        raise ConfigError(f"{path}: [segments] size_bytes must be at least alignment_bytes")
    if store.put_start_discard_timeout_ms > store.put_start_release_timeout_ms:
        raise ConfigError(f"{path}: [store] put_start_discard_timeout_ms must not exceed "
                          "put_start_release_timeout_ms")
    if store.soft_pin_ttl_ms > store.max_soft_pin_ttl_ms:
        raise ConfigError(f"{path}: [store] soft_pin_ttl_ms must not exceed max_soft_pin_ttl_ms")
    ssd = config.ssd
    if ssd.enabled and config.cluster.enabled:
        raise ConfigError(f"{path}: [ssd] enabled is not supported with [cluster] enabled yet "
                          "(a cluster node's reads cannot reach a value on another node's "
                          "disk); set it to false")
    if ssd.enabled and ssd.offload_watermark_ratio >= store.eviction_high_watermark_ratio:
        raise ConfigError(f"{path}: [ssd] offload_watermark_ratio = "
                          f"{ssd.offload_watermark_ratio} must be below [store] "
                          f"eviction_high_watermark_ratio = "
                          f"{store.eviction_high_watermark_ratio}: offloading runs ahead of "
                          "eviction, so that eviction finds objects already on disk")
    cluster = config.cluster
    if cluster.enabled:
        if cluster.node_id == 0:
            raise ConfigError(f"{path}: [cluster] node_id must be set (1-65535) when enabled")
        try:
            members = parse_members(cluster.initial_members)
        except ValueError as exc:
            raise ConfigError(f"{path}: [cluster] initial_members: {exc}") from None
        if members and cluster.node_id not in members:
            raise ConfigError(f"{path}: [cluster] initial_members must include node_id "
                              f"{cluster.node_id}")
        if cluster.heartbeat_ticks >= cluster.election_ticks:
            raise ConfigError(f"{path}: [cluster] heartbeat_ticks must be below election_ticks")
    transfer = config.transfer
    if (transfer.port_min == 0) != (transfer.port_max == 0) or \
            transfer.port_max - transfer.port_min < 1 and transfer.port_min:
        raise ConfigError(f"{path}: [transfer] port_min and port_max must both be 0 (any free "
                          "port) or a range of at least two ports (a segment takes two)")
    _check_ssd(config.ssd, path)
    _check_tls(config, path)


def _check_ssd(ssd: SsdConfig, path: str) -> None:
    if ssd.block_bytes & (ssd.block_bytes - 1):
        raise ConfigError(f"{path}: [ssd] block_bytes = {ssd.block_bytes} must be a power of two")
    if ssd.region_bytes % ssd.block_bytes or ssd.region_bytes < 2 * ssd.block_bytes:
        raise ConfigError(f"{path}: [ssd] region_bytes = {ssd.region_bytes} must be a multiple "
                          f"of block_bytes ({ssd.block_bytes}) and at least two blocks")
    if ssd.file_bytes % ssd.region_bytes:
        raise ConfigError(f"{path}: [ssd] file_bytes = {ssd.file_bytes} must be a multiple of "
                          f"region_bytes ({ssd.region_bytes})")
    if ssd.bounce_bytes < ssd.block_bytes:
        raise ConfigError(f"{path}: [ssd] bounce_bytes must be at least block_bytes")
    if ssd.enabled:
        if not ssd.directory:
            raise ConfigError(f"{path}: [ssd] enabled needs directory")
        regions = ssd.capacity_bytes // ssd.region_bytes
        if regions <= ssd.reclaim_free_regions:
            raise ConfigError(f"{path}: [ssd] capacity_bytes = {ssd.capacity_bytes} holds "
                              f"{regions} regions of {ssd.region_bytes} bytes; enabled needs "
                              f"more than reclaim_free_regions ({ssd.reclaim_free_regions})")


def _check_tls(config: Config, path: str) -> None:
    """The files [tls] and [cluster] secret_file name: present, readable, keys private, and
    usable (a certificate and its key, CA certificates)."""
    from mooncaked import tls as tls_module
    tls, cluster = config.tls, config.cluster
    try:
        if cluster.secret_file:
            tls_module.read_secret(cluster.secret_file)
        if not tls.enabled:
            return
        if not tls.cert_file or not tls.key_file:
            raise ConfigError(f"{path}: [tls] enabled needs cert_file and key_file")
        if tls.require_client_cert and not tls.ca_file:
            raise ConfigError(f"{path}: [tls] require_client_cert needs ca_file (the CA that "
                              "signs client certificates)")
        if cluster.enabled and not tls.ca_file:
            raise ConfigError(f"{path}: [tls] in a cluster needs ca_file (the CA that signs "
                              "every node's certificate: peer links use mutual TLS)")
        tls_module.check_config(tls)
    except tls_module.TLSSetupError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_members(text: str) -> dict[int, str]:
    """`1@host:port,2@host:port` -> {1: "host:port", 2: ...}; ValueError when malformed."""
    members: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        node_id, at, address = item.partition("@")
        host, colon, port = address.rpartition(":")
        if not at or not colon or not host or not node_id.isdigit() or not port.isdigit():
            raise ValueError(f"{item!r} is not id@host:port")
        if not 1 <= int(node_id) <= 65535 or int(node_id) in members:
            raise ValueError(f"{item!r}: ids must be unique, 1-65535")
        members[int(node_id)] = address
    return members


def load(path: str | os.PathLike) -> Config:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the whole file first
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 at byte {exc.start}") from None
    return from_dict(data, path)
