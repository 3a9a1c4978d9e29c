"""Fuzz target: the configuration loader (mooncaked/config.py) on arbitrary file contents.

The input is written to a file and loaded with `config.load`, as `mooncaked -c FILE` does. The
outcome must be a Config, or a ConfigError whose message names the file; any other exception
is a finding. A Config that loads must also survive `as_dict` (what --check-config prints) and
load again, unchanged, from the TOML written from it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from mooncaked import config as config_module

from wire_oracle import Finding

_directory = tempfile.mkdtemp(prefix="mooncaked-fuzz-config-")
PATH = os.path.join(_directory, "mooncaked.toml")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _toml_value(value) -> str:
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is str:
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\U{ord(c):08x}"
                             for c in value) + '"'
    return repr(value)


def _to_toml(config) -> str:
    lines = []
    for section in config_module.sections():
        lines.append(f"[{section.name}]")
        values = getattr(config, section.name)
        for spec in dataclasses.fields(values):
            lines.append(f"{spec.name} = {_toml_value(getattr(values, spec.name))}")
    return "\n".join(lines) + "\n"


def load(data: bytes):
    with open(PATH, "wb") as f:
        f.write(data)
    return config_module.load(PATH)


def test_one_input(data: bytes) -> None:
    os.environ.pop(config_module.LOOP_ENV, None)
    try:
        loaded = load(data)
    except config_module.ConfigError as exc:
        if PATH not in str(exc):
            raise Finding(f"a ConfigError that does not name the file: {exc}") from None
        return
    loaded.as_dict()
    again = load(_to_toml(loaded).encode())
    if dataclasses.replace(again, source="") != dataclasses.replace(loaded, source=""):
        raise Finding("a loaded config written out as TOML loads differently")


def dictionary() -> list[bytes]:
    """Section and key names, and TOML's punctuation, for libFuzzer's -dict."""
    words = {b"[", b"]", b"=", b'"', b"\n", b"true", b"false", b"0o", b"0x", b"1e999",
             b"inf", b"nan", b"-", b"#", b"'''", b'"""', b"\\u0000"}
    for section in config_module.sections():
        words.add(f"[{section.name}]\n".encode())
        for spec in dataclasses.fields(section.default_factory):
            words.add(f"{spec.name} = ".encode())
    return sorted(words)


def seeds() -> dict[str, bytes]:
    with open(os.path.join(REPO, "mooncaked.toml"), "rb") as f:
        example = f.read()
    return {
        "example": example,
        "empty": b"",
        "cluster": (b"[cluster]\nenabled = true\nnode_id = 1\n"
                    b'initial_members = "1@127.0.0.1:7000,2@h:7001"\n'),
        "values": (b'[server]\ntcp_port = 0\nshm_mode = 0o600\n[segments]\nsize_bytes = 4096\n'
                   b"alignment_bytes = 64\n[store]\neviction_ratio = 0.5\n"
                   b'[log]\nlevel = "debug"\n'),
        "outside": b"size_bytes = 1\n[segments]\n",
    }
