"""Every knob of the daemon, by area: one module an area, ``KNOBS`` their concatenation.

A new knob goes in its area's module (its order is the order of docs/config.md,
configs/kvd.toml and ``kvd config``); kvd.config parses, merges and renders them.
"""

from __future__ import annotations

from kvd.knobs import core, gpu, disk, remote, host, observe
from kvd.knobs.knob import Knob

KNOBS = core.KNOBS + gpu.KNOBS + disk.KNOBS + remote.KNOBS + host.KNOBS + observe.KNOBS

__all__ = ["KNOBS", "Knob"]
