"""The docs' figures from one source: the JSON files in docs/data/.

Every figure that the README and several pages quote is rendered from the
JSON a benchmark command wrote (``kvd bench --gpu --json``,
``examples/vllm_ttft.py --out``, ``examples/vllm_load.py --out``,
``examples/fleet.py --out``: tools/plot_fleet.py), never
typed in. In README.md and docs/*.md such a table sits between two markers,

    <!-- table: NAME -->
    ...rendered table, and the line naming the machine and the command...
    <!-- /table -->

and this tool rewrites or checks what is between them:

    python tools/plot_docs.py --check     # exit 1, naming each file and table, when one differs
    python tools/plot_docs.py --write     # rewrite every marked table from docs/data
    python tools/plot_docs.py --images [OUT_DIR]   # draw docs/img/*.png (needs kvd[plot])

After a new run: put its JSON in docs/data/ under the name in ``SOURCES``
(or next to the others for ``gpu_copy_*.json``), then ``--write`` and
``--images``. ``tests/test_docs_figures.py`` runs ``--check``.

The pictures of figures that live only on the performance page (host
backend, disk tier, the transformers TTFT example) are drawn from that
page's own tables (parsed here), so a picture cannot drift from its table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from docs_tables import block, k, ms, ttft_medians  # noqa: E402
from plot_fleet import cdf_images, render_fleet  # noqa: E402  (docs/fleet.md's blocks)
from plot_sglang import (render_sglang_breakdown, render_sglang_linker, render_sglang_load,  # noqa: E402
                         render_sglang_ttft, sglang_summary_row)

# name -> the docs/data files it reads (glob patterns, relative to docs/data)
SOURCES = {
    "vllm_ttft": ["vllm_ttft_h200.json"],
    "vllm_load": ["vllm_load_h200.json"],
    "gpu_copy": ["gpu_copy_*.json"],
    "summary": ["vllm_ttft_h200.json", "vllm_load_h200.json", "sglang_ttft_h100_linker.json",
                "gpu_copy_*.json"],
    "sglang_ttft": ["sglang_ttft_h200.json"],
    "sglang_linker": ["sglang_ttft_h100_linker.json"],
    "sglang_breakdown": ["sglang_ttft_h100_linker.json"],
    "sglang_load": ["sglang_load_h100.json"],
    "host_bench": ["host_bench_vm.json"],  # kvd bench --json: performance.md and restart.md
    "host_verify": ["host_bench_vm.json", "host_bench_vm_verify.json"],
    "fleet": ["fleet_*.json"],
}
BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.S)

POOLS = {"one": "one allocation (vLLM)", "per-layer": "one allocation per layer (SGLang)",
         "block-outer": "block-outer (vLLM `BLHNC`, opt-in)",
         "vmm": "virtual memory by file descriptor (vLLM 0.34)"}
SHAPES = {"llama3-8b": "Llama-3-8B", "deepseek-mla": "DeepSeek MLA"}
SHORT_SHAPES = {"llama3-8b": "Llama", "deepseek-mla": "MLA"}  # a bar's label
SUMMARY_COPIES = (("one", "llama3-8b", 16), ("per-layer", "deepseek-mla", 64))  # the README's rows


# ---- the data ---------------------------------------------------------------------

def load(root: Path, name: str) -> list[dict]:
    """The JSON documents table ``name`` is rendered from, in a stable order."""
    docs = []
    for pattern in SOURCES[name]:
        paths = sorted((root / "docs" / "data").glob(pattern))
        if not paths:
            raise FileNotFoundError(f"docs/data/{pattern}: no such file (table {name})")
        docs += [json.loads(p.read_text()) for p in paths]
    return docs


def kvd_hit(m: dict) -> float:
    """kvd's TTFT as an engine gets it by default: layer-wise loads where they ran."""
    return m.get("kvd-layerwise", m.get("kvd"))


def daemon_load(m: dict) -> float | None:
    """The daemon's load time in the hit ``kvd_hit`` picks (runs from before it was kept: None)."""
    return m.get("kvd-layerwise in kvd" if "kvd-layerwise" in m else "kvd in kvd")


def copy_rows(docs: list[dict]) -> list[dict]:
    """The pipelined rows of ``kvd bench --gpu --json`` files, each with its pool."""
    rows = []
    for doc in docs:
        for r in doc.get("pipelined", []):
            rows.append({**r, "pool": r.get("pool", doc.get("pool")), "doc": doc})
    order = list(POOLS)
    rows.sort(key=lambda r: (order.index(r["pool"]) if r["pool"] in order else 9, r["shape"] != "llama3-8b",
                             r["page"]))
    return rows


