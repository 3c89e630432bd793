"""The knob table and config resolution (kvd.config): defaults, TOML, env, flags, errors."""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path

import pytest

from kvd.config import (
    KNOB_BY_NAME,
    KNOBS,
    Config,
    defaults_toml,
    load_config,
    parse_size,
    resolved_toml,
)
from kvd.config_env import OTHER_VARIABLES, knob_variables, unknown_variables
from kvd_protocol.errors import (
    ConfigError,
)


def test_defaults():
    cfg = load_config(env={})
    assert cfg.as_dict() == {k.name: k.default for k in KNOBS}
    assert cfg.chunk_tokens == 256 and cfg.host_capacity == 2**30
    assert cfg.max_message_bytes == 64 * 2**20 and cfg.log_level == "info"
    with pytest.raises(AttributeError):
        cfg.no_such_knob


def _toml(tmp_path, text):
    p = tmp_path / "kvd.toml"
    p.write_text(text)
    return str(p)


def test_toml_file(tmp_path):
    path = _toml(tmp_path, 'host_capacity = "2GiB"\nchunk_tokens = 64\nclient_timeout_s = 9\n'
                           'shm_dir = "/tmp"\n')
    cfg = load_config(path, env={})
    assert (cfg.host_capacity, cfg.chunk_tokens, cfg.client_timeout_s, cfg.shm_dir) == \
        (2 * 2**30, 64, 9.0, "/tmp")
    assert isinstance(cfg.client_timeout_s, float)
    assert cfg.max_clients == KNOB_BY_NAME["max_clients"].default


def test_precedence_default_toml_env_cli(tmp_path):
    path = _toml(tmp_path, "chunk_tokens = 64\nmax_clients = 7\nlease_max_ms = 5\n")
    env = {"KVD_CHUNK_TOKENS": "32", "KVD_MAX_CLIENTS": "8", "KVD_UNRELATED": "x", "HOME": "/"}
    cfg = load_config(path, env=env, overrides={"chunk_tokens": "16", "max_clients": None})
    assert cfg.chunk_tokens == 16  # CLI beats env beats TOML
    assert cfg.max_clients == 8  # env beats TOML; a None override is "not given"
    assert cfg.lease_max_ms == 5  # TOML beats default
    assert cfg.copy_threads == 0  # default: one per CPU, at most 16


def test_config_is_a_frozen_dataclass_of_the_knob_table(tmp_path):
    cfg = load_config(env={})
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg, Config)
    knob_fields = [f.name for f in dataclasses.fields(cfg)][:len(KNOBS)]
    assert knob_fields == [k.name for k in KNOBS]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.host_capacity = 1
    assert Config() == cfg  # the dataclass's defaults are the table's
    changed = dataclasses.replace(cfg, chunk_tokens=64)
    assert changed.chunk_tokens == 64 and cfg.chunk_tokens == 256


def test_sources_say_where_each_value_came_from(tmp_path):
    path = _toml(tmp_path, "chunk_tokens = 64\nmax_clients = 7\nlease_max_ms = 5\n")
    env = {"KVD_CHUNK_TOKENS": "32", "KVD_MAX_CLIENTS": "8"}
    cfg = load_config(path, env=env, overrides={"chunk_tokens": "16", "copy_threads": None})
    assert cfg.file == path
    assert (cfg.sources["chunk_tokens"], cfg.sources["max_clients"], cfg.sources["lease_max_ms"],
            cfg.sources["copy_threads"]) == ("flag", "env", "file", "default")
    described = {name: (value, source) for name, value, source in cfg.describe()}
    assert described["chunk_tokens"] == ("16", "flag")
    assert described["host_capacity"] == ('"1GiB"', "default")
    assert set(cfg.sources.values()) <= {"default", "file", "env", "flag"}


def test_resolved_toml_round_trips_with_sources(tmp_path):
    path = _toml(tmp_path, 'host_capacity = "2GiB"\nshm_dir = "/tmp"\n')
    cfg = load_config(path, env={"KVD_DISK_GDS": "yes", "KVD_DISK_HIGH_WATERMARK": "0.75"})
    text = resolved_toml(cfg)
    assert load_config(_toml(tmp_path, text), env={}) == cfg
    lines = {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line}
    assert lines["host_capacity"].endswith("# file") and '"2GiB"' in lines["host_capacity"]
    assert lines["disk_gds"] == "disk_gds = true  # env KVD_DISK_GDS"
    assert lines["chunk_tokens"].endswith("# default")
    assert f"# file: {path}" in text


