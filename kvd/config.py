"""The daemon's one typed configuration object.

Reads ``KNOBS`` (kvd.knobs: every knob a ``Knob`` with a type, default and help text, by
area). ``load_config``
merges, lowest precedence first, defaults, a TOML file, ``KVD_<KEY>`` variables and
``--<key>`` flags into a frozen ``Config`` that records each value's source.
Promises: a bad key or value raises ``ConfigError`` naming the key; TOML values must have
the knob's type; sizes take KiB.. or KB.. units, never a bare K/M/G/T (kvd/sizes.py).
``defaults_toml``/``resolved_toml`` render ``kvd config``; configs/kvd.toml and
docs/config.md list the same knobs (a test checks).
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import field, make_dataclass
from types import MappingProxyType

from kvd import config_checks, quota_rules
from kvd.knobs import KNOBS, Knob
from kvd.sizes import parse_size, size_text
from kvd_protocol.errors import ConfigError
from kvd_protocol.limits import MAX_TENANT_CHARS

KNOB_BY_NAME = {k.name: k for k in KNOBS}


HIDDEN = "<hidden>"
_PY_TYPES = {"size": int, "int": int, "float": float, "str": str, "bool": bool, "quotas": tuple}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _from_text(knob: Knob, text: str):
    """An environment or flag value (always text) as the knob's type."""
    text = text.strip()
    if knob.kind == "int":
        if not re.fullmatch(r"[+-]?\d+", text):
            raise ValueError(f"expected an integer, got {text!r}")
        return int(text)
    if knob.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if knob.kind == "bool":
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in _TRUE
    return parse_size(text) if knob.kind == "size" else text


def _typed(knob: Knob, value):
    """A TOML (or Python) value, which must already have the knob's type."""
    if knob.kind == "size":
        return parse_size(value)
    wanted = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}[knob.kind]
    if isinstance(value, bool) != (knob.kind == "bool") or not isinstance(value, wanted):
        noun = {"int": "an integer", "float": "a number", "bool": "true or false",
                "str": "a string"}[knob.kind]
        hint = " (write it without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"expected {noun}, got {value!r}{hint}")
    return float(value) if knob.kind == "float" else value


def _coerce(knob: Knob, value, text: bool):
    if knob.kind == "quotas":
        return quota_rules.parse(value, text and isinstance(value, str), MAX_TENANT_CHARS)
    out = _from_text(knob, value) if text and isinstance(value, str) else _typed(knob, value)
    if knob.kind == "float" and not math.isfinite(out):
        raise ValueError(f"must be a finite number, got {out}")
    if knob.minimum is not None and out < knob.minimum:
        raise ValueError(f"must be >= {knob.minimum}, got {out}")
    if knob.choices and out not in knob.choices:
        raise ValueError(f"must be one of {', '.join(knob.choices)}, got {out!r}")
    return out


class _ConfigMethods:
    def as_dict(self) -> dict:
        """The knobs' values by name (no sources)."""
        return {k.name: getattr(self, k.name) for k in KNOBS}

    def describe(self) -> list:
        """(name, value as TOML, source) of every knob, in table order; secrets hidden."""
        return [(k.name, toml_value(k, self.public(k.name)), self.sources[k.name]) for k in KNOBS]

    def public(self, name: str):
        """The value of knob ``name`` as it may be shown: a secret that is set is "<hidden>"."""
        value = getattr(self, name)
        return HIDDEN if KNOB_BY_NAME[name].secret and value else value


def _default_sources():
    return MappingProxyType(dict.fromkeys(KNOB_BY_NAME, "default"))


Config = make_dataclass(
    "Config",
    [(k.name, _PY_TYPES[k.kind], field(default=k.default)) for k in KNOBS]
    + [("sources", MappingProxyType, field(default_factory=_default_sources, compare=False,
                                           repr=False)),
       ("file", str | None, field(default=None, compare=False))],
    bases=(_ConfigMethods,), frozen=True)
Config.__module__ = __name__
Config.__doc__ = ("The resolved knobs (``cfg.host_capacity``), immutable; ``sources[name]`` says "
                  "where each value came from (default, file, env, flag), ``file`` the TOML file.")


def _apply(values: dict, sources: dict, data: dict, source: str, origin: str) -> None:
    for key, raw in data.items():
        knob = KNOB_BY_NAME.get(key)
        if knob is None:
            raise ConfigError(key, f"unknown key (from {origin}; {config_checks.closest(key, KNOB_BY_NAME)})")
        try:
            values[key] = _coerce(knob, raw, text=source != "file")
        except ValueError as exc:
            raise ConfigError(key, f"{exc} (from {origin})") from None
        sources[key] = source


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None


def load_config(path: str | None = None, env: dict | None = None,
                overrides: dict | None = None) -> Config:
    """Defaults < ``path`` (TOML) < ``env`` (default: os.environ) < ``overrides`` (flags;
    None means "not given")."""
    values = {k.name: k.default for k in KNOBS}
    sources = dict.fromkeys(values, "default")
    if path:
        _apply(values, sources, _read_toml(path), "file", path)
    env = os.environ if env is None else env
    from_env = {k.name: env[f"KVD_{k.name.upper()}"] for k in KNOBS if f"KVD_{k.name.upper()}" in env}
    _apply(values, sources, from_env, "env", "environment")
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    _apply(values, sources, flags, "flag", "command line")
    config_checks.check(values)
    return Config(**values, sources=MappingProxyType(sources), file=path or None)


# ---- rendering ---------------------------------------------------------------------------

def toml_value(knob: Knob, value) -> str:
    """``value`` as a TOML literal: sizes with a unit where one divides them."""
    if knob.kind == "size":
        text = size_text(value)
        return text if text.isdigit() else f'"{text}"'
    if knob.kind == "bool":
        return "true" if value else "false"
    if knob.kind == "quotas":
        return quota_rules.to_toml(value)
    if knob.kind == "str":
        return json.dumps(value)  # a TOML basic string for every value a knob takes
    return repr(value)


def display_value(knob: Knob, value) -> str:
    """``value`` as a person reads it (``--help``, logs): 1GiB, auto, false, ""."""
    text = toml_value(knob, value)
    return text[1:-1] if text.startswith('"') and len(text) > 2 else text


_PRECEDENCE = "# Precedence: defaults < this file (--config) < KVD_<KEY> env < command-line flags."


def defaults_toml() -> str:
    """Every knob with its help and default, as a commented TOML file (configs/kvd.toml)."""
    out = ["# kvd configuration. Every key is optional; shown with its default.", _PRECEDENCE, ""]
    for knob in KNOBS:
        out.append(f"# {knob.help}")
        out.append(f"# type: {knob.kind}" + (f", one of: {', '.join(knob.choices)}" if knob.choices else ""))
        out.append(f"{knob.name} = {toml_value(knob, knob.default)}")
        out.append("")
    return "\n".join(out)


def resolved_toml(cfg: Config) -> str:
    """``cfg`` as TOML, each line saying where its value came from."""
    out = ["# kvd configuration as resolved: defaults < file < KVD_<KEY> env < flags.",
           f"# file: {cfg.file or '(none)'}", ""]
    for name, value, source in cfg.describe():
        where = f"env KVD_{name.upper()}" if source == "env" else source
        out.append(f"{name} = {value}  # {where}")
    return "\n".join(out) + "\n"