def model(doc: dict) -> str:
    if doc.get("model"):
        return doc["model"]
    if doc["args"].get("tiny"):
        return "a tiny Llama (2 layers of 128)"
    return f"Llama-3-8B shape, {doc['args']['layers']} layers, load_format=dummy"


def ratio(value: float) -> str:
    return "–" if value != value else f"{value:.2f}"  # nan: a phase not run


def source(doc: dict) -> str:
    return f"{doc['gpu']}: `{doc['command']}`"


# ---- the tables -------------------------------------------------------------------

def render_vllm_ttft(docs: list[dict]) -> str:
    doc = docs[0]
    rows = []
    for n, m in ttft_medians(doc).items():
        hit = kvd_hit(m)
        between = m.get("kvd") if n >= doc.get("kvd_async_from", 0) else None
        rows.append([k(n), ms(m.get("full")), ms(hit), ms(daemon_load(m)), ms(between),
                     ms(m.get("native")), ms(m.get("bound")),
                     f"{hit / m['bound']:.2f}" if "bound" in m else "–", f"{m['full'] / hit:.1f}×"])
    repeat = doc["args"]["repeat"]
    return block(["prefix", "full prefill", "kvd hit", "of it in kvd", "kvd hit, loaded between steps",
                  "vLLM native offload", "bound", "kvd / bound", "speedup"], rows,
                 f"{doc['gpu']}, vLLM {doc['vllm']}, {model(doc)}; a {doc['args']['suffix']}-token "
                 f"suffix after the prefix; medians of {repeat} prompts. From `{doc['command']}`.")


LOAD_ROLES = {"none": "no connector", "cold": "kvd, empty (stores everything, no hit)",
              "warm": "kvd, warm (a fresh engine, prompts in kvd)"}


def render_vllm_load(docs: list[dict]) -> str:
    doc = docs[0]
    roles, base = doc["roles"], doc["roles"]["none"]
    rows = []
    for role, label in LOAD_ROLES.items():
        load, dec = roles[role]["load"], roles[role]["decode"]
        rows.append([label, f"{load['tokens_per_s']:.0f}",
                     f"{load['tokens_per_s'] / base['load']['tokens_per_s']:.3f}",
                     f"{load['ttft_p50'] * 1e3:.0f} ms", f"{load['ttft_p99'] * 1e3:.0f} ms",
                     f"{dec['tokens_per_s']:.0f}",
                     f"{dec['tokens_per_s'] / base['decode']['tokens_per_s']:.3f}"])
    a = doc["args"]
    return block(["engine", "load: output tokens/s", "vs none", "TTFT p50", "TTFT p99",
                  "decode: tokens/s", "vs none"], rows,
                 f"{doc['gpu']}, vLLM {doc['vllm']}, {model(doc)}; {a['requests']} requests at once, "
                 f"each a shared {a['prefix']}-token prefix, {a['unique']} tokens of its own and "
                 f"{a['max_tokens']} output tokens; then {a['requests']} short prompts decoding "
                 f"{a['decode_tokens']} tokens each; {runs(a.get('repeat', 1))}. From `{doc['command']}`.")


def runs(repeat: int) -> str:
    return "one run of each engine" if repeat == 1 else f"medians of {repeat} runs of each engine"


def render_gpu_copy(docs: list[dict]) -> str:
    rows = [[POOLS.get(r["pool"], r["pool"]), SHAPES.get(r["shape"], r["shape"]), str(r["page"]),
             ratio(r["store_ratio"]), ratio(r["load_ratio"]), ratio(r["both_ratio"])]
            for r in copy_rows(docs)]
    return block(["pool (engine)", "model shape", "page (tokens)", "offload", "load", "both ways"], rows,
                 "Share of back-to-back pinned `cudaMemcpy`s of the same bytes timed right before each "
                 "run (both ways: against two memcpys on two streams); 2 engines with 4 requests each in "
                 "flight, random page ids, 256-token chunks, medians of 5 runs. From:", "",
                 *(f"- {source(doc)}" + (f" ({doc['note']})" if doc.get("note") else "") for doc in docs))