def test_defaults_toml_is_the_table():
    data = tomllib.loads(defaults_toml())
    assert list(data) == [k.name for k in KNOBS]
    assert data["host_capacity"] == "1GiB" and data["disk_gds"] is False


def test_env_is_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVD_MAX_REGISTRATIONS", "3")
    assert load_config().max_registrations == 3
    assert load_config(env={}).max_registrations == 64


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1GiB", 2**30), ("512 MiB", 512 * 2**20), (" 1.5KiB ", 1536),
    ("1kb", 1000), ("8GB", 8 * 10**9), ("8gb", 8 * 10**9), ("3TB", 3 * 10**12),
    ("1tib", 2**40), ("2MB", 2 * 10**6), ("7b", 7), (12345, 12345), ("0", 0), ("0.5KiB", 512),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "1 XB", "-1", "", "GiB", "1e3", "1,000", True, 1.5, None,
                                 "1.3B", "0.1KiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("text", ["8G", "8g", "1k", "1K", "512M", "512m", "2T", "2t", "1.5 G"])
def test_bare_unit_letters_are_refused_with_a_hint(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    number, letter = text.replace(" ", "")[:-1], text[-1].upper()
    assert "ambiguous" in str(info.value)
    assert f"{number}{letter}iB" in str(info.value) and f"{number}{letter}B" in str(info.value)


def test_an_ambiguous_size_flag_is_one_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"host_capacity": "8G"})
    assert info.value.key == "host_capacity" and "8GiB" in str(info.value)


@pytest.mark.parametrize("key,value", [
    ("chunk_tokens", '"256"'), ("max_clients", '"7"'), ("heartbeat_interval_s", '"5.0"'),
    ("disk_high_watermark", '"0.5"'), ("disk_gds", '"true"'), ("disk_gds", "1"),
    ("chunk_tokens", "256.0"),
])
def test_toml_values_must_have_the_knobs_type(tmp_path, key, value):
    """TOML is typed: a quoted number is a string, and a string is not an int knob's value.
    The same text from the environment or a flag is parsed, as text always is."""
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, f"{key} = {value}\n"), env={})
    assert info.value.key == key
    if value.startswith('"'):
        assert "without quotes" in str(info.value)
    text = value.strip('"')
    if text not in ("1", "256.0"):
        assert load_config(env={f"KVD_{key.upper()}": text}).as_dict()[key] is not None


@pytest.mark.parametrize("source,key,value", [
    ("toml", "chunk_tokens", '"abc"'), ("toml", "chunk_tokens", "16.5"),
    ("toml", "chunk_tokens", "0"), ("toml", "chunk_tokens", "true"),
    ("toml", "host_capacity", '"lots"'), ("toml", "host_capacity", "100"),
    ("toml", "host_capacity", "false"), ("toml", "log_level", '"loud"'),
    ("toml", "shm_dir", "5"), ("toml", "heartbeat_interval_s", '"soon"'),
    ("toml", "heartbeat_interval_s", "0.01"), ("toml", "heartbeat_interval_s", "true"),
    ("env", "chunk_tokens", "abc"), ("env", "chunk_tokens", "1.5"), ("env", "max_clients", "0"),
    ("env", "host_capacity", "1 XB"), ("env", "lease_max_ms", ""), ("env", "log_level", "INFO"),
    ("cli", "max_keys_per_request", "many"), ("cli", "client_timeout_s", "-3"),
    ("cli", "max_message_bytes", "1KiB"),
])
def test_bad_value_names_the_key(tmp_path, source, key, value):
    kwargs = {"env": {}}
    if source == "toml":
        kwargs["path"] = _toml(tmp_path, f"{key} = {value}\n")
    elif source == "env":
        kwargs["env"] = {f"KVD_{key.upper()}": value}
    else:
        kwargs["overrides"] = {key: value}
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    origin = {"toml": "kvd.toml", "env": "environment", "cli": "command line"}[source]
    assert origin in str(info.value)


