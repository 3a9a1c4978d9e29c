"""mooncakectl: the admin command line for a running mooncaked.

This file owns the CLI: its options, its commands, its two output formats and its exit codes.
It talks to the daemon only through `BlockingClient` and the administration methods of
wire/PROTOCOL.md section 5.3.

    mooncakectl [-a ADDRESS] [-n NAMESPACE] [-o table|json] [--tls-ca FILE
                [--tls-cert FILE --tls-key FILE]] COMMAND

    status                       the daemon's state
    segments                     each segment's size and usage
    tiers                        DRAM and disk tier usage, offload and promotion, rates
    objects ls [--namespace NS] [--prefix P] [--regex R] [--limit N]
    objects stat KEY
    objects rm KEY [--force]
    config show                  the effective configuration
    quota ls                     each namespace's usage and limits
    quota set NS [--max-bytes N] [--max-objects N]   set a namespace's limits (NS "*": default)
    cluster status               this node's view of the cluster: role, leader, term, log
    cluster members              the nodes: id, name, voter / learner, up, segments, kept
    cluster add ID HOST:PORT     add a node (as a learner, promoted once caught up)
    cluster remove ID            remove a node from the cluster
    cluster transfer-leader ID   hand leadership to another voter
    cluster drain ID             move objects held only by the node elsewhere, then remove it
    cluster settings [--max-objects N] [--put-start-discard-timeout-ms N]
        [--put-start-release-timeout-ms N] [--allocation-strategy S]
                                 the cluster's [store] settings (from its log); options change
    auth add-principal NAME ...  write the credentials file (mooncaked/ctl_auth.py)

Credentials (a daemon with `[auth] credentials_file`): `--principal NAME` and `--secret-file
FILE`, else $MOONCAKED_PRINCIPAL with $MOONCAKED_SECRET or $MOONCAKED_SECRET_FILE. Without any,
a Unix socket connection is the principal the daemon maps the user's uid to.

`--address` accepts `unix:PATH`, `/PATH` or `HOST:PORT` (default: $MOONCAKED_ADDRESS, else
`unix:/run/mooncaked/mooncaked.sock`). `-n/--namespace` is the namespace the connection is
bound to (default `default`): `objects stat` and `objects rm` act on its keys. `objects ls`
lists every namespace (a NAMESPACE column says which) unless `objects ls --namespace NS`, or an
explicit `-n NS`, restricts it to one. `--version` prints the package version. `--tls-ca FILE`
(or $MOONCAKED_TLS_CA) speaks TLS to a HOST:PORT address, verifying the daemon's certificate
against FILE and its host name; `--tls-cert`/`--tls-key` present a client certificate.

Output. `-o table` (the default) prints aligned columns under a header row, sizes in human
units (`64.0 MiB`). `-o json` prints JSON (indent 2, sorted keys) whose schema is stable:

- `status`: the daemon's `status` map (PROTOCOL.md 5.3): `node_name`, `server_version`, `pid`,
  `uptime_s`, `loop`, `objects`, `used_bytes`, `capacity_bytes`, `connections`, `leases`,
  `puts_in_progress` (and whatever else the daemon adds);
- `segments`: the list of segment maps `{id, name, size_bytes, used_bytes, free_bytes,
  allocations, largest_free_bytes, shm_path}`;
- `tiers`: the daemon's `status` `tiers` map (PROTOCOL.md 5.3: `dram`, `ssd`, `offload`,
  `promotion`, `eviction`) and `rates_per_s` (counts per second between two samples
  `--interval` apart; empty with `--interval 0`);
- `objects ls`: a list of object maps `{namespace, key, size_bytes, state, replicas:
  [{segment_id, offset}], lease_expires_in_ms, soft_pin_expires_in_ms, hard_pin,
  created_ms_ago}`, sorted by (namespace, key);
- `objects stat`: one object map;
- `objects rm`: `{"namespace": ..., "key": ..., "removed": true}`;
- `config show`: the configuration as a map of sections;
- `quota ls`: a list of `{namespace, bytes, objects, max_bytes, max_objects, own_quota}` (the
  daemon's `quota_list`, PROTOCOL.md 5.3; limits 0 = unlimited; the `*` row is the default of
  namespaces without a quota of their own); `quota set`: `{"namespace": NS, "max_bytes": N,
  "max_objects": N}` as set;
- `cluster status`: the node's `cluster` map (PROTOCOL.md 5.4); `cluster members`: a list of
  `{node_id, name, role, up, client_address, peer_address, segments}`; `cluster add`, `remove`,
  `transfer-leader`: `{"node_id": ID, "done": true}`; `cluster drain`: `{"node_id": ID,
  "moved": N, "dropped": N}`; `cluster settings`: `{max_objects, put_start_discard_timeout_ms,
  put_start_release_timeout_ms, allocation_strategy}` in force (with `from_log` when shown).

Sizes are integers (bytes) in JSON. `shm_mode` is an octal string (`"0o600"`) in both formats.

Exit codes: 0 success; 1 an error: the daemon cannot be reached (`mooncakectl: cannot connect
to ADDRESS: REASON`) or it answered with an error (`mooncakectl: CODE_NAME (CODE): MESSAGE`);
2 a usage error (unknown command or option, missing argument, bad option value). `objects rm`
of a key with a read lease fails with OBJECT_HAS_LEASE and says that `--force` removes it.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import ssl
import time
from typing import Any, Iterator

import click

from mooncaked import __version__, tls
from mooncaked import ctl_auth
from mooncaked.client import auth as client_auth
from mooncaked.client.blocking import BlockingClient, parse_address
from mooncaked.errors import ErrorCode, MooncakedError, code_name

DEFAULT_ADDRESS = "unix:/run/mooncaked/mooncaked.sock"
ADDRESS_ENV = "MOONCAKED_ADDRESS"
CLIENT_NAME = "mooncakectl"
DEFAULT_LIST_LIMIT = 1000
ALL_NAMESPACES = "*"


class CtlError(click.ClickException):
    """An error that ends the command with exit code 1 and one line on stderr."""

    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"mooncakectl: {self.format_message()}", err=True)


class Settings:
    def __init__(self, address: str, namespace: str, output: str,
                 namespace_given: bool = False, principal: str | None = None,
                 secret_file: str | None = None) -> None:
        self.address = address
        self.namespace = namespace
        self.output = output
        self.namespace_given = namespace_given  # -n on the command line, not the default
        self.tls_files: tuple[str | None, str | None, str | None] = (None, None, None)
        # Credentials: these, else $MOONCAKED_PRINCIPAL and $MOONCAKED_SECRET(_FILE).
        self.principal = principal
        self.secret_file = secret_file


# -- formatting ---------------------------------------------------------------------------------

def human_bytes(count: int) -> str:
    """`512 B`, `1.5 KiB`, `64.0 MiB`, ..."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns, two spaces apart, under a header row."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in cells)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if value is True:
        return "true"
    if value is False:
        return "false"
    return str(value)


