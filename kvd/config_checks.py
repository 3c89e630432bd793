"""Checks of knob values against each other, after every source was applied.

``check(values)`` takes the resolved knob values by name and raises
``ConfigError`` naming the first knob whose value does not fit the others
(or a fixed limit); it changes nothing. Single values are checked where they
are parsed (kvd.config). ``closest(key, names)`` is the hint for a key that
is no knob: the closest name, or where to find them.
"""

from __future__ import annotations

import difflib

from kvd import quota_rules
from kvd_protocol.errors import ConfigError
from kvd_protocol.limits import MAX_CHUNK_TOKENS


def check(values: dict) -> None:
    if values["chunk_tokens"] > MAX_CHUNK_TOKENS:
        raise ConfigError("chunk_tokens", f"must be <= {MAX_CHUNK_TOKENS}")
    if values["disk_high_watermark"] > 1.0:
        raise ConfigError("disk_high_watermark", "must be <= 1.0")
    if values["metrics_port"] > 65535:
        raise ConfigError("metrics_port", "must be <= 65535")
    if values["remote_publish"] == "demote" and values["remote_backend"] != "off" \
            and not values["disk_dir"]:
        raise ConfigError("remote_publish", "demote follows the disk tier's demotions: set "
                          "disk_dir, or use remote_publish = store")
    if values["verify_loads"] == "on" and not values["warm_restart"]:
        raise ConfigError("verify_loads", "on compares the checksums warm_restart keeps: set "
                          "warm_restart = true")
    if values["client_timeout_s"] <= values["heartbeat_interval_s"]:
        raise ConfigError("client_timeout_s", "must be larger than heartbeat_interval_s")
    try:
        quota_rules.check(values["quota"], values["host_capacity"], values["disk_dir"])
    except ValueError as exc:
        raise ConfigError("quota", str(exc)) from None


def closest(key, names) -> str:
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else "kvd config lists the knobs"