def render_summary(docs: list[dict]) -> str:
    ttft, load, sglang, copies = docs[0], docs[1], docs[2], copy_rows(docs[3:])
    med = ttft_medians(ttft)
    rows = []
    for n in (min(med), max(med)):
        m = med[n]
        rows.append([f"time to first token, {k(n)}-token prefix in kvd, vLLM {ttft['vllm']}",
                     f"{ms(kvd_hit(m))} ({m['full'] / kvd_hit(m):.1f}× sooner)",
                     f"{ms(m['full'])} full prefill; {ms(m.get('native'))} vLLM's own CPU offloading",
                     ttft["gpu"]])
    roles = load["roles"]
    rows.append([f"output tokens/s, {load['args']['requests']} requests sharing a "
                 f"{k(load['args']['prefix'])}-token prefix, vLLM {load['vllm']}",
                 f"{roles['warm']['load']['tokens_per_s']:.0f} "
                 f"({roles['warm']['load']['tokens_per_s'] / roles['none']['load']['tokens_per_s']:.2f}×)",
                 f"{roles['none']['load']['tokens_per_s']:.0f} without kvd", load["gpu"]])
    rows.append(sglang_summary_row(sglang))
    for r in copies:
        if (r["pool"], r["shape"], r["page"]) in SUMMARY_COPIES:
            rows.append([f"copy speed, {POOLS[r['pool']]} pool, {SHAPES[r['shape']]}, pages of {r['page']}: "
                         "offload / load / both ways",
                         " / ".join(ratio(r[f"{p}_ratio"]) for p in ("store", "load", "both")),
                         "1.00 = pinned `cudaMemcpy`", r["doc"]["gpu"].replace(" 80GB HBM3", "")])
    return block(["what", "with kvd", "against", "GPU"], rows,
                 "Commands, settings and the full tables: [docs/performance.md](docs/performance.md), "
                 "SGLang's in [docs/sglang.md](docs/sglang.md).")


def host_medians(doc: dict) -> dict:
    """what -> (median seconds, GB/s) of a host ``kvd bench --json`` file."""
    return {w: (statistics.median(s), doc["bytes"] / statistics.median(s) / 1e9)
            for w, s in doc["seconds"].items()}


def render_host_bench(docs: list[dict]) -> str:
    doc, med = docs[0], host_medians(docs[0])
    rows = [[w, f"{s * 1e3:.2f}", f"{gbps:.2f}", f"{med['numpy copy'][0] / s:.0%}"]
            for w, (s, gbps) in med.items()]
    return block(["what", "median ms", "GB/s", "vs numpy copy"], rows,
                 f"{doc['machine']}; medians of {len(doc['seconds']['load'])} runs. From "
                 f"`{doc['command']}`.")


def render_host_verify(docs: list[dict]) -> str:
    (off, on), rows = docs, []
    for doc in docs:
        s, gbps = host_medians(doc)["load"]
        rows.append([f"`{'on' if doc['verify_loads'] else 'off'}`", f"{s * 1e3:.2f}", f"{gbps:.2f}"])
    more = host_medians(on)["load"][0] - host_medians(off)["load"][0]
    return block(["verify_loads", "load median ms", "GB/s"], rows,
                 f"{off['machine']}; {off['bytes'] / 1e6:.0f} MB per load (2048 tokens of Llama-3-8B): "
                 f"`on` adds {more * 1e3:.1f} ms to each, some {more * 8e3:.0f} ms per 16k tokens, on the "
                 f"2 default hashing threads. From `{off['command']}` and `{on['command']}`.")


RENDER = {"vllm_ttft": render_vllm_ttft, "vllm_load": render_vllm_load, "gpu_copy": render_gpu_copy,
          "summary": render_summary, "sglang_ttft": render_sglang_ttft, "host_bench": render_host_bench,
          "host_verify": render_host_verify, "fleet": render_fleet,
          "sglang_linker": render_sglang_linker, "sglang_breakdown": render_sglang_breakdown,
          "sglang_load": render_sglang_load}


# ---- checking and writing the marked blocks ----------------------------------------

def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def sync(root: Path, write: bool) -> list[str]:
    """Render every marked table; rewrite the files (``write``) or list what differs."""
    rendered, problems = {}, []
    for path in documents(root):
        text = path.read_text()

        def redo(m: re.Match) -> str:
            name = m.group(2)
            if name not in RENDER:
                problems.append(f"{path.relative_to(root)}: unknown table {name!r} "
                                f"(known: {', '.join(RENDER)})")
                return m.group(0)
            if name not in rendered:
                rendered[name] = RENDER[name](load(root, name))
            if m.group(3) != rendered[name]:
                problems.append(f"{path.relative_to(root)}: table {name} "
                                + ("rewritten from" if write else "differs from")
                                + f" docs/data ({', '.join(SOURCES[name])})")
            return m.group(1) + rendered[name] + m.group(4)

        new = BLOCK.sub(redo, text)
        if write and new != text:
            path.write_text(new)
    return problems


