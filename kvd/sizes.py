"""Byte sizes as people write them: ``parse_size('8GiB')``, ``size_text(2**30)``.

Sizes take an integer number of bytes or a number with a binary (KiB, MiB,
GiB, TiB: powers of 1024) or decimal (KB, MB, GB, TB: powers of 1000) unit,
case-insensitive; a bare K, M, G or T is refused as ambiguous, and a value
that is not a whole number of bytes is refused. Used by the configuration
(kvd.config) and the tools.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMBIGUOUS = ("k", "m", "g", "t")


def parse_size(value) -> int:
    """Bytes from an int or a string such as '1GiB', '512 MiB', '8GB', '4096'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if unit in _AMBIGUOUS:
            n, u = m.group(1), unit.upper()
            raise ValueError(f"{value.strip()!r} is ambiguous: write {n}{u}iB (powers of 1024) "
                             f"or {n}{u}B (powers of 1000)")
        if unit in _SIZE_UNITS:
            size = Fraction(m.group(1)) * _SIZE_UNITS[unit]
            if size.denominator != 1:
                raise ValueError(f"{value.strip()!r} is not a whole number of bytes")
            return int(size)
    raise ValueError(f"expected a size such as 1GiB or 4096, got {value!r}")


def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: '1GiB', '64MiB', '4097'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
