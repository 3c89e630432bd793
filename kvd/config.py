"""The daemon's one typed configuration object.

Every knob is a ``Knob`` with a type, a default and help text. Values come,
lowest precedence first, from the defaults, a TOML file (``--config``),
environment variables ``KVD_<KEY>`` (upper case) and command-line flags
``--<key-with-dashes>``. A bad key or value raises ``ConfigError`` naming
the key; ``kvd serve`` turns it into one line on stderr and exit code 2.
configs/kvd.toml and docs/config.md list the same knobs (a test checks).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass

from kvd_protocol.errors import ConfigError
from kvd_protocol.limits import MAX_CHUNK_TOKENS

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def parse_size(value) -> int:
    """Bytes from an int or a string such as '1GiB', '512 MiB', '4096'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"expected a size such as 1GiB or 4096, got {value!r}")


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "size", "int", "float", "str", "bool"
    default: object
    help: str
    minimum: float | None = None
    choices: tuple = ()


KNOBS = (
    Knob("runtime_dir", "str", "", "Directory for sockets and the lock (mode 0700). Empty: "
         "$KVD_RUNTIME_DIR, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/kvd, /run/kvd (root), /tmp/kvd-<uid>."),
    Knob("host_capacity", "size", 2**30, "Bytes of the shared-memory host tier.", minimum=4096),
    Knob("chunk_tokens", "int", 256, "Tokens per cached chunk (at most 8192); engines' page "
         "sizes must divide it.", minimum=1),
    Knob("max_message_bytes", "size", 64 * 2**20, "Largest request a client may send; larger "
         "messages drop that peer.", minimum=2**16),
    Knob("max_keys_per_request", "int", 2048, "Most chunk keys in one lookup, store or load "
         "(their per-key work holds the event loop: docs/benchmarks.md).", minimum=1),
    Knob("heartbeat_interval_s", "float", 5.0, "How often clients are asked to send a heartbeat.",
         minimum=0.05),
    Knob("client_timeout_s", "float", 30.0, "A client silent for this long is reaped.",
         minimum=0.2),
    Knob("lease_max_ms", "int", 60000, "Longest lease a lookup may take on its hits.", minimum=1),
    Knob("max_clients", "int", 1024, "Most sessions at once.", minimum=1),
    Knob("max_registrations", "int", 64, "Most KV pools one client may register.", minimum=1),
    Knob("copy_threads", "int", 2, "Threads of the host copy backend.", minimum=1),
    Knob("gpu", "str", "auto", "CUDA backend: auto (on when cupy and a GPU are present), on "
         "(fail start-up without them), off.", choices=("auto", "on", "off")),
    Knob("gpu_max_blocks", "int", 32, "Cap on thread blocks of one copy kernel, so copies leave "
         "the engines their SMs.", minimum=1),
    Knob("gpu_stage_slots", "int", 2, "Staging buffers per GPU and direction (copies go pool -> "
         "GPU buffer by kernel, buffer -> host tier by DMA); 0 copies straight to host memory.",
         minimum=0),
    Knob("gpu_stage_slot_bytes", "size", 32 * 2**20, "Bytes of one staging buffer; each GPU that "
         "registers a pool holds 2 x slots x this.", minimum=2**20),
    Knob("disk_dir", "str", "", "Directory of the disk tier (one file per chunk). Empty: no disk "
         "tier."),
    Knob("disk_capacity", "size", 64 * 2**30, "Bytes the disk tier may use (headers included).",
         minimum=8192),
    Knob("disk_io_threads", "int", 4, "Threads doing disk tier IO (reads and writes in flight).",
         minimum=1),
    Knob("disk_queue_chunks", "int", 256, "Demotions queued or in flight at most; more are "
         "dropped and counted, never waited for.", minimum=1),
    Knob("disk_high_watermark", "float", 0.9, "Host tier fill (fraction of host_capacity) above "
         "which the coldest chunks are copied to disk.", minimum=0.1),
    Knob("disk_min_hits", "int", 0, "Demote only chunks looked up at least this often (0: all).",
         minimum=0),
    Knob("disk_gds", "bool", False, "Load disk-only chunks straight into GPU pages with GPU "
         "Direct Storage (KvikIO; its compatibility mode where the machine lacks GDS), verified on "
         "the GPU. Without KvikIO, a GPU or a disk tier: a log line, and the host tier path."),
    Knob("disk_gds_slot_bytes", "size", 128 * 2**20, "Bytes of each of the 2 GPU Direct Storage "
         "buffers per GPU (a load reads as many chunks as fit, then the next batch).",
         minimum=2**20),
    Knob("shm_dir", "str", "/dev/shm", "Where the host arena and client pools live (tmpfs)."),
    Knob("log_level", "str", "info", "Logging level.", choices=("debug", "info", "warning", "error")),
)
KNOB_BY_NAME = {k.name: k for k in KNOBS}


def _coerce(knob: Knob, value):
    if knob.kind == "size":
        out = parse_size(value)
    elif knob.kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        out = int(value)
    elif knob.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        out = float(value)
    elif knob.kind == "bool":
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            value = value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        out = value
    else:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        out = value
    if knob.kind == "float" and not math.isfinite(out):
        raise ValueError(f"must be a finite number, got {out}")
    if knob.minimum is not None and out < knob.minimum:
        raise ValueError(f"must be >= {knob.minimum}, got {out}")
    if knob.choices and out not in knob.choices:
        raise ValueError(f"must be one of {', '.join(knob.choices)}, got {out!r}")
    return out


class Config:
    """Attribute access to the resolved knobs (``cfg.host_capacity``)."""

    def __init__(self, values: dict):
        self._values = dict(values)

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict:
        return dict(self._values)


def _apply(values: dict, source: dict, origin: str) -> None:
    for key, raw in source.items():
        knob = KNOB_BY_NAME.get(key)
        if knob is None:
            raise ConfigError(key, f"unknown key (from {origin})")
        try:
            values[key] = _coerce(knob, raw)
        except ValueError as exc:
            raise ConfigError(key, f"{exc} (from {origin})") from None


def load_config(path: str | None = None, env: dict | None = None, overrides: dict | None = None) -> Config:
    values = {k.name: k.default for k in KNOBS}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
        _apply(values, data, path)
    env = os.environ if env is None else env
    from_env = {k.name: env[f"KVD_{k.name.upper()}"] for k in KNOBS if f"KVD_{k.name.upper()}" in env}
    _apply(values, from_env, "environment")
    _apply(values, {k: v for k, v in (overrides or {}).items() if v is not None}, "command line")
    if values["chunk_tokens"] > MAX_CHUNK_TOKENS:
        raise ConfigError("chunk_tokens", f"must be <= {MAX_CHUNK_TOKENS}")
    if values["disk_high_watermark"] > 1.0:
        raise ConfigError("disk_high_watermark", "must be <= 1.0")
    if values["client_timeout_s"] <= values["heartbeat_interval_s"]:
        raise ConfigError("client_timeout_s", "must be larger than heartbeat_interval_s")
    return Config(values)
