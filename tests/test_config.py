"""The knob table and config resolution (kvd.config): defaults, TOML, env, flags, errors."""

from __future__ import annotations

import math

import pytest

from kvd.config import KNOB_BY_NAME, KNOBS, load_config, parse_size
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
    assert cfg.copy_threads == 2  # default


def test_env_is_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVD_MAX_REGISTRATIONS", "3")
    assert load_config().max_registrations == 3
    assert load_config(env={}).max_registrations == 64


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1GiB", 2**30), ("512 MiB", 512 * 2**20), (" 1.5KiB ", 1536),
    ("1kb", 1000), ("2G", 2 * 10**9), ("3TB", 3 * 10**12), ("1tib", 2**40), ("7b", 7),
    (12345, 12345), ("0", 0),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "1 XB", "-1", "", "GiB", "1e3", "1,000", True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


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
    for knob in KNOBS:
        value = {"size": "8MiB", "int": "3", "float": "0.5", "str": "/x", "bool": "true"}[knob.kind]
        if knob.choices:
            value = knob.choices[-1]
        if knob.name == "client_timeout_s":
            value = "10"
        got = load_config(env={f"KVD_{knob.name.upper()}": value}).as_dict()[knob.name]
        assert got == load_config(env={}, overrides={knob.name: value}).as_dict()[knob.name]
