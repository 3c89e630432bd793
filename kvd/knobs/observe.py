"""Knobs of what operators see: the log and the Prometheus /metrics endpoint.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd.knobs.knob import Knob

KNOBS = (
    Knob("log_level", "str", "info", "Logging level.", choices=("debug", "info", "warning", "error")),
    Knob("metrics_port", "int", 0, "TCP port of the Prometheus /metrics endpoint (needs kvd-cache[metrics]); "
         "0: off.", minimum=0),
    Knob("metrics_address", "str", "127.0.0.1", "Address the /metrics endpoint binds (0.0.0.0: every "
         "interface)."),
    Knob("metrics_socket", "str", "", "Unix socket that also serves /metrics (curl --unix-socket "
         "PATH http://kvd/metrics), open like the engine socket to the daemon's user, root and "
         "access_group only (unlike the TCP port, which any local user reaches); relative to "
         "runtime_dir. Empty: none."),
    Knob("metrics_max_connections", "int", 64, "Connections the /metrics endpoint serves at once, "
         "on the port and on metrics_socket each (lowered to a quarter of the open files limit "
         "in all); one more is closed as soon as it is accepted.", minimum=1),
    Knob("metrics_timeout_s", "float", 5.0, "Seconds a /metrics connection has to send its request "
         "and read the reply; then it is closed.", minimum=0.1),
    Knob("log_format", "str", "text", "Log line format: text, or json (one object per line with "
         "time, level, message and the line's fields) for log shippers.", choices=("text", "json")),
)
