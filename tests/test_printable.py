"""kvd.printable: what a peer's string looks like to an operator (no daemon)."""

from __future__ import annotations

from kvd.printable import printable


def test_control_characters_are_shown_escaped():
    assert printable("a\nb\r\tc") == "a\\nb\\r\\tc"
    assert printable("\x1b[2J\x07\x00\x7f\x9b") == "\\x1b[2J\\x07\\x00\\x7f\\x9b"
    assert printable("\u202eevil\u2028") == "\\u202eevil\\u2028"  # bidi override, line separator
    assert printable("naïve 名前") == "naïve 名前"  # printable Unicode stays


def test_bounded_and_idempotent():
    assert printable("x" * 1000) == "x" * 128 + "..."
    shown = printable("\x1b" * 1000)
    assert len(shown) == 128 * 4 + 3 and shown.isprintable()
    for text in ("a\nb", "\x1b]0;t\x07", "x" * 300):
        assert printable(printable(text)) == printable(text)
    assert printable(b"\x00") == "b'\\x00'" and printable(None) == "None"
