"""`mooncakectl auth ...`: write the daemon's credentials file (mooncaked/credentials.py).

    auth add-principal NAME --role NS=ROLE [--role ...] [--uid UID] [--gid GID]
                            [--secret-file FILE | --no-secret] [--replace] [--file PATH]
    auth remove-principal NAME [--file PATH]
    auth hash-secret [--secret-file FILE] [--iterations N]

These commands work on the file, not on a daemon: send the daemon SIGHUP (or restart it)
to make it read the file again. Without `--secret-file`, add-principal makes a random secret
and prints it once on stdout; only its verifier is stored.
"""

from __future__ import annotations

import os
import secrets
import sys

import click

from mooncaked import credentials as credentials_file
from mooncaked.client.auth import read_secret_file
from mooncaked.proto import scram

DEFAULT_CREDENTIALS_FILE = "/etc/mooncaked/credentials.toml"
CREDENTIALS_FILE_ENV = "MOONCAKED_CREDENTIALS_FILE"


class AuthCommandError(click.ClickException):
    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"mooncakectl: {self.format_message()}", err=True)


def _load(path: str, must_exist: bool) -> credentials_file.Credentials:
    if not must_exist and not os.path.lexists(path):
        return credentials_file.Credentials()  # a new file
    try:
        return credentials_file.load(path, check_access=False)
    except credentials_file.CredentialsError as exc:
        raise AuthCommandError(str(exc)) from None


def _write(path: str, credentials: credentials_file.Credentials) -> None:
    try:
        credentials_file.write(path, credentials)
    except OSError as exc:
        raise AuthCommandError(f"cannot write {path}: {exc.strerror or exc}") from None


def _roles(values: tuple[str, ...]) -> dict:
    roles = {}
    for value in values:
        namespace, equals, role = value.rpartition("=")
        if not equals or not namespace:
            raise click.BadParameter(f"{value!r} is not NAMESPACE=ROLE", param_hint="--role")
        roles[namespace] = role
    return roles


def _secret(secret_file: str | None) -> bytes:
    try:
        return read_secret_file(secret_file)
    except (OSError, ValueError) as exc:
        raise AuthCommandError(f"cannot read the secret: {getattr(exc, 'strerror', None) or exc}"
                               ) from None


_file_option = click.option(
    "--file", "path", envvar=CREDENTIALS_FILE_ENV, default=DEFAULT_CREDENTIALS_FILE,
    show_default=True, help=f"The credentials file ([auth] credentials_file; env "
    f"{CREDENTIALS_FILE_ENV}).")
_iterations_option = click.option(
    "--iterations", type=click.IntRange(scram.MIN_ITERATIONS, scram.MAX_ITERATIONS),
    default=scram.DEFAULT_ITERATIONS, show_default=True,
    help="PBKDF2 rounds a client spends deriving its keys.")


@click.group()
def auth() -> None:
    """Write the credentials file: principals, verifiers, roles."""


@auth.command("add-principal")
@click.argument("name")
@click.option("--role", "roles", multiple=True, required=True, metavar="NS=ROLE",
              help="A role (read, write or admin) on a namespace, or on * (every namespace). "
              "Repeatable.")
@click.option("--uid", "uids", type=click.IntRange(0, credentials_file.MAX_ID), multiple=True,
              help="Unix socket clients with this uid are this principal. Repeatable.")
@click.option("--gid", "gids", type=click.IntRange(0, credentials_file.MAX_ID), multiple=True,
              help="... or with this primary gid. Repeatable.")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="Read the secret from this file (default: make a random one and print it).")
@click.option("--no-secret", is_flag=True,
              help="No secret: only Unix socket clients of --uid / --gid are this principal.")
@click.option("--replace", is_flag=True, help="Replace a principal of this name.")
@_iterations_option
@_file_option
def add_principal(name: str, roles: tuple, uids: tuple, gids: tuple, secret_file: str | None,
                  no_secret: bool, replace: bool, iterations: int, path: str) -> None:
    """Add principal NAME to the credentials file (created, mode 600, if missing)."""
    if no_secret and secret_file:
        raise click.UsageError("--no-secret and --secret-file exclude each other")
    if no_secret and not uids and not gids:
        raise click.UsageError("--no-secret needs --uid or --gid")
    existing = _load(path, must_exist=False)
    if name in existing.principals and not replace:
        raise AuthCommandError(f"principal {name!r} is in {path} already; --replace replaces "
                               "it")
    generated = None
    if no_secret:
        secret = None
    elif secret_file:
        secret = _secret(secret_file)
    else:
        generated = secrets.token_urlsafe(32)
        secret = generated.encode()
    principal = credentials_file.new_principal(name, secret, _roles(roles), uids, gids,
                                               iterations)
    try:
        updated = credentials_file.with_principal(existing, principal)
    except credentials_file.CredentialsError as exc:
        raise AuthCommandError(str(exc).replace("<credentials>", path)) from None
    _write(path, updated)
    click.echo(f"mooncakectl: principal {name!r} written to {path}; send the daemon SIGHUP to "
               "load it", err=True)
    if generated is not None:
        click.echo(f"mooncakectl: the secret of {name!r} (shown once, not stored):", err=True)
        click.echo(generated)


@auth.command("remove-principal")
@click.argument("name")
@_file_option
def remove_principal(name: str, path: str) -> None:
    """Remove principal NAME from the credentials file."""
    existing = _load(path, must_exist=True)
    if name not in existing.principals:
        raise AuthCommandError(f"no principal {name!r} in {path}")
    _write(path, credentials_file.without_principal(existing, name))
    click.echo(f"mooncakectl: principal {name!r} removed from {path}", err=True)


@auth.command("hash-secret")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="Read the secret from this file (default: standard input).")
@_iterations_option
def hash_secret(secret_file: str | None, iterations: int) -> None:
    """Print the verifier of a secret (salt, iterations, stored_key, server_key) as the TOML
    lines of a [principals.NAME] table."""
    if secret_file:
        secret = _secret(secret_file)
    else:
        secret = sys.stdin.buffer.read().rstrip(b"\r\n")
        if not secret:
            raise AuthCommandError("no secret on standard input")
    principal = credentials_file.new_principal("x", secret, {"*": "read"},
                                               iterations=iterations)
    click.echo(f"salt = \"{principal.salt.hex()}\"\niterations = {principal.iterations}\n"
               f"stored_key = \"{principal.stored_key.hex()}\"\n"
               f"server_key = \"{principal.server_key.hex()}\"")