# ---- pictures ---------------------------------------------------------------------

def md_table(doc: str, heading: str) -> list[dict]:
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
    return float(re.match(r"[\d.]+", cell.replace("**", "").replace(",", "")).group())


def images(root: Path, out: Path) -> list[Path]:
    from kvd.bench.plot import bars
    out.mkdir(parents=True, exist_ok=True)
    perf = (root / "docs" / "performance.md").read_text()

    ttft = load(root, "vllm_ttft")[0]
    med = ttft_medians(ttft)
    bars(out / "vllm_ttft.png",
         f"vLLM {ttft['vllm']}, time to first token after a cached prefix (lower is better)",
         [f"{k(n)}-token prefix" for n in med],
         {"full prefill": [m["full"] * 1e3 for m in med.values()],
          "kvd hit (fresh engine)": [kvd_hit(m) * 1e3 for m in med.values()],
          "vLLM native CPU offload": [m["native"] * 1e3 for m in med.values()],
          "bound (suffix + pinned copy)": [m["bound"] * 1e3 for m in med.values()]},
         "ms", f"{ttft['gpu']}, vLLM {ttft['vllm']}, {model(ttft)}; {ttft['command']}", fmt="{:.0f}")

    copies = load(root, "gpu_copy")
    rows = copy_rows(copies)
    bars(out / "gpu_copy.png",
         "kvd's GPU copies as a share of pinned cudaMemcpy (2 engines x 4 requests in flight)",
         [f"{r['pool']}\n{SHORT_SHAPES[r['shape']]} p{r['page']}" for r in rows],
         {"offload": [r["store_ratio"] for r in rows], "load": [r["load_ratio"] for r in rows],
          "both ways": [r["both_ratio"] for r in rows]},
         "ratio to memcpy", f"{copies[0]['gpu']}; kvd bench --gpu --pipeline 4 --clients 2 --repeat 5 "
         "(docs/performance.md)", reference=1.0)

    rows = [r for r in md_table(perf, "## Prefix reuse with transformers") if "corrupt" not in r["prefix"]]
    bars(out / "ttft.png", "transformers, 256-token suffix after a cached prefix (lower is better)",
         [f"{int(r['prefix']) // 1024}k-token prefix" for r in rows],
         {"full prefill": [number(r["full ms"]) for r in rows],
          "with kvd (layer-wise load + suffix)": [number(r["kvd ms"]) for r in rows],
          "suffix prefill alone": [number(r["suffix ms"]) for r in rows]},
         "ms", "NVIDIA H200, torch 2.11, transformers 5.17; Llama-3-8B shape, 8 layers, bf16; medians of 3; "
         "examples/prefix_reuse.py --corrupt --repeat 3", fmt="{:.1f}")

    rows = md_table(perf, "## Host backend")
    bars(out / "host_bench.png", "Host backend: 268 MB per request through a private daemon",
         [r["what"] for r in rows], {"GB/s": [number(r["GB/s"]) for r in rows]}, "GB/s",
         f"{load(root, 'host_bench')[0]['machine']}; {load(root, 'host_bench')[0]['command']}")

    rows = md_table(perf, "## Disk tier")
    bars(out / "disk.png", "Disk tier vs raw O_DIRECT IO of the same files (1.0 = raw speed)",
         [f"{r['machine'].split(',')[0]}, {r['chunk']}" for r in rows],
         {"write": [number(r["tier/raw"]) for r in rows], "read": [number(r["tier/raw #2"]) for r in rows]},
         "tier / raw", "/tmp ext4 on virtio; 4 IO threads, median of 5; "
         "kvd bench --disk --disk-dir /tmp --disk-chunk 4MiB|32MiB", reference=1.0)
    cdf_images(load(root, "fleet"), out)
    return sorted(out.glob("*.png"))


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true",
                      help="exit 1 when a marked table differs from docs/data")
    what.add_argument("--write", action="store_true", help="rewrite the marked tables from docs/data")
    what.add_argument("--images", nargs="?", const=str(ROOT / "docs" / "img"), metavar="OUT_DIR",
                      help="draw the docs' PNGs (default docs/img; needs matplotlib)")
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)  # another tree (tests)
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.images:
        print("\n".join(str(p) for p in images(root, Path(args.images))))
        return 0
    problems = sync(root, write=args.write)
    for p in problems:
        print(p)
    if args.check and problems:
        print("run: python tools/plot_docs.py --write")
        return 1
    return 1 if any("unknown table" in p for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
