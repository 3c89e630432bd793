"""``printable(value, limit)``: a peer-supplied string as it may appear to an operator.

Every string another process sends that reaches a log line, ``kvd stats``,
``kvd top`` or a metric label goes through this one function: the result
has only printable characters (``str.isprintable``: no newline, ESC, other
C0/C1 control, line separator or bidirectional override), each other
character shown as its escape (``\\n``, ``\\x1b``, ``\\u202e``), and at
most ``limit`` characters of the value (a longer one ends in ``...``), so a
peer can neither forge a log line nor drive the operator's terminal. A
non-string is shown by its ``repr``, bounded the same way. Idempotent on
what it returns. Imports nothing.
"""

from __future__ import annotations

LIMIT = 128
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(value, limit: int = LIMIT) -> str:
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    code = ord(c)
    return _NAMED.get(c) or (f"\\x{code:02x}" if code < 0x100 else
                             f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
