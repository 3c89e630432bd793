"""What ``kvd serve`` logs about its configuration as it starts.

``log_config(cfg)``: the config file, one line per knob with its value and
where it came from (default, file, env, flag), each line carrying ``knob``,
``value`` and ``source`` fields for JSON logs; then a warning for each
``KVD_*`` environment variable that sets no knob (a typo:
kvd.config_env).
"""

from __future__ import annotations

import logging

from kvd.config_env import unknown_variables

log = logging.getLogger("kvd")


def log_config(cfg) -> None:
    if cfg.file:
        log.info("config file %s", cfg.file)
    for name, value, source in cfg.describe():
        log.info("config %s = %s (%s)", name, value, source,
                 extra={"knob": name, "value": cfg.public(name), "source": source})
    for line in unknown_variables():
        log.warning("%s", line)
