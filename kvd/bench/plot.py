"""Bar charts of benchmark tables (``kvd bench ... --plot FILE.png``), with matplotlib.

``bars(path, title, groups, series, ylabel, footer)`` draws one group of
bars per row of a table (``groups``: the row labels; ``series``: name ->
one value per row), each bar labelled with its value, and a footer naming
the machine and the command, so a picture never travels without what it
measured. ``require()`` fails early, with the install hint, when matplotlib
is missing (kvd-cache's ``plot`` extra). ``machine()`` describes this host.
Small PNGs (about 900x480 px).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys


class PlotUnavailable(RuntimeError):
    pass


def require() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from None


def machine(gpu: str | None = None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{gpu + ', ' if gpu else ''}{cpu}, {os.cpu_count()} cores"


def command() -> str:
    return "kvd " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def bars(path: str, title: str, groups: list, series: dict, ylabel: str, footer: str,
         fmt: str = "{:.2f}", reference: float | None = None) -> None:
    """Grouped bars; ``reference`` draws a dashed horizontal line (e.g. 1.0 for ratios)."""
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        drawn = ax.bar(xs, values, width, label=name)
        ax.bar_label(drawn, labels=[fmt.format(v) for v in values], fontsize=7, padding=2)
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, fontsize=8 if len(groups) <= 6 else 7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.text(0.01, 0.01, footer, fontsize=7, color="dimgrey", wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)