def _field_value(name: str, value: Any) -> Any:
    """How a field of a status, object or config map reads in a table."""
    if name.endswith("_bytes") and type(value) is int:
        return human_bytes(value)
    if name == "shm_mode" and type(value) is int:  # a daemon that sends the mode as a number
        return f"0o{value:o}"
    return value


def _flatten(mapping: dict, prefix: str = "") -> list[list[Any]]:
    """[[dotted.name, value], ...] for a map whose values may be maps."""
    rows = []
    for name, value in mapping.items():
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{prefix}{name}."))
        else:
            rows.append([f"{prefix}{name}", _field_value(name, value)])
    return rows


def _replicas(replicas: list[dict]) -> str:
    return ",".join(f"{r['segment_id']}@{r['offset']}" for r in replicas) or "-"


def _pin(obj: dict) -> str:
    if obj.get("hard_pin"):
        return "hard"
    if obj.get("soft_pin_expires_in_ms") is not None:
        return "soft"
    return "-"


def emit(settings: Settings, data: Any, table: str) -> None:
    if settings.output == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        click.echo(table)


# -- the connection -----------------------------------------------------------------------------

@contextlib.contextmanager
def connected(settings: Settings) -> Iterator[BlockingClient]:
    """A client bound to the settings' namespace, closed on the way out; errors become CtlError."""
    try:
        credentials = client_auth.resolve(settings.principal, secret_file=settings.secret_file)
    except (OSError, ValueError) as exc:
        raise CtlError(f"credentials: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        client = BlockingClient.connect(
            settings.address, namespace=settings.namespace, client_name=CLIENT_NAME,
            map_segments=False, tls=_tls_context(settings),
            principal=credentials and credentials.principal,
            secret=credentials and credentials.secret)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise CtlError(f"cannot connect to {settings.address}: {reason}") from None
    except MooncakedError as exc:
        raise CtlError(f"cannot connect to {settings.address}: {_daemon_error(exc)}") from None
    try:
        yield client
    except MooncakedError as exc:
        raise CtlError(_daemon_error(exc)) from None
    except OSError as exc:
        raise CtlError(f"connection to {settings.address} failed: "
                       f"{exc.strerror or exc}") from None
    finally:
        client.close()


