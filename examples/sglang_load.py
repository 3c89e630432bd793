"""SGLang under load with and without kvd: throughput, TTFT percentiles, decode steps.

    python examples/sglang_load.py --out /tmp/sgl-load.json     # GPU: Llama-3-8B shape

Needs SGLang and kvd_client in this python (on the GPU machine: SGLang 0.5.16
staged by tools/gpu/stage_sglang.sh, run through its call2.sh); starts a
private ``kvd serve`` (``--chunk-tokens 64``, SGLang's page). Each engine is
an ``sglang.Engine`` (what ``sglang.launch_server`` runs) in its own process
(this script again, with ``--role``), Llama-3-8B shaped, ``load_format="dummy"``,
page 64, triton attention (``--attention-backend``), no CUDA graphs unless
``--cuda-graph``:

- ``none``: no hierarchical cache (SGLang's GPU radix cache only);
- ``none-pytree``: the same on SGLang's Python radix tree core
  (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``, which the ``kvd`` and
  ``linker`` engines run for kvd's token keys): beside ``linker``, what kvd
  itself costs, the tree's cost left out;
- ``hicache``: SGLang's hierarchical cache, its own host tier, no storage;
- ``kvd``: the same with kvd as its storage tier (``write_through``: every
  page a request computed is backed up to kvd), on a daemon that holds none
  of the prompts: no hit from kvd, what kvd costs an engine it does not
  help (lookups that miss, stores);
- ``linker``: SGLang ≥ 0.5.23 only: no host tier, kvd as the unified cache's
  external linker (kvd_client.sglang.linker), offloading every page;
- ``radix``: SGLang 0.5.16: no host tier, kvd's radix cache
  (``--radix-cache-backend kvd``, kvd_client.sglang.radix): a lookup per new
  request, every finished request's pages stored.

``--roles`` picks them (default ``none,hicache,kvd``). Each role runs two
workloads, ``--warmup`` times untimed (Triton compiles its kernels for these
shapes), then ``--repeat`` times on new prompts each (the same prompts in
every role):

- ``load``: ``--requests`` concurrent requests, each a shared prefix of
  ``--prefix`` tokens plus ``--unique`` tokens of its own, ``--max-tokens``
  output tokens each: output tokens/s over the wall time, TTFT p50/p99;
- ``decode``: as many requests of 16-token prompts (below a page: nothing
  for kvd to look up or store) generating ``--decode-tokens`` each: output
  tokens/s, what the backend costs by being there at all.

Medians, and ratios against the first role (``--roles`` order), are printed;
``--out`` keeps every run (with each request's TTFT). ``--trace``: kvd's
calls in the kvd engines (kvd_client.sglang.timeline), counted and timed
inside each timed load run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_breakdown  # noqa: E402
from sglang_ttft import linker_args, offer_plugin, python_radix_core, trace_file  # noqa: E402
from vllm_ttft import (LLAMA3_8B, add_common_args, environment, private_daemon,  # noqa: E402
                       run_role, write_config)

PAGE = 64  # SGLang's page size here, and the daemon's chunk
ROLES = ("none", "none-pytree", "hicache", "kvd", "linker", "radix")
PYTHON_TREE_ROLES = ("none-pytree", "kvd", "linker")  # SGLang >= 0.5.23: its Python radix tree core
KVD_ROLES = ("kvd", "linker", "radix")  # the engines with kvd in them: what --trace traces


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(n)]


def engine_args(args, role: str) -> dict:
    longest = args.prefix + args.unique + max(args.max_tokens, args.decode_tokens)
    kw = {"model_path": args.model, "load_format": "dummy", "dtype": "bfloat16", "random_seed": 0,
          "skip_tokenizer_init": True, "page_size": PAGE, "attention_backend": args.attention_backend,
          "sampling_backend": "pytorch", "disable_cuda_graph": not args.cuda_graph,
          "grammar_backend": "none", "context_length": longest + 64,
          "mem_fraction_static": args.mem_fraction_static, "log_level": "warning"}
    extra = {"kvd_runtime_dir": args.runtime_dir, **json.loads(args.extra)}
    if role in ("hicache", "kvd"):
        kw.update(enable_hierarchical_cache=True, hicache_ratio=2.0,
                  hicache_write_policy="write_through")
    if role == "kvd":
        kw.update(hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="timeout",
                  hicache_storage_backend_extra_config=json.dumps(
                      {"backend_name": "kvd", "module_path": "kvd_client.sglang.backend",
                       "class_name": "KvdHiCacheStorage", "interface_v1": 1, **extra}))
    if role == "radix":
        kw.update(radix_cache_backend="kvd", hicache_storage_backend_extra_config=json.dumps(extra))
    if role == "linker":
        kw.update(linker_args(extra))
    return kw


async def run_batch(llm, prompts: list, max_tokens: int) -> dict:
    import asyncio

    params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    async def one(prompt: list) -> tuple[float, int]:
        t0, first, n = time.perf_counter(), None, 0
        stream = await llm.async_generate(input_ids=prompt, sampling_params=params, stream=True)
        async for out in stream:
            first = first or time.perf_counter()
            n = out["meta_info"].get("completion_tokens", n)
        return first - t0, n

    t0, mono = time.perf_counter(), time.monotonic()
    done = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    ttft = sorted(d[0] for d in done)
    return {"tokens_per_s": sum(d[1] for d in done) / wall, "wall_s": wall,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
            "ttfts_ms": [round(t * 1e3, 1) for t in ttft], "window": [mono, time.monotonic()]}


def prepare(args, role: str) -> None:
    """What the engine's processes must find in the environment before SGLang starts."""
    if role == "radix":  # kvd-cache's plugin entry point, where it is not installed
        offer_plugin(Path(args.runtime_dir).parent)
    if role in PYTHON_TREE_ROLES:
        python_radix_core()


