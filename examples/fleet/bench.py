"""vLLM's own load generator against the proxy, and the counters the servers export.

``bench(args, url, tag)`` runs ``vllm bench serve`` (backend
``vllm``, the ``prefix_repetition`` dataset or, for ``--workload multi_turn``,
the ``custom`` one of examples/fleet/conversations.py; greedy, ``--ignore-eos``,
the same seed every pass: the same prompts in the same order) and returns its
``--save-result --save-detailed`` JSON. ``scrape(url)`` sums a server's
Prometheus counters by name and ``source`` label; ``hits(before, after)``
turns the deltas of all servers into prompt tokens by where they came from,
``engine_times(before, after)`` into the engines' own split of the time to
first token (queued, then prefill).
``summary(result)`` is the figures a table shows; ``pct`` a percentile.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import traceback
from pathlib import Path

from .procs import get

COUNTERS = ("vllm:prompt_tokens_by_source", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:kvd_",
            "vllm:request_success", "vllm:generation_tokens", "vllm:num_preemptions")
# the engine's own split of a request's time to first token (histograms: their _sum and _count)
TIMES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
         "prefill": "vllm:request_prefill_time_seconds"}


def bench(args, url: str, tag: str) -> dict:
    """One pass of ``vllm bench serve`` (its ``main``, run here: vLLM is imported once, not once
    a pass); its printout goes to ``logs/bench-<tag>.log``. Exits with that log on an error."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = args.work / f"bench-{tag}.json"
    argv = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", "fleet",
            "--tokenizer", str(args.model_dir), *dataset_args(args),
            "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
            "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    log = args.work / "logs" / f"bench-{tag}.log"
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        try:
            main(parser.parse_args(argv))
        except Exception as exc:  # noqa: BLE001 - reported with its log, then the run stops
            traceback.print_exc(file=f)
            f.flush()
            sys.exit(f"vllm bench serve ({tag}) failed: {exc!r}\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def dataset_args(args) -> list[str]:
    if args.workload == "multi_turn":  # the file examples/fleet/conversations.py wrote, in its order
        return ["--dataset-name", "custom", "--dataset-path", str(args.dataset), "--disable-shuffle",
                "--skip-chat-template", "--custom-output-len", str(args.output_len)]
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-output-len", str(args.output_len)]


def scrape(url: str) -> dict:
    """``{name or name{source=...}: value}`` of the counters above, summed over other labels."""
    out = {}
    try:
        text = get(url + "/metrics", 10.0).decode()
    except OSError:
        return out  # a server restarting: its counters start again from 0
    for line in text.splitlines():
        if not line.startswith(COUNTERS + tuple(TIMES.values())):  # "# HELP ..." lines too
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if not name.endswith(("_total", "_sum", "_count")):  # not a histogram's buckets
            continue
        source = name_labels.split('source="', 1)[1].split('"', 1)[0] if 'source="' in name_labels else ""
        key = f"{name}{{{source}}}" if source else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def grown(before: list[dict], after: list[dict], key: str) -> float:
    """How much ``key`` grew, summed over the servers (``scrape`` before and after)."""
    return sum(a.get(key, 0.0) - b.get(key, 0.0) for b, a in zip(before, after))


def hits(before: list[dict], after: list[dict]) -> dict:
    """Prompt tokens over all servers by source: ``gpu`` (vLLM's own prefix cache), ``external``
    (the connector: kvd or native CPU offloading), ``computed``; and kvd's own hit counter."""
    def delta(key: str) -> float:
        return grown(before, after, key)

    src = "vllm:prompt_tokens_by_source_total"
    return {"gpu": delta(src + "{local_cache_hit}"), "external": delta(src + "{external_kv_transfer}"),
            "computed": delta(src + "{local_compute}"), "kvd_hit_tokens": delta("vllm:kvd_hit_tokens_total"),
            "kvd_load_failures": delta("vllm:kvd_load_failures_total"),
            "preemptions": delta("vllm:num_preemptions_total")}


def engine_times(before: list[dict], after: list[dict]) -> dict:
    """The servers' own mean time to first token and its parts, in ms, over the requests that
    ended between ``before`` and ``after``: ``queue`` (waiting to be scheduled) and ``prefill``
    (scheduled to first token: a kvd or native load, then the computed part)."""
    out = {}
    for key, name in TIMES.items():
        total, count = grown(before, after, name + "_sum"), grown(before, after, name + "_count")
        out[f"{key}_mean_ms"] = round(total / count * 1e3, 2) if count > 0 else None
    return out


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


def ttft_p50_by_turn(r: dict, conversations: int) -> list[float]:
    """The multi-turn workload: the TTFT p50 of each turn's requests (the benchmark keeps its
    requests' order, round by round)."""
    ttfts = r.get("ttfts", [])
    rounds = [[t * 1e3 for t in ttfts[i:i + conversations] if t and t > 0]
              for i in range(0, len(ttfts), conversations)]
    return [round(pct(times, 50), 2) for times in rounds]


def texts(r: dict) -> list[str]:
    return list(r.get("generated_texts", []))


def save_text(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
