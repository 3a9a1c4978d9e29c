"""Tests of the configuration: the shipped `mooncaked.toml`, the strict loader, and the CLI.

- `mooncaked.toml` at the repository root loads, lists every key of the schema
  (mooncaked/config.py) with exactly the dataclass default, and documents each key with a
  comment whose last line is `# Default <the value as written>. Unit: <unit>.` (the schema's
  unit, or `none` for keys without one), and each section with a header comment;
- bad files (unknown section or key, wrong type, out-of-range value, broken relation between
  keys) raise ConfigError naming the key and the file;
- messages say what was meant: a permission mode in octal with the `0o` literal to write, a
  key above every section header as a key (and the section that has it);
- `python -m mooncaked --config BAD.toml` exits 2 naming the key and the file and leaves no
  segment files; `--check-config` on the default file exits 0 and prints the config as JSON
  (shm_mode in octal, as `mooncakectl config show` prints it); a bad $MOONCAKED_LOOP fails it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from mooncaked import config
from mooncaked.config import Config, ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILE = os.path.join(REPO, "mooncaked.toml")

DEFAULT_LINE = re.compile(r"^# Default (.+)\. Unit: (\S+)\.$")
SECTION_LINE = re.compile(r"^\[([A-Za-z0-9_]+)\]$")
KEY_LINE = re.compile(r"^([A-Za-z0-9_]+) = (.+)$")


def schema() -> dict[str, dict[str, dataclasses.Field]]:
    """{section: {key: field}} from the dataclasses."""
    return {s.name: {f.name: f for f in dataclasses.fields(s.default_factory)}
            for s in config.sections()}


def documented_lines(path: str) -> list[tuple[str, str, str, list[str]]]:
    """(section, key, value as written, comment lines right above it) for every key line.

    For a section header, key is "" and value is "". A blank line ends a comment block.
    """
    found, comments, section = [], [], ""
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            line = line.strip()
            if not line:
                comments = []
            elif line.startswith("#"):
                comments.append(line)
            elif SECTION_LINE.match(line):
                section = SECTION_LINE.match(line).group(1)
                found.append((section, "", "", comments))
                comments = []
            else:
                match = KEY_LINE.match(line)
                assert match, f"{path}: unexpected line {line!r}"
                found.append((section, match.group(1), match.group(2), comments))
                comments = []
    return found


# -- the shipped default file ---------------------------------------------------------------

def test_default_file_loads_with_the_dataclass_defaults():
    loaded = config.load(DEFAULT_FILE)
    assert loaded.source == DEFAULT_FILE
    assert loaded.as_dict() == Config().as_dict()


def test_default_file_lists_every_key_of_the_schema():
    with open(DEFAULT_FILE, "rb") as f:
        data = tomllib.load(f)
    expected = {section: set(fields) for section, fields in schema().items()}
    assert {section: set(table) for section, table in data.items()} == expected


def test_default_file_values_equal_the_defaults_with_their_types():
    with open(DEFAULT_FILE, "rb") as f:
        data = tomllib.load(f)
    for section, fields in schema().items():
        for key, spec in fields.items():
            value = data[section][key]
            assert value == spec.default, f"[{section}] {key}"
            assert type(value) is type(spec.default), f"[{section}] {key}"
    assert data["segments"]["shm_mode"] == 0o600
    assert data["server"]["unix_socket"] == "/run/mooncaked/mooncaked.sock"


def test_default_file_shm_mode_is_an_octal_literal():
    lines = [(s, k, v) for s, k, v, _ in documented_lines(DEFAULT_FILE)]
    assert ("segments", "shm_mode", "0o600") in lines


def test_every_key_has_a_comment_with_meaning_default_and_unit():
    fields = schema()
    keys = [entry for entry in documented_lines(DEFAULT_FILE) if entry[1]]
    assert len(keys) == sum(len(f) for f in fields.values())
    for section, key, written, comments in keys:
        where = f"[{section}] {key}"
        assert len(comments) >= 2, f"{where}: needs a meaning line and a Default/Unit line"
        match = DEFAULT_LINE.match(comments[-1])
        assert match, f"{where}: last comment line {comments[-1]!r} is not '# Default X. Unit: Y.'"
        assert match.group(1) == written, f"{where}: comment says {match.group(1)}, value {written}"
        unit = fields[section][key].metadata["unit"] or "none"
        assert match.group(2) == unit, f"{where}: comment unit {match.group(2)}, schema {unit}"
        meaning = " ".join(c.lstrip("# ") for c in comments[:-1])
        assert len(meaning) > 10, f"{where}: no meaning given"


def test_every_section_has_a_header_comment():
    headers = [(section, comments) for section, key, _, comments in
               documented_lines(DEFAULT_FILE) if not key]
    assert [section for section, _ in headers] == list(schema())
    for section, comments in headers:
        assert comments and f"[{section}]" in comments[-1], f"[{section}] has no header comment"


# -- strict loading -------------------------------------------------------------------------

BAD_FILES = [
    pytest.param("[bogus]\nx = 1\n", "bogus", id="unknown-section"),
    pytest.param("bogus = 1\n", "bogus", id="unknown-top-level-key"),
    pytest.param("server = 1\n", "server", id="section-not-a-table"),
    pytest.param("[server]\nbogus_key = 1\n", "bogus_key", id="unknown-key"),
    pytest.param('[server]\ntcp_port = "50051"\n', "tcp_port", id="str-for-int"),
    pytest.param("[server]\ntcp_port = 50051.0\n", "tcp_port", id="float-for-int"),
    pytest.param("[segments]\ncount = true\n", "count", id="bool-for-int"),
    pytest.param("[metrics]\nenabled = 1\n", "enabled", id="int-for-bool"),
    pytest.param("[node]\nname = 5\n", "name", id="int-for-str"),
    pytest.param('[store]\neviction_ratio = "0.1"\n', "eviction_ratio", id="str-for-float"),
    pytest.param("[server]\ntcp_port = 65536\n", "tcp_port", id="above-maximum"),
    pytest.param("[segments]\nsize_bytes = 4095\n", "size_bytes", id="below-minimum"),
    pytest.param("[segments]\nshm_mode = 0o1000\n", "shm_mode", id="mode-above-0o777"),
    pytest.param("[store]\neviction_ratio = 1.5\n", "eviction_ratio", id="ratio-above-1"),
    pytest.param("[store]\neviction_high_watermark_ratio = -0.1\n",
                 "eviction_high_watermark_ratio", id="ratio-below-0"),
    pytest.param("[store]\neviction_ratio = nan\n", "eviction_ratio", id="ratio-nan"),
    pytest.param('[log]\nlevel = "verbose"\n', "level", id="not-a-choice"),
    pytest.param('[store]\nallocation_strategy = "first"\n', "allocation_strategy",
                 id="not-a-strategy"),
    pytest.param("[store]\nput_start_discard_timeout_ms = 600001\n",
                 "put_start_discard_timeout_ms", id="discard-above-release"),
    pytest.param("[store]\nput_start_discard_timeout_ms = 2000\n"
                 "put_start_release_timeout_ms = 1000\n",
                 "put_start_release_timeout_ms", id="release-below-discard"),
    pytest.param("[store]\nsoft_pin_ttl_ms = 86400001\n", "soft_pin_ttl_ms",
                 id="soft-pin-above-max"),
    pytest.param("[segments]\nalignment_bytes = 48\n", "alignment_bytes",
                 id="alignment-not-power-of-two"),
    pytest.param("[segments]\nsize_bytes = 4096\nalignment_bytes = 8192\n", "size_bytes",
                 id="segment-smaller-than-alignment"),
]


@pytest.mark.parametrize("text, key", BAD_FILES)
def test_bad_file_raises_config_error_naming_key_and_file(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        config.load(path)
    message = str(raised.value)
    assert key in message
    assert str(path) in message


def load_text(tmp_path, text: str) -> str:
    """The ConfigError message for a file holding `text`."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        config.load(path)
    return str(raised.value)