def test_unknown_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "chunk_size = 16\n"), env={})
    assert info.value.key == "chunk_size" and "unknown key" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "[server]\nchunk_tokens = 16\n"), env={})
    assert info.value.key == "server"
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"bogus": "1"})
    assert info.value.key == "bogus"


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "missing.toml"), env={})
    assert info.value.key == "config"
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "chunk_tokens = = 3\n"), env={})
    assert info.value.key == "config" and "TOML" in str(info.value)


def test_timeout_must_exceed_heartbeat():
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVD_HEARTBEAT_INTERVAL_S": "2", "KVD_CLIENT_TIMEOUT_S": "2"})
    assert info.value.key == "client_timeout_s"
    cfg = load_config(env={"KVD_HEARTBEAT_INTERVAL_S": "2", "KVD_CLIENT_TIMEOUT_S": "2.5"})
    assert math.isclose(cfg.client_timeout_s, 2.5)


def test_chunk_tokens_is_capped_as_the_namespace_caps_it():
    load_config(env={}, overrides={"chunk_tokens": 8192})
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"chunk_tokens": 8193})
    assert info.value.key == "chunk_tokens" and "8192" in str(info.value)


def test_every_knob_has_an_env_and_cli_spelling():
    """Each knob set through its variable and through its flag, to a value that is not its
    default (one equal to the default would pass with either spelling ignored)."""
    default = load_config(env={}).as_dict()
    other = {"size": "8MiB", "int": "3", "float": "0.5", "str": "/x", "bool": "true",
             "quotas": '[{tenant = "t", host_max = "8MiB"}]'}
    second = {"size": "16MiB", "int": "5", "float": "0.75", "bool": "false"}
    for knob in KNOBS:
        value = knob.choices[-1] if knob.choices else other[knob.kind]
        if knob.name == "client_timeout_s":
            value = "10"
        if load_config(env={}, overrides={knob.name: value}).as_dict()[knob.name] == default[knob.name]:
            value = second[knob.kind]
        got = load_config(env={f"KVD_{knob.name.upper()}": value}).as_dict()[knob.name]
        assert got != default[knob.name], (knob.name, value)
        assert got == load_config(env={}, overrides={knob.name: value}).as_dict()[knob.name]


def test_every_kvd_variable_the_project_reads_is_a_knob_or_listed():
    """The variables OTHER_VARIABLES lists are no typos: it must list every KVD_* variable
    the code, tests, Makefile, scripts and Dockerfile read or set that is not a knob's."""
    root = Path(__file__).resolve().parents[1]
    read = re.compile(r"""environ(?:\.get)?\(?\[?["'](KVD_\w+)|\b(KVD_\w+)=|ARG (KVD_\w+)""")
    found = set()
    files = [*root.glob("kvd/**/*.py"), *root.glob("clients/**/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("tools/**/*"), *root.glob("examples/*.py"), root / "Makefile",
             root / "Dockerfile"]
    for path in (p for p in files if p.is_file() and "__pycache__" not in p.parts):
        for m in read.finditer(path.read_text(errors="replace")):
            found.add(next(g for g in m.groups() if g))
    assert {"KVD_VLLM_PYTHON", "KVD_TEST_LOG_DIR", "KVD_EXTRAS"} <= found  # the scan sees them
    known = set(knob_variables()) | set(OTHER_VARIABLES)
    assert found - known == set()


def test_unknown_variables_name_the_closest_knob():
    env = {"KVD_HOST_CAPACTIY": "8GiB", "KVD_VLLM_PYTHON": "/x", "KVD_RUNTIME_DIR": "/r",
           "KVD_ZZZ": "1", "HOME": "/"}
    typo = ("environment variable KVD_HOST_CAPACTIY sets no kvd knob and is ignored (did you "
            "mean KVD_HOST_CAPACITY?)")
    other = "environment variable KVD_ZZZ sets no kvd knob and is ignored (kvd config lists the knobs)"
    assert unknown_variables(env) == [typo, other]
