"""Prefix reuse across two engine processes through kvd, with a real transformer.

One private ``kvd serve --gpu on`` daemon and two engine processes (spawned):

- engine A prefills long prompt prefixes with a Hugging Face ``LlamaForCausalLM``
  (Llama-3-8B shape, ``--layers`` layers, random weights from a fixed seed,
  bf16, SDPA), copies each layer's K and V into its paged KV pool (vLLM
  flash-attn layout, one ``[2, num_blocks, page_size, kv_heads, head_dim]``
  tensor per layer, registered with ``CudaKVPool``) and stores the chunks
  through ``kvd_client``;
- engine B, a separate process with its own pool and the same weights, gets
  each prefix plus a new random suffix and measures, median of ``--repeat``
  CUDA-synchronised runs:

  (a) ``full``: a full prefill of the prompt (the reference logits);
  (c) ``suffix``: the suffix-only prefill with the prefix KV already in its
      pool (computed by B itself, not through kvd);
  (b) ``kvd``: lookup, ``submit_load(..., layerwise=True)`` into other pages, and the
      suffix-only prefill where layer i's forward pre-hook waits for layer
      i's copy (``wait_for_layer``, a stream wait) and gathers its pages, so
      layer i computes while later layers are still arriving;

  and ``floor`` = one pinned host->GPU copy of the loaded KV bytes, timed in
  the same run. ``bound`` = full / (suffix + floor); ``speedup`` = full / kvd.

Correctness: B's next-token logits through kvd must match the full prefill
within a bf16 tolerance (see ``check_logits``), with the same argmax (or a
tie within the tolerance). ``--corrupt`` adds one more prompt whose stored
KV has one byte flipped in engine A's pool before the store (so the daemon
holds a corrupted chunk); that prompt's check is expected to fail.

Exit status: 1 if an uncorrupted prompt fails its check, else 0 (a corrupted
prompt that passes is reported as MISSED but does not change the status).

    PYTHONPATH=$PWD/clients:$PWD python3 examples/prefix_reuse.py --out /tmp/e2e.json

A CUDA GPU with torch, transformers and CuPy only: elsewhere it says so in one line, exit
status 2 (on CPU, examples/vllm_ttft.py --tiny runs vLLM's CPU engines through kvd).

``--plot FILE.png`` draws the TTFT table (full prefill, with kvd, suffix
alone per prefix; needs matplotlib); ``--replot RESULT.json`` redraws it
(and reprints the table) from an earlier ``--out`` without running anything.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from prefix_reuse_model import (SEED, build_model, cache_to_pool, check_logits, corrupt_byte,
                                 full_prefill, model_shape, prefill_from_pool, weights_fingerprint)

DEVICE = "cuda"  # the engines' device (a CPU dry run with a fake client sets "cpu")


# ---- prompts ---------------------------------------------------------------------------

def prompts(args) -> list[dict]:
    """One prompt per prefix length (+ a corrupted one with --corrupt)."""
    vocab = model_shape(args)["vocab_size"]
    out = []
    specs = [(n, False) for n in args.prefix_lens]
    if args.corrupt:
        specs.append((min(args.prefix_lens), True))
    for j, (n, corrupt) in enumerate(specs):
        if n % args.chunk_tokens or n % args.page_size:
            raise SystemExit(f"prefix {n} must be a multiple of --chunk-tokens and --page-size")
        rng = np.random.default_rng(1000 + j)
        prefix = rng.integers(0, vocab, n, dtype=np.int64)  # numpy: kvd_client hashes it without
        suffix = rng.integers(0, vocab, args.suffix, dtype=np.int64)  # a list conversion
        out.append({"name": f"{n}{' corrupt' if corrupt else ''}", "prefix": prefix,
                    "suffix": suffix, "corrupt": corrupt})
    return out


def _model_name(args) -> str:
    return f"llama3-8b-shape-random-seed{SEED}-L{args.layers}{'-tiny' if args.tiny else ''}"


def _make_pool(torch, shape, pages: int, page_size: int):
    return [torch.zeros(2, pages, page_size, shape["num_key_value_heads"], shape["head_dim"],
                        dtype=torch.bfloat16, device=DEVICE) for _ in range(shape["num_hidden_layers"])]


def _connect(args, rundir: str, pool):
    """A client of the private daemon with ``pool`` registered (vLLM flash-attn layout)."""
    from kvd_client import KvdClient
    from kvd_client.torch_pool import CudaKVPool
    client = KvdClient(runtime_dir=rundir, timeout=300, raise_errors=True).connect()
    client.register_kv(CudaKVPool("vllm_flash_attn", pool), model=_model_name(args))
    return client


def _sync(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---- engine A --------------------------------------------------------------------------

def engine_a(args, rundir: str, q) -> None:
    try:
        q.put(("ok", _engine_a(args, rundir)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def _engine_a(args, rundir: str) -> dict:
    import torch

    shape = model_shape(args)
    model = build_model(shape, DEVICE)
    pages_max = max(args.prefix_lens) // args.page_size
    pool = _make_pool(torch, shape, pages_max, args.page_size)
    client = _connect(args, rundir, pool)
    stored = {}
    for p in prompts(args):
        n = len(p["prefix"])
        pages = torch.randperm(pages_max, device=DEVICE)[: n // args.page_size]
        ids = torch.from_numpy(p["prefix"]).unsqueeze(0).to(DEVICE)
        _, cache = full_prefill(model, ids)
        cache_to_pool(cache, pool, pages, n)
        del cache
        if p["corrupt"]:  # one byte of one chunk: layer 0, K plane, the middle token
            tok = n // 2
            page, row = int(pages[tok // args.page_size]), tok % args.page_size
            corrupt_byte(pool, page, row)
        stored[p["name"]] = client.store(p["prefix"], pages.cpu().numpy())
        if stored[p["name"]] != n:
            raise RuntimeError(f"stored {stored[p['name']]} of {n} tokens for prefix {p['name']}")
    client.close()
    return {"stored": stored, "fingerprint": weights_fingerprint(model)}


# ---- engine B --------------------------------------------------------------------------

def engine_b(args, rundir: str, q) -> None:
    try:
        q.put(("ok", _engine_b(args, rundir)))
    except BaseException as exc:  # noqa: BLE001
        import traceback
        q.put(("error", f"{exc!r}\n{traceback.format_exc()}"))


def _timed(torch, fn):
    _sync(torch)
    t0 = time.perf_counter()
    out = fn()
    _sync(torch)
    return time.perf_counter() - t0, out


def _engine_b(args, rundir: str) -> dict:
    import torch

    shape = model_shape(args)
    model = build_model(shape, DEVICE)
    per_prefix = max(args.prefix_lens) // args.page_size
    pool = _make_pool(torch, shape, 2 * per_prefix, args.page_size)
    client = _connect(args, rundir, pool)
    kv_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    host = torch.empty(max(args.prefix_lens) * kv_per_token, dtype=torch.uint8,
                       pin_memory=DEVICE == "cuda")
    dev = torch.empty_like(host, device=DEVICE)
    rows = []
    for p in prompts(args):
        n = len(p["prefix"])
        perm = torch.randperm(2 * per_prefix, device=DEVICE)
        local, loaded = perm[: n // args.page_size], perm[per_prefix: per_prefix + n // args.page_size]
        prompt = np.concatenate([p["prefix"], p["suffix"]])
        ids = torch.from_numpy(prompt).unsqueeze(0).to(DEVICE)
        suffix_ids = torch.from_numpy(p["suffix"]).unsqueeze(0).to(DEVICE)
        loaded_ids = loaded.cpu().numpy()
        nbytes = n * kv_per_token
        # B's own prefix KV in the `local` pages, for the suffix-only baseline
        _, cache = full_prefill(model, ids[:, :n])
        cache_to_pool(cache, pool, local, n)
        del cache
        times = {"full": [], "suffix": [], "kvd": [], "floor": []}
        ref = got = local_logits = None
        hit = 0
        for r in range(args.repeat + 1):  # run 0 warms up and is dropped
            t, ref = _timed(torch, lambda: full_prefill(model, ids)[0])
            times["full"].append(t)
            t, local_logits = _timed(torch, lambda: prefill_from_pool(
                model, pool, local, n, suffix_ids))
            times["suffix"].append(t)
            for t_ in pool:  # poison the target pages: what we read must be what kvd loaded
                t_.view(torch.uint8)[:, loaded] = 0xA5

            def via_kvd():
                nonlocal hit
                hit = client.lookup(prompt)
                if hit != n:
                    raise RuntimeError(f"lookup hit {hit} tokens of the {n}-token prefix")
                transfer = client.submit_load(prompt[:hit], loaded_ids, layerwise=True)
                out = prefill_from_pool(model, pool, loaded, hit, suffix_ids,
                                        before_layer=lambda i: client.wait_for_layer(i, transfer))
                if not transfer.wait().ok or transfer.tokens != hit:  # failed: recompute instead
                    raise RuntimeError(f"the layer-wise load failed: {transfer}")
                return out
            t, got = _timed(torch, via_kvd)
            times["kvd"].append(t)
            t, _ = _timed(torch, lambda: dev[:nbytes].copy_(host[:nbytes], non_blocking=True))
            times["floor"].append(t)
        kv_exact = all(torch.equal(x[:, loaded].view(torch.uint8), x[:, local].view(torch.uint8))
                       for x in pool)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        check = check_logits(got, ref, args.rtol)
        check_local = check_logits(local_logits, ref, args.rtol)
        bound = med["full"] / (med["suffix"] + med["floor"])
        speedup = med["full"] / med["kvd"]
        exposed = med["kvd"] - med["suffix"]  # load time not hidden behind compute
        rows.append({
            "prompt": p["name"], "prefix": n, "suffix": len(p["suffix"]), "corrupt": p["corrupt"],
            "kv_bytes": nbytes, "full_ms": med["full"] * 1e3, "suffix_ms": med["suffix"] * 1e3,
            "floor_ms": med["floor"] * 1e3, "kvd_ms": med["kvd"] * 1e3, "bound": bound,
            "speedup": speedup, "of_bound": speedup / bound, "exposed_load_ms": exposed * 1e3,
            "load_hidden": min(1.0, max(0.0, 1 - exposed / med["floor"])) if med["floor"] else None,
            "pinned_h2d_gbps": nbytes / med["floor"] / 1e9,
            "kv_bytes_equal_local": kv_exact, "logits": check, "logits_local_prefix": check_local,
            "logits_kvd_equal_local": bool(torch.equal(got, local_logits)),
            "times_ms": {k: [x * 1e3 for x in v[1:]] for k, v in times.items()}})
    client.close()
    return {"rows": rows, "fingerprint": weights_fingerprint(model),
            "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


# ---- driver ----------------------------------------------------------------------------

def _run_engine(ctx, target, args, rundir: str, timeout: float) -> dict:
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(args, rundir, q))
    proc.start()
    try:
        status, value = q.get(timeout=timeout)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"{target.__name__} failed: {value}")
    return value


def run(args) -> dict:
    """Daemon + engine A + engine B; returns the results (also written to --out)."""
    from kvd.bench.common import start_daemon, stop_daemon

    shape = model_shape(args)
    kv_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    total = sum(len(p["prefix"]) for p in prompts(args)) * kv_per_token
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvd-e2e-") as rundir:
        daemon = start_daemon(rundir, capacity=int(total * 1.25) + 2**26, chunk_tokens=args.chunk_tokens,
                               extra=["--gpu", "on"], log_path=args.daemon_log)
        try:
            a = _run_engine(ctx, engine_a, args, rundir, args.timeout)
            b = _run_engine(ctx, engine_b, args, rundir, args.timeout)
        finally:
            stop_daemon(daemon, rundir)  # also the host tier it keeps for a warm restart
    return assemble(args, a, b)


def assemble(args, a: dict, b: dict) -> dict:
    """The results of both engines as one record (written to --out)."""
    shape = model_shape(args)
    if abs(a["fingerprint"] - b["fingerprint"]) > 1e-6 * abs(a["fingerprint"]):
        raise RuntimeError(f"engines built different weights: {a['fingerprint']} vs {b['fingerprint']}")
    result = {"command": " ".join(sys.argv), "model": {**shape, "dtype": "bfloat16", "attn": "sdpa",
              "seed": SEED, "weights": "random"}, "page_size": args.page_size,
              "chunk_tokens": args.chunk_tokens, "suffix": args.suffix, "repeat": args.repeat,
              "rtol": args.rtol, "stored": a["stored"], **{k: b[k] for k in ("gpu", "torch", "transformers")},
              "rows": b["rows"]}
    result["clean_ok"] = all(r["logits"]["ok"] for r in b["rows"] if not r["corrupt"])
    result["corrupt_caught"] = (all(not r["logits"]["ok"] for r in b["rows"] if r["corrupt"])
                                if args.corrupt else None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def report(result: dict) -> None:
    print(f"{result['gpu']}, torch {result['torch']}, transformers {result['transformers']}; "
          f"{result['model']['num_hidden_layers']} layers of hidden {result['model']['hidden_size']}, "
          f"{result['model']['num_key_value_heads']} KV heads; suffix {result['suffix']}, page "
          f"{result['page_size']}, chunk {result['chunk_tokens']}; medians of {result['repeat']}")
    hdr = (f"{'prefix':>14}{'full ms':>9}{'suffix ms':>10}{'floor ms':>9}{'bound':>7}{'kvd ms':>8}"
           f"{'speedup':>8}{'of bound':>9}{'hidden':>7}{'rel err':>9}  logits")
    print(hdr)
    for r in result["rows"]:
        c = r["logits"]
        if r["corrupt"]:
            verdict = "differ: CAUGHT" if not c["ok"] else "match: MISSED"
        else:
            verdict = "ok" if c["ok"] else "FAIL"
            verdict += "" if c["argmax_same"] else " (argmax tie)"
        hidden = f"{r['load_hidden']:.0%}" if r["load_hidden"] is not None else "-"
        print(f"{r['prompt']:>14}{r['full_ms']:>9.1f}{r['suffix_ms']:>10.1f}{r['floor_ms']:>9.1f}"
              f"{r['bound']:>6.1f}x{r['kvd_ms']:>8.1f}{r['speedup']:>7.1f}x{r['of_bound']:>9.0%}"
              f"{hidden:>7}{c['rel']:>9.1e}  {verdict}")
    print(f"rel err = max|kvd - full| / max|full| over the vocab (tolerance {result['rtol']}); "
          f"hidden = 1 - (kvd - suffix) / floor")
    if result["corrupt_caught"] is not None:
        print("corrupted chunk " + ("caught by the logits check" if result["corrupt_caught"]
                                    else "NOT caught by the logits check"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the Llama-3-8B shape")
    p.add_argument("--prefix-lens", type=ints, default=[2048, 8192, 32768],
                   help="comma-separated prefix lengths (multiples of --chunk-tokens)")
    p.add_argument("--suffix", type=int, default=256, help="new tokens after each prefix")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per prompt (median; +1 warm-up)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of the engines' pools")
    p.add_argument("--chunk-tokens", type=int, default=256, help="the daemon's tokens per chunk")
    p.add_argument("--rtol", type=float, default=0.02,
                   help="logits tolerance: max abs diff <= rtol * max |reference logit|")
    p.add_argument("--corrupt", action="store_true",
                   help="also store one prefix with one byte flipped in one chunk (layer 0, K); "
                        "its logits check must fail")
    p.add_argument("--tiny", action="store_true", help="tiny model (hidden 256, 4 heads, 2 KV heads, "
                   "head dim 64, vocab 1000) for tests")
    p.add_argument("--timeout", type=float, default=1800, help="seconds each engine may take")
    p.add_argument("--daemon-log", default=None, metavar="PATH", help="the daemon's debug log")
    p.add_argument("--out", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the TTFT table as a bar chart")
    p.add_argument("--replot", default=None, metavar="RESULT.json", help="report and --plot an earlier "
                   "--out instead of running")
    return p.parse_args(argv)


def plot(result: dict, path: str) -> None:
    """Full prefill, kvd and suffix-only time per uncorrupted prompt, labelled with what ran."""
    from kvd.bench.plot import bars
    rows = [r for r in result["rows"] if not r["corrupt"]]
    m = result["model"]
    bars(path, f"Time to first token, {result['suffix']}-token suffix after a cached prefix "
         "(lower is better)", [str(r["prompt"]) for r in rows],
         {"full prefill": [r["full_ms"] for r in rows], "with kvd": [r["kvd_ms"] for r in rows],
          "suffix prefill alone": [r["suffix_ms"] for r in rows]}, "ms",
         f"{result['gpu']}, torch {result['torch']}, transformers {result['transformers']}; "
         f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}; medians of {result['repeat']}; "
         f"{result['command']}", fmt="{:.1f}")
    print(f"plot: {path}")


def missing_gpu_stack() -> str | None:
    """Why this example cannot run here (its engines are CUDA processes), or None."""
    import importlib.util
    missing = [m for m in ("torch", "transformers", "cupy") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs {', '.join(missing)} (and a CUDA GPU)"
    import torch
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch sees none)"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = None if args.replot else missing_gpu_stack()
    if problem:  # on CPU: examples/vllm_ttft.py --tiny runs vLLM CPU engines through kvd
        print(f"prefix_reuse: {problem}; on a CPU machine try examples/vllm_ttft.py --tiny",
              file=sys.stderr)
        return 2
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
    else:
        result = run(args)
    report(result)
    if args.plot:
        plot(result, args.plot)
    return 0 if result["clean_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
