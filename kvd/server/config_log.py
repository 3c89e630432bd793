"""What ``kvd serve`` logs about its configuration as it starts.

``log_config(cfg)``: the config file, then one line per knob with its value
and where it came from (default, file, env, flag), each carrying ``knob``,
``value`` and ``source`` fields for JSON logs: at info level the knobs whose
value differs from the default (a start-up shows what was chosen, not 60
defaults), at debug level the others; then one info line counting them,
and a warning for each ``KVD_*`` environment variable that sets no knob (a
typo: kvd.config_env). ``kvd config --resolved`` prints every knob.
"""

from __future__ import annotations

import logging

from kvd.config import KNOBS
from kvd.config_env import unknown_variables

log = logging.getLogger("kvd")


def log_config(cfg) -> None:
    if cfg.file:
        log.info("config file %s", cfg.file)
    changed = 0
    for knob, (name, value, source) in zip(KNOBS, cfg.describe()):
        differs = getattr(cfg, name) != knob.default
        changed += differs
        log.log(logging.INFO if differs else logging.DEBUG, "config %s = %s (%s)", name, value,
                source, extra={"knob": name, "value": cfg.public(name), "source": source})
    log.info("config: %d of %d knobs differ from their defaults (each on a line above; every "
             "knob: log_level = debug, or kvd config --resolved)", changed, len(KNOBS))
    for line in unknown_variables():
        log.warning("%s", line)