def test_decimal_mode_is_reported_in_octal_with_the_literal_meant(tmp_path):
    # TOML reads 600 as decimal 600 (0o1130); the user meant the mode 0o600.
    message = load_text(tmp_path, "[segments]\nshm_mode = 600\n")
    assert "above the maximum 0o777" in message
    assert "0o1130" in message
    assert "write 0o600" in message
    assert "511" not in message


def test_mode_out_of_range_in_octal_gets_no_wrong_hint(tmp_path):
    message = load_text(tmp_path, "[segments]\nshm_mode = 999\n")  # digits 9: not octal
    assert "above the maximum 0o777" in message
    assert "write" not in message


def test_top_level_key_is_named_as_a_key_outside_any_section(tmp_path):
    message = load_text(tmp_path, "size_bytes = 1\n[segments]\ncount = 1\n")
    assert "unknown section" not in message
    assert "key size_bytes is outside any section" in message
    assert "belongs in [segments]" in message
    # A key two sections have: both named; a key no section has: said so.
    assert "[cluster] or [ssd] or [tls] or [metrics]" in load_text(tmp_path, "enabled = true\n")
    assert "no section has such a key" in load_text(tmp_path, "bogus = 1\n")


def test_as_dict_writes_the_mode_as_the_file_does():
    assert Config().as_dict()["segments"]["shm_mode"] == "0o600"
    assert Config().segments.shm_mode == 0o600  # the value the daemon uses stays an int


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[server\ntcp_port = 1\n")
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        config.load(path)


def test_bytes_that_are_not_utf8_name_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[node]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*UTF-8"):
        config.load(path)


def test_an_int_too_large_for_a_float_key_names_the_key(tmp_path):
    path = tmp_path / "huge.toml"
    path.write_text("[store]\neviction_ratio = 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: [store] eviction_ratio")):
        config.load(path)


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        config.load(path)


