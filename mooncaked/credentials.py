"""The credentials file (`[auth] credentials_file`): principals, their verifiers and roles.

TOML, one table per principal under `principals`:

    [principals.alice]
    salt = "3f1c..."            # hex, 16-64 bytes
    iterations = 600000         # PBKDF2 rounds
    stored_key = "9a0b..."      # hex, 32 bytes: SHA256(ClientKey), proto/scram.py
    server_key = "51e2..."      # hex, 32 bytes
    roles = { "llama-3" = "write", "*" = "read" }   # namespace (or "*": all) -> role
    uids = [1000]               # optional: Unix socket peers with these uids are alice
    gids = []                   # optional: ... or with these primary gids

The secret itself is never stored. A principal with `uids` / `gids` may leave out the four
verifier keys: it can then only be used over the Unix socket. `mooncakectl auth
add-principal` writes entries (this module's `render`); the daemon loads them with `load`,
which refuses a file that others can read or write or that another user owns.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass, field

from mooncaked.proto import scram

READ, WRITE, ADMIN = "read", "write", "admin"
ROLE_RANKS = {READ: 1, WRITE: 2, ADMIN: 3}
ALL_NAMESPACES = "*"
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._:/-]{1,255}")
MAX_ID = 0xFFFFFFFE  # uid_t / gid_t; -1 (0xFFFFFFFF) means "no id"

_VERIFIER_KEYS = ("salt", "iterations", "stored_key", "server_key")
_KEYS = set(_VERIFIER_KEYS) | {"roles", "uids", "gids"}


class CredentialsError(Exception):
    pass


@dataclass(frozen=True)
class Principal:
    name: str
    roles: dict  # namespace or "*" -> "read" | "write" | "admin"
    salt: bytes = b""  # empty: no secret, Unix socket peers (uids / gids) only
    iterations: int = 0
    stored_key: bytes = b""
    server_key: bytes = b""
    uids: tuple = ()
    gids: tuple = ()

    @property
    def has_secret(self) -> bool:
        return bool(self.stored_key)

    def __post_init__(self) -> None:
        # Ranks looked up once here: every request asks for one (daemon/auth.py).
        object.__setattr__(self, "_ranks", {namespace: ROLE_RANKS.get(role, 0)
                                            for namespace, role in self.roles.items()})
        object.__setattr__(self, "_everywhere", self._ranks.get(ALL_NAMESPACES, 0))

    def rank(self, namespace: str) -> int:
        """The principal's role on a namespace, as a rank (0 = none). On a namespace, a role on
        "*" counts too; on "*" itself, only a role on "*"."""
        own = self._ranks.get(namespace, 0)
        return own if own >= self._everywhere else self._everywhere


@dataclass(frozen=True)
class Credentials:
    principals: dict = field(default_factory=dict)  # name -> Principal
    by_uid: dict = field(default_factory=dict)  # uid -> Principal
    by_gid: dict = field(default_factory=dict)  # gid -> Principal


# -- reading ------------------------------------------------------------------------------------

def load(path: str, check_access: bool = True) -> Credentials:
    """Read and check a credentials file. With `check_access` (the daemon), refuse one that is
    not a regular file, that another user owns, or that group or others may read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CredentialsError(f"{path}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())  # of the file opened, not of a path that may change
        if check_access:
            check_file_access(path, info)
        data = f.read()
    return parse(data, path)


def check_file_access(path: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise CredentialsError(f"{path}: not a regular file")
    if info.st_uid != os.geteuid():
        raise CredentialsError(f"{path}: owned by uid {info.st_uid}, not by the daemon's user "
                               f"(uid {os.geteuid()}); chown it to that user")
    if info.st_mode & 0o066:
        raise CredentialsError(f"{path}: mode 0o{stat.S_IMODE(info.st_mode):o} lets group or "
                               "others read or write it; chmod 600 it")


def parse(data: bytes, path: str = "<credentials>") -> Credentials:
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CredentialsError(f"{path}: not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CredentialsError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(document) - {"principals"}
    if unknown:
        raise CredentialsError(f"{path}: unknown top-level keys {', '.join(sorted(unknown))}; "
                               "each principal is a table [principals.NAME]")
    table = document.get("principals", {})
    if not isinstance(table, dict):
        raise CredentialsError(f"{path}: principals must be a table of [principals.NAME]")
    principals, by_uid, by_gid = {}, {}, {}
    for name, entry in table.items():
        principal = _principal(path, name, entry)
        principals[name] = principal
        for ids, index, kind in ((principal.uids, by_uid, "uid"),
                                 (principal.gids, by_gid, "gid")):
            for unix_id in ids:
                if unix_id in index:
                    raise CredentialsError(
                        f"{path}: principal {name!r}: {kind} {unix_id} is already mapped to "
                        f"principal {index[unix_id].name!r}; a {kind} maps to one principal")
                index[unix_id] = principal
    return Credentials(principals, by_uid, by_gid)


def _principal(path: str, name: str, entry) -> Principal:
    where = f"{path}: principal {name!r}"
    if not scram.PRINCIPAL_PATTERN.fullmatch(name):
        raise CredentialsError(f"{where}: a name is 1-255 characters of [A-Za-z0-9._@:+-]")
    if not isinstance(entry, dict):
        raise CredentialsError(f"{where}: must be a table")
    unknown = set(entry) - _KEYS
    if unknown:
        raise CredentialsError(f"{where}: unknown keys {', '.join(sorted(unknown))} "
                               f"(known: {', '.join(sorted(_KEYS))})")
    roles = _roles(where, entry.get("roles"))
    uids = _ids(where, entry, "uids")
    gids = _ids(where, entry, "gids")
    present = [k for k in _VERIFIER_KEYS if k in entry]
    if not present:
        if not uids and not gids:
            raise CredentialsError(f"{where}: needs a verifier (salt, iterations, stored_key, "
                                   "server_key: `mooncakectl auth add-principal` writes them) "
                                   "or uids / gids")
        return Principal(name, roles, uids=uids, gids=gids)
    missing = [k for k in _VERIFIER_KEYS if k not in entry]
    if missing:
        raise CredentialsError(f"{where}: missing {', '.join(missing)} (a verifier needs "
                               "salt, iterations, stored_key and server_key)")
    salt = _hex(where, entry, "salt", scram.MIN_SALT_BYTES, scram.MAX_SALT_BYTES)
    iterations = entry["iterations"]
    if type(iterations) is not int or \
            not scram.MIN_ITERATIONS <= iterations <= scram.MAX_ITERATIONS:
        raise CredentialsError(f"{where}: iterations must be an int in "
                               f"{scram.MIN_ITERATIONS}..{scram.MAX_ITERATIONS}")
    stored = _hex(where, entry, "stored_key", scram.KEY_BYTES, scram.KEY_BYTES)
    server = _hex(where, entry, "server_key", scram.KEY_BYTES, scram.KEY_BYTES)
    return Principal(name, roles, salt, iterations, stored, server, uids, gids)


def _roles(where: str, value) -> dict:
    if not isinstance(value, dict) or not value:
        raise CredentialsError(f"{where}: roles must be a table of namespace = role with at "
                               "least one entry, e.g. roles = { \"llama-3\" = \"write\" }")
    for namespace, role in value.items():
        if namespace != ALL_NAMESPACES and not NAMESPACE_PATTERN.fullmatch(namespace):
            raise CredentialsError(f"{where}: roles: {namespace!r} is neither \"*\" nor a "
                                   "namespace (1-255 characters of [A-Za-z0-9._:/-])")
        if role not in ROLE_RANKS:
            raise CredentialsError(f"{where}: roles: {namespace!r} = {role!r} is not one of "
                                   f"{', '.join(ROLE_RANKS)}")
    return dict(value)


def _ids(where: str, entry: dict, key: str) -> tuple:
    value = entry.get(key, [])
    if not isinstance(value, list) or \
            any(type(v) is not int or not 0 <= v <= MAX_ID for v in value):
        raise CredentialsError(f"{where}: {key} must be an array of ints in 0..{MAX_ID}")
    if len(set(value)) != len(value):
        raise CredentialsError(f"{where}: {key} repeats an id")
    return tuple(value)


def _hex(where: str, entry: dict, key: str, least: int, most: int) -> bytes:
    value = entry[key]
    try:
        raw = bytes.fromhex(value) if type(value) is str else None
    except ValueError:
        raw = None
    if raw is None or not least <= len(raw) <= most:
        size = f"{least}" if least == most else f"{least}-{most}"
        raise CredentialsError(f"{where}: {key} must be a hex string of {size} bytes")
    return raw


# -- writing (mooncakectl auth) -----------------------------------------------------------------

def new_principal(name: str, secret: bytes | None, roles: dict, uids=(), gids=(),
                  iterations: int = scram.DEFAULT_ITERATIONS) -> Principal:
    """A principal with a fresh salt and the verifier of `secret` (None: no secret)."""
    if secret is None:
        return Principal(name, dict(roles), uids=tuple(uids), gids=tuple(gids))
    salt = os.urandom(scram.SALT_BYTES)
    stored, server = scram.verifier(secret, salt, iterations)
    return Principal(name, dict(roles), salt, iterations, stored, server, tuple(uids),
                     tuple(gids))


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_principal(principal: Principal) -> str:
    lines = [f"[principals.{_quoted(principal.name)}]"]
    if principal.has_secret:
        lines += [f"salt = \"{principal.salt.hex()}\"",
                  f"iterations = {principal.iterations}",
                  f"stored_key = \"{principal.stored_key.hex()}\"",
                  f"server_key = \"{principal.server_key.hex()}\""]
    roles = ", ".join(f"{_quoted(ns)} = {_quoted(role)}" for ns, role in principal.roles.items())
    lines.append(f"roles = {{ {roles} }}")
    if principal.uids:
        lines.append(f"uids = [{', '.join(map(str, principal.uids))}]")
    if principal.gids:
        lines.append(f"gids = [{', '.join(map(str, principal.gids))}]")
    return "\n".join(lines) + "\n"


HEADER = ("# mooncaked credentials ([auth] credentials_file). Written by `mooncakectl auth`;\n"
          "# it rewrites the whole file. Verifiers only: the secrets are not here.\n"
          "# Keep it mode 600, owned by the daemon's user.\n")


def render(credentials: Credentials) -> str:
    return HEADER + "".join("\n" + render_principal(p)
                            for p in credentials.principals.values())


def write(path: str, credentials: Credentials) -> None:
    """Replace the file atomically with mode 600, keeping the owner of the file it replaces."""
    text = render(credentials).encode()
    parse(text, path)  # what is written must load
    try:
        previous = os.stat(path)
    except FileNotFoundError:
        previous = None
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if previous is not None and os.geteuid() == 0:
                os.fchown(f.fileno(), previous.st_uid, previous.st_gid)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def with_principal(credentials: Credentials, principal: Principal) -> Credentials:
    """A copy with `principal` added or replacing the one of its name (ids checked again)."""
    principals = dict(credentials.principals)
    principals[principal.name] = principal
    return parse(render(Credentials(principals)).encode())


def without_principal(credentials: Credentials, name: str) -> Credentials:
    principals = {n: p for n, p in credentials.principals.items() if n != name}
    return parse(render(Credentials(principals)).encode())
