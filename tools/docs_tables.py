"""What every docs table renderer shares: medians of a TTFT report, units, and the Markdown table.

``ttft_medians(doc)`` reads the ``runs`` of an ``examples/*_ttft.py --out`` report (prefix ->
role -> seconds per repeat) into prefix -> role -> median, with ``bound`` = the suffix alone
plus the prefix's bytes at one pinned copy (``floor``), as the examples compute it; lists that
are not numbers (a traced run's per-hit breakdowns) are left to their own renderer.
``block(header, rows, *notes)`` is a marked block's text. Used by tools/plot_docs.py and
tools/plot_sglang.py; nothing here reads a file.
"""

from __future__ import annotations

import statistics


def ttft_medians(doc: dict) -> dict:
    """prefix tokens -> {role: median seconds}, bound = suffix + floor (as the examples compute)."""
    out = {}
    for prefix, runs in doc["runs"].items():
        m = {role: statistics.median(v) for role, v in runs.items()
             if v and all(isinstance(x, (int, float)) for x in v)}
        if "suffix" in m and "floor" in m:
            m["bound"] = m["suffix"] + m["floor"]
        out[int(prefix)] = m
    return dict(sorted(out.items()))


def k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def block(header: list[str], rows: list[list[str]], *notes: str) -> str:
    """A marked block's text: the table, a blank line, then the ``notes`` lines under it."""
    return "\n".join([*table(header, rows), "", *notes]) + "\n"