def test_good_file_overrides_only_what_it_sets(tmp_path):
    path = tmp_path / "good.toml"
    path.write_text("[server]\ntcp_port = 0\n[store]\neviction_ratio = 0\n")
    loaded = config.load(path)
    assert loaded.server.tcp_port == 0
    assert loaded.store.eviction_ratio == 0.0 and type(loaded.store.eviction_ratio) is float
    expected = Config().as_dict()
    expected["server"]["tcp_port"] = 0
    expected["store"]["eviction_ratio"] = 0.0
    assert loaded.as_dict() == expected


# -- the command line -----------------------------------------------------------------------

def run_mooncaked(*args: str, loop_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "MOONCAKED_CONFIG", "MOONCAKED_LOOP")}
    env["PYTHONPATH"] = REPO
    if loop_env is not None:
        env["MOONCAKED_LOOP"] = loop_env
    return subprocess.run([sys.executable, "-m", "mooncaked", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("section, key, bad_value", [
    ("store", "lease_ttl_ms", "0"),
    ("segments", "alignment_bytes", "100"),
    ("store", "put_start_discard_timeout_ms", "700000"),
    ("server", "no_such_key", "1"),
])
def test_daemon_with_bad_config_exits_2_naming_key_and_file(tmp_path, section, key, bad_value):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    sections = {
        "segments": {"size_bytes": "1048576", "shm_dir": f'"{shm_dir}"'},
        "server": {"tcp_port": "0", "unix_socket": '""'},
        "metrics": {"enabled": "false"},
    }
    sections.setdefault(section, {})[key] = bad_value
    path = tmp_path / "BAD.toml"
    path.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in table.items())
                            for name, table in sections.items()))
    result = run_mooncaked("--config", str(path))
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert str(path) in result.stderr
    assert os.listdir(shm_dir) == []


def test_check_config_on_bad_file_exits_2(tmp_path):
    path = tmp_path / "BAD.toml"
    path.write_text("[log]\nlevel = \"loud\"\n")
    result = run_mooncaked("--config", str(path), "--check-config")
    assert result.returncode == 2
    assert "level" in result.stderr and str(path) in result.stderr
    assert result.stdout == ""


def test_check_config_on_default_file_prints_json():
    result = run_mooncaked("--config", DEFAULT_FILE, "--check-config")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == Config().as_dict()
    assert '"shm_mode": "0o600"' in result.stdout


@pytest.mark.parametrize("args", [["--config", DEFAULT_FILE], []], ids=["file", "no-file"])
def test_check_config_rejects_a_bad_loop_environment_variable(args):
    result = run_mooncaked(*args, "--check-config", loop_env="bogus")
    assert result.returncode == 2
    assert "MOONCAKED_LOOP='bogus'" in result.stderr
    assert "auto, uring, asyncio" in result.stderr
    assert result.stdout == ""


def test_check_config_accepts_each_loop_name():
    for name in ("auto", "uring", "asyncio", "ASYNCIO"):
        result = run_mooncaked("--config", DEFAULT_FILE, "--check-config", loop_env=name)
        assert result.returncode == 0, (name, result.stderr)