def role_main(args, role: str) -> dict:
    import sglang

    prepare(args, role)
    traced = args.trace and role in KVD_ROLES
    trace = trace_file(args.runtime_dir, role, traced)
    llm = sglang.Engine(**engine_args(args, role))
    run = llm.loop.run_until_complete
    try:
        run(run_batch(llm, [tokens("warm-up", 128)], 4))
        for w in range(args.warmup):  # Triton compiles its kernels for these shapes: not timed
            load, short = workloads(args, f"warm-up/{w}")
            run(run_batch(llm, short, args.decode_tokens))
            run(run_batch(llm, load, args.max_tokens))
        runs = {"decode": [], "load": []}
        for r in range(args.repeat):  # new prompts each repeat: the same ones in every role
            load, short = workloads(args, str(r))
            runs["decode"].append(run(run_batch(llm, short, args.decode_tokens)))
            runs["load"].append(run(run_batch(llm, load, args.max_tokens)))
            print(f"[{role}] repeat {r}: {json.dumps({k: v[-1] for k, v in runs.items()})}", flush=True)
        out = {**{k: medians(v) for k, v in runs.items()}, "runs": runs}
        if traced:
            out["trace"] = trace_in_runs(sglang_breakdown.read(trace), [r["window"] for r in runs["load"]])
        return out
    finally:
        llm.shutdown()


def workloads(args, seed: str) -> tuple[list, list]:
    """The prompts of one run: ``--requests`` sharing a prefix, and as many short ones."""
    shared = tokens(f"shared/{seed}", args.prefix)
    load = [shared + tokens(f"unique/{seed}/{i}", args.unique) for i in range(args.requests)]
    return load, [tokens(f"short/{seed}/{i}", 16) for i in range(args.requests)]


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]
            if isinstance(runs[0][key], (int, float))}


