"""docs/sglang.md's tables, from ``examples/sglang_ttft.py`` and ``examples/sglang_load.py`` JSON.

- ``render_sglang_ttft``: kvd hits through HiCache's host pools (one report, ``--host-pools``);
- ``render_sglang_linker``: one merged report (``--merge``): full prefill, the suffix alone, the
  bound, SGLang's own host-tier hit and kvd's hit, with the ratios the targets name;
- ``render_sglang_breakdown``: the same report's per-hit timeline (``--trace``), medians per part;
- ``render_sglang_load``: throughput and TTFT under load per engine, against the first engine.
Called by tools/plot_docs.py; nothing here reads anything but the documents given.
"""

from __future__ import annotations

import statistics

from docs_tables import block, k, ms, ttft_medians

BREAKDOWN = ("before", "exists", "between", "get", "daemon", "after", "total")


def engine(doc: dict) -> str:
    """The machine and the engine every figure of a report ran on."""
    a = doc["args"]
    return (f"{doc['gpu']}, SGLang {doc['sglang']}, {a['attention_backend']} attention, Llama-3-8B shape, "
            f"{a['layers']} layers, load_format=dummy")


def setting(doc: dict) -> str:
    a = doc["args"]
    return f"{engine(doc)}; a {a['suffix']}-token suffix after the prefix; medians of {a['repeat']} prompts"


def kvd_pools(doc: dict) -> list[str]:
    """The kvd engines of a report (``kvd/<pool>`` runs), in the order they ran."""
    roles = (role for runs in doc["runs"].values() for role in runs)
    seen = dict.fromkeys(role[4:] for role in roles if role.startswith("kvd/"))
    return list(seen)


def render_sglang_ttft(docs: list[dict]) -> str:
    """kvd hits per host pool (default first) beside full prefill and the suffix alone."""
    doc = docs[0]
    pools, rows = doc["pools"], []
    for n, m in ttft_medians(doc).items():
        row = [k(n), ms(m.get("full")), ms(m.get("suffix"))]
        for pool in pools:
            row += [ms(m.get(f"kvd/{pool}")), ms(m.get(f"daemon_load/{pool}"))]
        hit = m.get(f"kvd/{pools[0]}")
        row.append(f"{m['full'] / hit:.1f}×" if hit and "full" in m else "–")
        rows.append(row)
    header = ["prefix", "full prefill", "suffix alone"]
    for pool in pools:
        header += [f"kvd hit, {pool} host pool", "of it in kvd"]
    return block(header + [f"speedup ({pools[0]})"], rows,
                 f"{setting(doc)}. From `{doc['command']}` and `{doc['command_full']}` ({doc['note']}).")


def whole(runs: dict, role: str, prefix: int) -> bool:
    return bool(runs.get(role)) and min(runs[role]) == prefix


def render_sglang_linker(docs: list[dict]) -> str:
    doc = docs[0]
    pool, rows, partial = kvd_pools(doc)[0], [], []
    for n, m in ttft_medians(doc).items():
        hit, host, runs = m.get(f"kvd/{pool}"), m.get("host"), doc["runs"][str(n)]
        if not (whole(runs, f"storage_hit_tokens/{pool}", n) and whole(runs, "host_hit_tokens", n)):
            partial.append(k(n))
        rows.append([k(n), ms(m.get("full")), ms(m.get("suffix")), ms(m.get("bound")), ms(host), ms(hit),
                     ms(m.get(f"daemon_load/{pool}")), f"{hit / m['bound']:.2f}×", f"{hit / host:.2f}×",
                     f"{m['full'] / hit:.1f}×"])
    hits = (f"some hits were short of the prefix at {', '.join(partial)}" if partial else
            "every hit, kvd's and SGLang's, took the whole prefix")
    return block(["prefix", "full prefill", "suffix alone", "bound", "SGLang host-tier hit",
                  f"kvd hit ({pool})", "of it in kvd", "kvd / bound", "kvd / host-tier hit", "speedup"], rows,
                 f"{setting(doc)}; {hits}. From `{doc['command']}`.")


def sglang_summary_row(doc: dict) -> list[str]:
    """The README's row: the longest prefix's kvd hit against full prefill and SGLang's host tier."""
    pool = kvd_pools(doc)[0]
    n, m = list(ttft_medians(doc).items())[-1]
    hit = m[f"kvd/{pool}"]
    return [f"time to first token, {k(n)}-token prefix in kvd, SGLang {doc['sglang']} ({pool})",
            f"{ms(hit)} ({m['full'] / hit:.1f}× sooner)",
            f"{ms(m['full'])} full prefill; {ms(m.get('host'))} SGLang's own host tier",
            doc["gpu"].replace(" 80GB HBM3", "")]


def render_sglang_breakdown(docs: list[dict]) -> str:
    doc = docs[0]
    pool, rows = kvd_pools(doc)[0], []
    for n, runs in sorted(doc["runs"].items(), key=lambda item: int(item[0])):
        cuts = [c for c in runs.get(f"breakdown/{pool}", []) if c]
        med = {s: statistics.median_high([c[s] for c in cuts if c.get(s) is not None] or [float("nan")])
               for s in BREAKDOWN}
        rows.append([k(int(n))] + [f"{med[s]:.1f}" for s in BREAKDOWN])
    return block(["prefix", "before (SGLang)", "exists (kvd)", "between (SGLang: the forward)",
                  "get (kvd)", "daemon's copy", "after (SGLang)", "total"], rows,
                 f"ms, medians of each part over the repeats; {setting(doc)}. From `{doc['command']}`.")


def warmed(args: dict) -> str:
    """How the runs began: untimed warm-up runs (``--warmup``), or none (the first run counted)."""
    n = args.get("warmup", 0)
    return f", after {n} untimed {'run' if n == 1 else 'runs'}" if n else " (the first run included)"


def render_sglang_load(docs: list[dict]) -> str:
    doc = docs[0]
    roles = doc["roles"]
    first = roles[next(iter(roles))]
    rows = []
    for role, r in roles.items():
        load, dec = r["load"], r["decode"]
        spread = [x["tokens_per_s"] for x in r.get("runs", {}).get("load", [])]
        rows.append([role, f"{load['tokens_per_s']:.0f}",
                     f"{min(spread):.0f}–{max(spread):.0f}" if spread else "–",
                     f"{load['tokens_per_s'] / first['load']['tokens_per_s']:.2f}",
                     f"{load['ttft_p50'] * 1e3:.0f} ms", f"{load['ttft_p99'] * 1e3:.0f} ms",
                     f"{dec['tokens_per_s']:.0f}",
                     f"{dec['tokens_per_s'] / first['decode']['tokens_per_s']:.2f}"])
    a = doc["args"]
    return block(["engine", "load: output tokens/s", "its runs", "vs first", "TTFT p50", "TTFT p99",
                  "decode: tokens/s", "vs first"], rows,
                 f"{engine(doc)}; {a['requests']} requests at once, each a shared {a['prefix']}-token "
                 f"prefix, {a['unique']} tokens of its own and {a['max_tokens']} output tokens; then "
                 f"{a['requests']} short prompts decoding {a['decode_tokens']} tokens each; medians of "
                 f"{a['repeat']} runs of each engine{warmed(a)}. From `{doc['command']}`.")
