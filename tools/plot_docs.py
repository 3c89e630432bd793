"""Draw docs/img/*.png from the measured tables in docs/benchmarks.md.

The figures come from the document's own tables (parsed here, never typed
in), so a picture cannot drift from the numbers next to it; each footer
names the machine and the command of that section. Rerun after a table
changes (needs matplotlib: ``pip install 'kvd[plot]'``):

    .venv/bin/python tools/plot_docs.py [OUT_DIR]   # default docs/img
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvd.bench.plot import bars  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "docs" / "img"


def table(doc: str, heading: str) -> list[dict]:
    """The first markdown table after ``heading``, as one dict per row (cells stripped)."""
    start = doc.index(heading)
    lines = doc[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header = [h if rows[0].index(h) == i else f"{h} #2" for i, h in enumerate(rows[0])]  # repeated names
    return [dict(zip(header, r)) for r in rows[2:]]


def number(cell: str) -> float:
    return float(re.match(r"[\d.]+", cell.replace("**", "")).group())


def ttft(doc: str, out: Path) -> None:
    rows = [r for r in table(doc, "## Time to first token") if "corrupt" not in r["prefix"]]
    labels = [f"{int(r['prefix']) // 1024}k-token prefix" for r in rows]
    bars(out / "ttft.png", "Time to first token, 256-token suffix after a cached prefix (lower is better)",
         labels, {"full prefill": [number(r["full ms"]) for r in rows],
                  "with kvd (layer-wise load + suffix)": [number(r["kvd ms"]) for r in rows],
                  "suffix prefill alone": [number(r["suffix ms"]) for r in rows]},
         "ms", "NVIDIA H200, torch 2.11, transformers 5.17; Llama-3-8B shape, 8 layers, bf16; medians of 3; "
         "examples/prefix_reuse.py --corrupt --repeat 3 (docs/benchmarks.md)", fmt="{:.1f}")


def gpu_path(doc: str, out: Path) -> None:
    rows = table(doc, "### Final figures")
    bars(out / "gpu_path.png", "CUDA path, 2 clients x 4 requests in flight, as a share of pinned cudaMemcpy",
         [f"{r['shape']}\npage {r['page']}" for r in rows],
         {"offload (store)": [number(r["offload ratio"]) for r in rows],
          "load": [number(r["load ratio"]) for r in rows],
          "both at once": [number(r["both ratio"]) for r in rows]},
         "ratio to memcpy", "NVIDIA H100 80GB HBM3; 8 chunks of 256 tokens per request, median of 5; "
         "python3 -m kvd bench --gpu --pipeline 4 --clients 2 (docs/benchmarks.md)", reference=1.0)


def gpu_path_steady(doc: str, out: Path) -> None:
    rows = table(doc, "And every page size with each layer in its own allocation")
    bars(out / "gpu_path_steady.png", "CUDA path, 2 clients x 4 requests in flight, against back-to-back "
         "pinned memcpy timed before each run", [f"{r['shape']}\npage {r['page']}" for r in rows],
         {"offload (store)": [number(r["offload"]) for r in rows],
          "load": [number(r["load"]) for r in rows],
          "both at once": [number(r["both"]) for r in rows]},
         "ratio to memcpy", "NVIDIA H100 80GB HBM3, 2026-11-26; per-layer pools, 8 chunks of 256 tokens "
         "per request, median of 5; python3 -m kvd bench --gpu --pipeline 4 --clients 2 "
         "(docs/benchmarks.md)", reference=1.0)


def host(doc: str, out: Path) -> None:
    rows = table(doc, "## Host backend (`kvd bench`)")
    bars(out / "host_bench.png", "Host backend: 268 MB per request through a private daemon",
         [r["what"] for r in rows], {"GB/s": [number(r["GB/s"]) for r in rows]}, "GB/s",
         "2-core CI/developer VM (Intel Xeon, 24 GiB); .venv/bin/kvd bench (docs/benchmarks.md)")


def disk(doc: str, out: Path) -> None:
    rows = table(doc, "## Disk tier (`kvd bench --disk`)")
    labels = [("2-core VM" if r["machine"].startswith("2-core") else "GPU machine") + f", {r['chunk']}"
              for r in rows]
    bars(out / "disk.png", "Disk tier vs raw O_DIRECT IO of the same files (1.0 = raw speed)",
         labels, {"write": [number(r["tier/raw"]) for r in rows],
                  "read": [number(r["tier/raw #2"]) for r in rows]},
         "tier / raw", "/tmp ext4 on virtio; 4 IO threads, median of 5; "
         ".venv/bin/kvd bench --disk --disk-dir /tmp --disk-chunk 4MiB|32MiB (docs/benchmarks.md)",
         reference=1.0)


def main(argv: list) -> int:
    out = Path(argv[0]) if argv else OUT
    out.mkdir(exist_ok=True)
    doc = DOC.read_text()
    for draw in (ttft, gpu_path, gpu_path_steady, host, disk):
        draw(doc, out)
    print("\n".join(sorted(str(p) for p in out.glob("*.png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
