"""A knob: one typed setting of the daemon, with its default and help text (never its value).

``kind`` says how kvd.config parses and renders it; ``secret`` values are never printed."""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "size", "int", "float", "str", "bool", "quotas" (kvd/quota_rules.py)
    default: object
    help: str
    minimum: float | None = None
    choices: tuple = ()
    secret: bool = False  # never printed or logged (kvd config, start-up log): "<hidden>"
