"""The options of an engine adapter (kvd_client.vllm, kvd_client.sglang).

``Option(type, default, help, choices=(), positive=False)``: every option
has a type, a default and help text (the adapters' docs list them from
their ``OPTIONS`` tables). ``checked(label, option, value)`` returns the
value, an int widened to float where a float is asked, or raises
``ValueError`` naming ``label``: a wrong type (bools are not numbers), a
value outside ``choices``, a negative number (or, with ``positive``, zero).
Plain data: no engine import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    type: type
    default: object
    help: str
    choices: tuple = ()
    positive: bool = False  # numbers: > 0 instead of >= 0


def checked(label: str, opt: Option, value):
    if opt.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not opt.type:
        raise ValueError(f"{label} must be a {opt.type.__name__}, got {value!r}")
    if opt.choices and value not in opt.choices:
        raise ValueError(f"{label} must be one of {', '.join(map(repr, opt.choices))}, got {value!r}")
    if opt.type in (int, float) and (value <= 0 if opt.positive else value < 0):
        raise ValueError(f"{label} must be {'positive' if opt.positive else '>= 0'}, got {value!r}")
    return value