def _tls_context(settings: Settings):
    """The --tls-* files as a client context; False (plain TCP) without --tls-ca."""
    ca_file, cert_file, key_file = settings.tls_files
    if not ca_file:
        if cert_file or key_file:
            raise CtlError("--tls-cert and --tls-key need --tls-ca")
        return False
    try:
        return tls.client_context(ca_file, cert_file, key_file)
    except (tls.TLSSetupError, OSError, ssl.SSLError) as exc:
        raise CtlError(f"TLS settings: {exc}") from None


def _daemon_error(exc: MooncakedError) -> str:
    return f"{code_name(exc.code)} ({exc.code}): {exc.message}"


# -- options ------------------------------------------------------------------------------------

def _check_address(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        parse_address(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="mooncakectl",
                      message="%(prog)s %(version)s")
@click.option("-a", "--address", envvar=ADDRESS_ENV, default=DEFAULT_ADDRESS,
              show_default=True, callback=_check_address,
              help=f"Daemon address: unix:PATH, /PATH or HOST:PORT (env {ADDRESS_ENV}).")
@click.option("-n", "--namespace", default="default", show_default=True,
              help="Namespace of the connection; objects commands see its keys.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="Output format; json has a stable schema.")
@click.option("--tls-ca", envvar=tls.ENV_CA, default=None, metavar="FILE",
              help=f"Speak TLS over TCP, trusting this CA file (env {tls.ENV_CA}); the "
              "daemon's certificate and host name are verified.")
@click.option("--tls-cert", envvar=tls.ENV_CERT, default=None, metavar="FILE",
              help=f"Client certificate, for a daemon that requires one (env {tls.ENV_CERT}).")
@click.option("--tls-key", envvar=tls.ENV_KEY, default=None, metavar="FILE",
              help=f"The client certificate's key (env {tls.ENV_KEY}).")
@click.option("--principal", default=None,
              help=f"Authenticate as this principal (env {client_auth.PRINCIPAL_ENV}).")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help=f"The principal's secret, in a file (env {client_auth.SECRET_FILE_ENV}, or "
              f"the secret itself in {client_auth.SECRET_ENV}).")
@click.pass_context
def cli(ctx: click.Context, address: str, namespace: str, output: str, tls_ca: str | None,
        tls_cert: str | None, tls_key: str | None, principal: str | None,
        secret_file: str | None) -> None:
    """Inspect and administer a running mooncaked."""
    # No connection here: click runs this before it checks the subcommand's own arguments.
    given = ctx.get_parameter_source("namespace") is not click.core.ParameterSource.DEFAULT
    ctx.obj = Settings(address, namespace, output, given, principal, secret_file)
    ctx.obj.tls_files = (tls_ca, tls_cert, tls_key)


cli.add_command(ctl_auth.auth)


@cli.command()
@click.pass_obj
def status(settings: Settings) -> None:
    """The daemon's state: node, version, objects, usage, connections."""
    with connected(settings) as client:
        data = client.status()
    emit(settings, data, format_table(["FIELD", "VALUE"], _flatten(data)))


_TIER_RATES = (("offload", "done", "offloads/s"), ("offload", "bytes", "offload bytes/s"),
               ("promotion", "done", "promotions/s"), ("dram", "hits", "DRAM hits/s"),
               ("ssd", "hits", "SSD hits/s"), ("ssd", "evictions", "SSD evictions/s"))


@cli.command()
@click.option("--interval", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between the two samples the rates are taken from; 0 = no rates.")
@click.pass_obj
def tiers(settings: Settings, interval: float) -> None:
    """Usage of DRAM and the disk tier, offload and promotion queues, and their rates."""
    with connected(settings) as client:
        first = client.status().get("tiers")
        if first is None:
            raise CtlError("the daemon has no disk tier ([ssd] enabled is false)")
        data = first
        if interval:
            time.sleep(interval)
            data = client.status()["tiers"]
    rates = {label: round((data[block][name] - first[block][name]) / interval, 1)
             for block, name, label in _TIER_RATES} if interval else {}
    data = {**data, "rates_per_s": rates}
    dram, ssd = data["dram"], data["ssd"]
    rows = [["dram", human_bytes(dram["capacity_bytes"]), human_bytes(dram["used_bytes"]),
             dram["objects"], dram["hits"]],
            ["ssd", human_bytes(ssd.get("capacity_bytes", 0)),
             human_bytes(ssd.get("used_bytes", 0)), ssd["objects"], ssd["hits"]]]
    offload, promotion = data["offload"], data["promotion"]
    lines = [format_table(["TIER", "CAPACITY", "USED", "OBJECTS", "HITS"], rows), "",
             f"offload: {offload['in_flight']} in flight ({human_bytes(offload['in_flight_bytes'])})"
             f", {offload['queued_write_through']} write-through queued, {offload['done']} done"
             f" ({human_bytes(offload['bytes'])}), {offload['failed']} failed, "
             f"{offload['disk_full']} refused (disk full)"
             + (", disk FULL" if ssd.get("full") else ""),
             f"promotion: {promotion['done']} done ({human_bytes(promotion['bytes'])}), "
             f"threshold {promotion['threshold']}" + ("" if promotion["enabled"] else " (off)"),
             f"eviction: {data['eviction']['to_disk']} kept on disk, "
             f"{data['eviction']['without_offload']} lost (no disk copy); "
             f"{ssd['evictions']} evicted from disk, {ssd['disk_only_objects']} on disk only"]
    if rates:
        lines.append("rates: " + ", ".join(f"{value} {label}" for label, value in rates.items()))
    emit(settings, data, "\n".join(lines))


@cli.command()
@click.pass_obj
def segments(settings: Settings) -> None:
    """Each segment's size and usage."""
    with connected(settings) as client:
        data = client.segment_report()
    rows = [[s["id"], s["name"], human_bytes(s["size_bytes"]), human_bytes(s["used_bytes"]),
             human_bytes(s["free_bytes"]), s["allocations"],
             human_bytes(s["largest_free_bytes"]), s["shm_path"]] for s in data]
    emit(settings, data, format_table(
        ["ID", "NAME", "SIZE", "USED", "FREE", "ALLOCATIONS", "LARGEST_FREE", "SHM_PATH"], rows))


@cli.group()
def objects() -> None:
    """List, inspect and remove objects."""


@objects.command("ls")
@click.option("--namespace", "only_namespace", default=None, metavar="NS",
              help="Only objects of this namespace (default: every namespace).")
@click.option("--prefix", default="", help="Only keys that start with this.")
@click.option("--regex", default=None, help="Only keys this Python regex matches (re.search).")
# Every namespace is the default now; the flag stays accepted so existing scripts still run.
@click.option("--all-namespaces", "-A", is_flag=True, hidden=True)
@click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIST_LIMIT,
              show_default=True, help="List at most this many objects.")
@click.pass_obj
def objects_ls(settings: Settings, only_namespace: str | None, prefix: str, regex: str | None,
               all_namespaces: bool, limit: int) -> None:
    """List objects of every namespace, or of one with --namespace (or -n before `objects`)."""
    if only_namespace is not None and all_namespaces:
        raise click.UsageError("--namespace and --all-namespaces exclude each other")
    if only_namespace is None and settings.namespace_given and not all_namespaces:
        only_namespace = settings.namespace
    if only_namespace == ALL_NAMESPACES:
        only_namespace = None
    if only_namespace is not None and not settings.namespace_given:
        # Bound to the namespace it lists: a principal with read on it may list it (listing
        # another namespace than the connection's needs admin on it).
        settings.namespace = only_namespace
    with connected(settings) as client:
        data = client.objects_list(prefix, regex, only_namespace or ALL_NAMESPACES, limit)
    data.sort(key=lambda o: (o["namespace"], o["key"]))
    if len(data) >= limit:
        click.echo(f"mooncakectl: showing {limit} objects (--limit {limit}); there may be more",
                   err=True)
    rows = [[o["namespace"], o["key"], human_bytes(o["size_bytes"]), o["state"],
             _replicas(o["replicas"]), o["lease_expires_in_ms"], _pin(o), o["created_ms_ago"]]
            for o in data]
    emit(settings, data, format_table(
        ["NAMESPACE", "KEY", "SIZE", "STATE", "REPLICAS", "LEASE_MS", "PIN", "AGE_MS"], rows))


@objects.command("stat")
@click.argument("key")
@click.pass_obj
def objects_stat(settings: Settings, key: str) -> None:
    """Show one object of the connection's namespace."""
    with connected(settings) as client:
        data = client.object_stat(key)
    rows = [[name, _replicas(value) if name == "replicas" else _field_value(name, value)]
            for name, value in data.items()]
    emit(settings, data, format_table(["FIELD", "VALUE"], rows))


@objects.command("rm")
@click.argument("key")
@click.option("--force", is_flag=True, help="Remove even if the object has a read lease.")
@click.pass_obj
def objects_rm(settings: Settings, key: str, force: bool) -> None:
    """Remove one object of the connection's namespace."""
    with connected(settings) as client:
        try:
            client.remove(key, force)
        except MooncakedError as exc:
            if exc.code != ErrorCode.OBJECT_HAS_LEASE:
                raise
            # A lease lasts seconds; say how to remove it now rather than leave the user to wait.
            raise CtlError(f"{_daemon_error(exc)}; `objects rm {shlex.quote(key)} --force` "
                           "removes it anyway (a reader copying it keeps its bytes until "
                           "its lease ends)") from None
    data = {"namespace": settings.namespace, "key": key, "removed": True}
    emit(settings, data, f"removed {key!r} from namespace {settings.namespace!r}")


@cli.group()
def config() -> None:
    """The daemon's configuration."""


@config.command("show")
@click.pass_obj
def config_show(settings: Settings) -> None:
    """The effective configuration, every section and key."""
    with connected(settings) as client:
        data = client.config_show()
    rows = [[section, name, _field_value(name, value)]
            for section, values in data.items() for name, value in values.items()]
    emit(settings, data, format_table(["SECTION", "KEY", "VALUE"], rows))


@cli.group()
def quota() -> None:
    """Namespace quotas: usage and limits (README, "Quotas")."""


def _limit(value: int) -> str:
    return "unlimited" if value == 0 else str(value)


@quota.command("ls")
@click.pass_obj
def quota_ls(settings: Settings) -> None:
    """Each namespace's bytes and objects, and its limits; `*` is the default's row."""
    with connected(settings) as client:
        data = client.call("quota_list")
    rows = [[q["namespace"], human_bytes(q["bytes"]), q["objects"],
             "unlimited" if q["max_bytes"] == 0 else human_bytes(q["max_bytes"]),
             _limit(q["max_objects"]), "own" if q["own_quota"] else "default"] for q in data]
    emit(settings, data, format_table(
        ["NAMESPACE", "BYTES", "OBJECTS", "MAX_BYTES", "MAX_OBJECTS", "QUOTA"], rows))


@quota.command("set")
@click.argument("namespace")
@click.option("--max-bytes", type=click.IntRange(min=0), default=None,
              help="Value bytes x replicas the namespace may hold; 0 = unlimited "
              "(default: unchanged).")
@click.option("--max-objects", type=click.IntRange(min=0), default=None,
              help="Objects the namespace may hold; 0 = unlimited (default: unchanged).")
@click.pass_obj
def quota_set(settings: Settings, namespace: str, max_bytes: int | None,
              max_objects: int | None) -> None:
    """Set the limits of NAMESPACE (`*`: of every namespace without its own quota).

    Puts that would pass a limit are refused with QUOTA_EXCEEDED; what is stored stays, and
    goes first when the store evicts. In a cluster the quota goes through the log."""
    if max_bytes is None and max_objects is None:
        raise click.UsageError("give --max-bytes, --max-objects or both")
    with connected(settings) as client:
        client.call("quota_set", namespace, max_bytes, max_objects)
        shown = next(q for q in client.call("quota_list") if q["namespace"] == namespace)
    data = {"namespace": namespace, "max_bytes": shown["max_bytes"],
            "max_objects": shown["max_objects"]}
    emit(settings, data, format_table(["FIELD", "VALUE"], _flatten(data)))


@cli.group()
def cluster() -> None:
    """Cluster membership and leadership (a node with [cluster] enabled)."""


def _cluster_status(client: BlockingClient) -> dict:
    data = client.call("cluster_status")
    if data is None:
        raise CtlError("this daemon is not a cluster member ([cluster] enabled = false)")
    return data


@cluster.command("status")
@click.pass_obj
def cluster_status(settings: Settings) -> None:
    """This node's view: role, leader, term, commit and applied index, voters, learners,
    replica repair (on the leader)."""
    with connected(settings) as client:
        data = _cluster_status(client)
    shown = {k: v for k, v in data.items() if k not in ("nodes", "raft")}
    emit(settings, data, format_table(["FIELD", "VALUE"], _flatten(shown)))


@cluster.command("members")
@click.pass_obj
def cluster_members(settings: Settings) -> None:
    """Every node the cluster knows: id, name, role, up, addresses, segments, and the
    replicas kept for a node declared down until it returns."""
    with connected(settings) as client:
        data = _cluster_status(client)
    voters, learners = set(data["voters"]), set(data["learners"])
    members = []
    known = {n["node_id"]: n for n in data["nodes"]}
    for node_id in sorted(voters | learners | set(known)):
        node = known.get(node_id, {})
        role = "voter" if node_id in voters else "learner" if node_id in learners else "none"
        if node_id == data["leader"]:
            role = "leader"
        members.append({"node_id": node_id, "name": node.get("name", ""), "role": role,
                        "up": node.get("up", False),
                        "client_address": node.get("client_address", ""),
                        "peer_address": node.get("peer_address", ""),
                        "segments": node.get("segments", 0),
                        "kept_replicas": node.get("kept_replicas", 0)})
    rows = [[m["node_id"], m["name"], m["role"], "yes" if m["up"] else "no",
             m["client_address"], m["peer_address"], m["segments"], m["kept_replicas"]]
            for m in members]
    emit(settings, members, format_table(
        ["ID", "NAME", "ROLE", "UP", "CLIENT_ADDRESS", "PEER_ADDRESS", "SEGMENTS",
         "KEPT_REPLICAS"], rows))


def _node_command(settings: Settings, method: str, params: list, node_id: int) -> None:
    with connected(settings) as client:
        result = client.call(method, *params)
    data = {"node_id": node_id, "done": True}
    if isinstance(result, dict):
        data.update(result)
    emit(settings, data, format_table(["FIELD", "VALUE"], _flatten(data)))


@cluster.command("add")
@click.argument("node_id", type=click.IntRange(1, 65535))
@click.argument("peer_address")
@click.pass_obj
def cluster_add(settings: Settings, node_id: int, peer_address: str) -> None:
    """Add node NODE_ID, whose peer listener is PEER_ADDRESS (host:port), as a learner.

    Start that node with `--join` (or [cluster] join) naming any member: it finds itself a
    member and catches up, and is promoted to voter once it has. (A node started with
    `--join` alone adds itself the same way.)"""
    _node_command(settings, "cluster_add", [node_id, peer_address], node_id)


@cluster.command("remove")
@click.argument("node_id", type=click.IntRange(1, 65535))
@click.pass_obj
def cluster_remove(settings: Settings, node_id: int) -> None:
    """Remove node NODE_ID: it leaves the Raft group and its replicas are dropped."""
    _node_command(settings, "cluster_remove", [node_id], node_id)


@cluster.command("transfer-leader")
@click.argument("node_id", type=click.IntRange(1, 65535))
@click.pass_obj
def cluster_transfer_leader(settings: Settings, node_id: int) -> None:
    """Hand leadership to voter NODE_ID."""
    _node_command(settings, "cluster_transfer_leader", [node_id], node_id)


@cluster.command("drain")
@click.argument("node_id", type=click.IntRange(1, 65535))
@click.pass_obj
def cluster_drain(settings: Settings, node_id: int) -> None:
    """Copy objects held only by NODE_ID to other nodes, then remove it."""
    _node_command(settings, "cluster_drain", [node_id], node_id)


@cluster.command("settings")
@click.option("--max-objects", type=click.IntRange(1), default=None)
@click.option("--put-start-discard-timeout-ms", type=click.IntRange(1), default=None)
@click.option("--put-start-release-timeout-ms", type=click.IntRange(1), default=None)
@click.option("--allocation-strategy", default=None,
              type=click.Choice(["random", "free_ratio_first", "local_first"]))
@click.pass_obj
def cluster_settings(settings: Settings, max_objects: int | None,
                     put_start_discard_timeout_ms: int | None,
                     put_start_release_timeout_ms: int | None,
                     allocation_strategy: str | None) -> None:
    """The cluster's [store] settings, from its log; with options, change them (every node
    follows; a node's own [store] values for these keys do not apply in a cluster)."""
    wanted = [max_objects, put_start_discard_timeout_ms, put_start_release_timeout_ms,
              allocation_strategy]
    with connected(settings) as client:
        if all(value is None for value in wanted):
            data = _cluster_status(client)["store_settings"]
        else:
            data = client.call("cluster_settings_set", *wanted)
    emit(settings, data, format_table(["FIELD", "VALUE"], _flatten(data)))


def main(argv: list[str] | None = None) -> None:
    """The console script: runs a command, exits 0, 1 (error) or 2 (usage)."""
    cli.main(args=argv, prog_name="mooncakectl")


if __name__ == "__main__":
    main()
