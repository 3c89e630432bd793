"""vLLM under load with and without kvd: throughput, TTFT percentiles, decode steps.

    python examples/vllm_load.py --out /tmp/load.json        # GPU: Llama-3-8B shape

Needs a GPU build of vLLM and kvd_client in this python (``pip install
'.[vllm]'`` from the checkout, or its ``clients`` on ``PYTHONPATH``); starts a
private ``kvd serve``. Each engine is vLLM's ``AsyncLLM`` (what ``vllm
serve`` runs, prefix caching on) in its own process (this script again, with
``--role``), on a Llama-3-8B-shaped config with ``load_format="dummy"``:

- ``none``: no connector;
- ``cold``: the connector on an empty daemon: every chunk is stored, none is
  a kvd hit (the cost of storing);
- ``warm``: a fresh engine with the connector after ``cold`` left every
  prompt in kvd (the first request of the shared prefix and every unique
  part are kvd hits; later ones hit vLLM's own prefix cache).

Each role runs two workloads:

- ``load``: ``--requests`` concurrent requests, each a shared prefix of
  ``--prefix`` tokens plus ``--unique`` tokens of its own, ``--max-tokens``
  output tokens each: output tokens/s over the wall time, TTFT p50/p99;
- ``decode``: the same number of requests with 16-token prompts (below a
  chunk: the connector has nothing to look up or store) generating
  ``--decode-tokens`` each: output tokens/s, the cost of the connector being
  loaded at all (CUDA graphs, per-step work).

Each workload runs ``--repeat`` times per engine, on new prompts each time
(the same prompts in every role, so the warm engine's are in kvd): medians
and ratios against ``none`` from the same run are printed; ``--out`` keeps
every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_ttft import (LLAMA3_8B, add_common_args, environment, private_daemon,  # noqa: E402
                       run_role, write_config)


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(n)]


def make_engine(args, role: str):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = {"model": args.model, "load_format": "dummy", "dtype": "bfloat16", "seed": 0,
          "max_model_len": args.prefix + args.unique + args.max_tokens + 64,
          "skip_tokenizer_init": True, "enable_prefix_caching": True,
          "gpu_memory_utilization": args.gpu_memory_utilization}
    if role != "none":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd_client.vllm", kv_role="kv_both",
            kv_connector_extra_config={**json.loads(args.extra), "runtime_dir": args.runtime_dir})
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))


async def run_batch(engine, prompts: list, max_tokens: int, tag: str) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    async def one(i: int, prompt: list) -> tuple[float, int]:
        t0, first, n = time.perf_counter(), None, 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                         request_id=f"{tag}-{i}"):
            first = first or time.perf_counter()
            n = len(out.outputs[0].token_ids)
        return first - t0, n

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    ttft = sorted(d[0] for d in done)
    return {"tokens_per_s": sum(d[1] for d in done) / wall, "wall_s": wall,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))]}


async def role_main(args, role: str) -> dict:
    engine = make_engine(args, role)
    try:
        await run_batch(engine, [tokens("warm-up", 64)], 4, "warm-up")
        runs = {"decode": [], "load": []}
        for r in range(args.repeat):  # new prompts each repeat: the same ones in every role
            shared = tokens(f"shared/{r}", args.prefix)
            load = [shared + tokens(f"unique/{r}/{i}", args.unique) for i in range(args.requests)]
            short = [tokens(f"short/{role}/{r}/{i}", 16) for i in range(args.requests)]
            runs["decode"].append(await run_batch(engine, short, args.decode_tokens, f"decode{r}"))
            runs["load"].append(await run_batch(engine, load, args.max_tokens, f"load{r}"))
            print(f"[{role}] repeat {r}: {json.dumps({k: v[-1] for k, v in runs.items()})}", flush=True)
        return {**{k: medians(v) for k, v in runs.items()}, "runs": runs}
    finally:
        engine.shutdown()


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=4096, help="tokens every request shares")
    ap.add_argument("--unique", type=int, default=512, help="tokens of each request's own")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of a load request")
    ap.add_argument("--decode-tokens", type=int, default=256, help="output tokens of a decode request")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each workload per engine, new prompts each (medians reported)")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    add_common_args(ap)
    ap.set_defaults(host_capacity="16GiB")  # the warm engine's hits: every repeat's prompts
    args = ap.parse_args()
    if args.role:
        Path(args.role_out).write_text(json.dumps(asyncio.run(role_main(args, args.role))))
        return
    with tempfile.TemporaryDirectory(prefix="kvd-load-") as tmp, private_daemon(args, Path(tmp)) as model:
        write_config(model, LLAMA3_8B, args.layers, args.prefix + args.unique + args.max_tokens + 128)
        rows = {role: run_role(args, role, Path(tmp), __file__) for role in ("none", "cold", "warm")}
    report(args, rows)


def report(args, rows: dict) -> None:
    base = rows["none"]
    print(f"{'engine':>8}{'load tok/s':>12}{'vs none':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'decode tok/s':>14}{'vs none':>9}")
    for role, r in rows.items():
        load, dec = r["load"], r["decode"]
        print(f"{role:>8}{load['tokens_per_s']:>12.0f}{load['tokens_per_s'] / base['load']['tokens_per_s']:>9.3f}"
              f"{load['ttft_p50'] * 1e3:>8.1f}ms{load['ttft_p99'] * 1e3:>8.1f}ms"
              f"{dec['tokens_per_s']:>14.0f}{dec['tokens_per_s'] / base['decode']['tokens_per_s']:>9.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({**environment(), "args": vars(args), "roles": rows}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()