def trace_in_runs(lines: list[dict], windows: list) -> dict:
    """Per op of kvd's timeline, the calls that started inside the timed load runs: calls and
    milliseconds per run (median over the runs), the longest call, and the thread it ran on."""
    per_run = [{} for _ in windows]
    longest: dict = {}  # op -> (ms, thread)
    for x in lines:
        ms = (x["t1"] - x["t0"]) * 1e3
        for ops, (a, b) in zip(per_run, windows):
            if a <= x["t0"] <= b:
                calls, total = ops.get(x["op"], (0, 0.0))
                ops[x["op"]] = (calls + 1, total + ms)
                if ms >= longest.get(x["op"], (-1.0, ""))[0]:
                    longest[x["op"]] = (ms, x.get("thread", ""))
    return {op: {"calls": statistics.median(r.get(op, (0, 0.0))[0] for r in per_run),
                 "ms": round(statistics.median(r.get(op, (0, 0.0))[1] for r in per_run), 2),
                 "max_ms": round(longest[op][0], 2), "thread": longest[op][1]}
            for op in sorted(longest)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roles", default="none,hicache,kvd",
                    help=f"engines to run, comma-separated, the first the baseline ({', '.join(ROLES)})")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=4096, help="tokens every request shares")
    ap.add_argument("--unique", type=int, default=512, help="tokens of each request's own")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of a load request")
    ap.add_argument("--decode-tokens", type=int, default=256, help="output tokens of a decode request")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each workload per engine, new prompts each (medians reported)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of each workload per engine first, on prompts of their own "
                         "(Triton compiles its kernels for these shapes in the first)")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--cuda-graph", action="store_true", help="SGLang's CUDA graphs for decode")
    ap.add_argument("--extra", default="{}", help="more kvd_* options of the backend (JSON)")
    ap.add_argument("--trace", action="store_true",
                    help="kvd's timeline in the kvd engines (KVD_SGLANG_TRACE): per kvd call, "
                         "its calls and milliseconds inside each timed load run")
    add_common_args(ap, gpu_share=False)
    ap.set_defaults(host_capacity="16GiB")
    args = ap.parse_args()
    roles = [r for r in args.roles.split(",") if r]
    if not roles or not set(roles) <= set(ROLES):
        raise SystemExit(f"--roles: some of {', '.join(ROLES)}, not {args.roles!r}")
    if (args.prefix + args.unique) % PAGE:
        raise SystemExit(f"--prefix + --unique must be whole pages of {PAGE} tokens")
    if args.role:
        Path(args.role_out).write_text(json.dumps(role_main(args, args.role)))
        return
    flags = ("--chunk-tokens", str(PAGE))
    with tempfile.TemporaryDirectory(prefix="kvd-sgl-load-") as tmp, \
            private_daemon(args, Path(tmp), flags) as model:
        write_config(model, LLAMA3_8B, args.layers,
                     args.prefix + args.unique + max(args.max_tokens, args.decode_tokens) + 128)
        rows = {}
        for role in roles:
            rows[role] = run_role(args, role, Path(tmp), __file__)
            save(args, rows)  # the engines that ran survive a run cut short
    report(args, rows)


def report(args, rows: dict) -> None:
    base = next(iter(rows.values()))
    print(f"{'engine':>8}{'load tok/s':>12}{'vs first':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'decode tok/s':>14}{'vs first':>10}")
    for role, r in rows.items():
        load, dec = r["load"], r["decode"]
        load_ratio = load["tokens_per_s"] / base["load"]["tokens_per_s"]
        print(f"{role:>8}{load['tokens_per_s']:>12.0f}{load_ratio:>10.3f}"
              f"{load['ttft_p50'] * 1e3:>8.1f}ms{load['ttft_p99'] * 1e3:>8.1f}ms"
              f"{dec['tokens_per_s']:>14.0f}{dec['tokens_per_s'] / base['decode']['tokens_per_s']:>10.3f}")
    for role, r in rows.items():
        for op, t in r.get("trace", {}).items():
            print(f"[{role}] kvd {op}: {t['calls']:g} calls, {t['ms']:.1f} ms per load run "
                  f"(longest {t['max_ms']:.1f} ms, thread {t['thread']})")
    save(args, rows)


def save(args, rows: dict) -> None:
    if args.out:
        doc = {**environment("sglang"), "args": vars(args), "roles": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
