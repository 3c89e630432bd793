"""Time to first token of SGLang with and without kvd, for long shared prefixes.

    python examples/sglang_ttft.py --out /tmp/sgl-ttft.json          # GPU: Llama-3-8B shape

Needs SGLang and kvd_client in this python (on the GPU machine: SGLang 0.5.16
staged by tools/gpu/stage_sglang.sh, run through its call2.sh, which puts the
checkout's ``clients`` on ``PYTHONPATH``); starts a private ``kvd serve``
(``--chunk-tokens 64``, SGLang's page) with ``--daemon-python``. The model is a
config.json only, Llama-3-8B shaped with ``--layers`` layers, run with
``load_format="dummy"``: no download, and the timings are those of real
weights. Attention is SGLang's triton backend (``--attention-backend``;
``fa3`` needs FlashAttention 3, staged only with ``WITH_FA3=1``), sampling its
pytorch one, no CUDA graphs (TTFT is one prefill). Each engine runs in its
own process (this script again, with ``--role``):

- ``store``: an engine with HiCache and kvd as its storage tier prefills each
  prefix (plus a suffix); SGLang backs the pages up to kvd, and the role waits
  until the daemon holds them all;
- ``kvd``: a fresh engine with HiCache and kvd: before each repeat its GPU and
  host caches are flushed, so each repeat's prefix comes from kvd (SGLang's
  ``cached_tokens_details`` say how much); TTFT of the prefix plus a new
  suffix. One such engine per ``--host-pools`` entry (the backend's
  ``kvd_host_pool``: ``staging``, ``shared``; ``radix``: kvd's radix cache
  instead of HiCache, ``--radix-cache-backend kvd``, a hit loaded straight into
  the GPU pool (SGLang 0.5.16); ``linker``: kvd as the unified cache's external
  linker, a hit loaded straight into the GPU pool layer by layer (SGLang
  ≥ 0.5.23)), each loading what ``store`` left;
- ``full``: an engine without HiCache, radix cache on: TTFT of a fresh prefix
  plus suffix (the whole prefill), then ``suffix``: the same prefix with another
  suffix (SGLang's GPU cache holds the prefix: the cost of the suffix alone);
- ``host`` (``--host-hit``): SGLang's own hierarchical cache without kvd, a
  device pool of the longest prompt plus 512 tokens: each prefix computed
  once (written through to the host tier), then before each repeat a filler
  prompt as long as the longest evicts it from the GPU, and the prefix plus
  a new suffix is a hit from SGLang's host tier (``host_hit_tokens`` from its
  ``cached_tokens_details``): what kvd's hit compares with (``kvd / it``).

TTFT is the wall time of ``generate`` of one prompt with one new token,
median of ``--repeat`` runs; speedup = full / kvd (``--no-full`` leaves the
``full`` role out). The bound is what a perfect host cache could give, as in
examples/vllm_ttft.py: ``suffix + floor``, the floor being the prefix's KV
bytes at one pinned host-to-GPU copy, timed by the ``full`` role on the same
GPU; ``kvd/bound`` is the ratio a kvd hit is held to. "in kvd" is the time the
daemon spent on the repeat's load requests (its ``load`` latencies summed):
the rest of a hit's TTFT beyond the suffix is the backend's copies and
SGLang's own. ``--out`` keeps every run.

``--trace`` turns on kvd's timeline in the kvd engines (``KVD_SGLANG_TRACE``,
kvd_client.sglang.timeline) and prints, per prefix and engine, where a hit's
time goes (examples/sglang_breakdown.py: SGLang's part before, between and
after the backend's calls, ours inside them, the daemon's share);
``--sglang-times`` adds SGLang's own timestamps of each request (its
``enable_metrics``), which cut the part after our calls at the forward's
start and end.
``--merge EARLIER.json`` keeps an earlier report's figures (the same GPU, SGLang,
layers, suffix and attention backend; other engines or prefixes) beside this
run's, in its table and ``--out``: a run split over calls, e.g. ``--host-pools
linker --no-full`` then ``--host-pools '' --host-hit --merge``.
``--gil-switch-ms 0,0.2`` runs one kvd engine per value (the backend's
``kvd_gil_switch_ms``: Python's GIL switch interval in SGLang's process; 0
leaves Python's 5 ms): the cost of thread wake-ups while SGLang's scheduler
thread spins, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_breakdown  # noqa: E402
from vllm_ttft import (LLAMA3_8B, add_common_args, add_prompt_args, environment,  # noqa: E402
                       floor_s, load_seconds, private_daemon, run_role, run_roles, write_config)

PAGE = 64  # SGLang's page size here, and the daemon's chunk
# SGLang's own timestamps of a request, in its meta_info when enable_metrics is on
SGLANG_TIMES = ("forward_entry_time", "prefill_finished_time", "queue_time")


def tokens(name: str, n: int) -> list[int]:
    """``n`` token ids drawn from the seed ``name`` (the same in every process)."""
    import random

    rng = random.Random(name)
    return [rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(n)]


def engine_args(args, role: str) -> dict:
    longest = max(args.prefix_list) + args.suffix
    kw = {"model_path": args.model, "load_format": "dummy", "dtype": "bfloat16", "random_seed": 0,
          "skip_tokenizer_init": True, "page_size": PAGE, "attention_backend": args.attention_backend,
          "sampling_backend": "pytorch", "disable_cuda_graph": True, "grammar_backend": "none",
          "context_length": longest + 64, "max_total_tokens": 2 * longest + 4096,
          "mem_fraction_static": args.mem_fraction_static, "log_level": "warning"}
    if args.trace and args.sglang_times and role.startswith("kvd-"):
        kw["enable_metrics"] = True  # SGLang's own request timestamps in meta_info
    if role == "host":  # SGLang's own host tier; a device pool one filler prompt empties
        kw.update(enable_hierarchical_cache=True, hicache_ratio=2.0,
                  hicache_write_policy="write_through", max_total_tokens=longest + 512)
    elif role.startswith(("kvd-radix", "kvd-linker")):  # no HiCache: straight into the GPU pool
        extra = {"kvd_runtime_dir": args.runtime_dir, **json.loads(args.extra)}
        gil = role.partition("@")[2]
        if gil:
            extra["kvd_gil_switch_ms"] = float(gil)
        if role.startswith("kvd-radix"):  # SGLang 0.5.16: kvd's radix cache
            kw.update(radix_cache_backend="kvd", hicache_storage_backend_extra_config=json.dumps(extra))
        else:
            kw.update(linker_args(extra))
    elif role != "full":
        extra = {"backend_name": "kvd", "module_path": "kvd_client.sglang.backend",
                 "class_name": "KvdHiCacheStorage", "interface_v1": 1,
                 "kvd_runtime_dir": args.runtime_dir, **json.loads(args.extra)}
        if role.startswith("kvd-"):
            pool, _, gil = role[len("kvd-"):].partition("@")
            extra["kvd_host_pool"] = pool
            if gil:
                extra["kvd_gil_switch_ms"] = float(gil)
        # the store role writes every page through to kvd; the kvd role writes back only on
        # eviction, so that no store of its suffixes runs beside the next repeat
        policy = "write_through" if role == "store" else "write_back"
        kw.update(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_write_policy=policy,
                  hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
                  hicache_storage_backend_extra_config=json.dumps(extra))
    return kw


def engine(args, role: str) -> dict:
    import sglang

    trace = trace_file(args.runtime_dir, role, args.trace and role.startswith("kvd-"))
    if role == "store" or role.startswith("kvd-"):
        python_radix_core()
    if role.startswith("kvd-radix"):
        offer_plugin(Path(args.runtime_dir).parent)
    llm = sglang.Engine(**engine_args(args, role))
    one = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    window = {}  # the last request: sent, first token (time.monotonic()), SGLang's own times

    def ttft(prompt) -> tuple[float, dict]:
        t0, m0, offset = time.perf_counter(), time.monotonic(), time.monotonic() - time.time()
        out = llm.generate(input_ids=prompt, sampling_params=one)
        meta = out["meta_info"]
        window.update(sent=m0, done=time.monotonic(), offset=offset,
                      sglang={k: meta.get(k) for k in SGLANG_TIMES})
        return time.perf_counter() - t0, meta.get("cached_tokens_details") or {}

    try:
        ttft(tokens("warm-up", 256))
        out, sfx = {}, args.suffix
        for n in args.prefix_list:
            shared = tokens(f"shared/{n}", n)  # the prefix the store engine leaves in kvd
            print(f"[{role}] prefix {n}", flush=True)
            if role == "store":
                ttft(shared + tokens("store", sfx))
            elif role.startswith("kvd-"):
                runs, hits, daemon, windows = [], [], [], []
                for r in range(args.repeat):
                    if not flushed(llm.flush_cache()):  # GPU and host copies gone: from kvd
                        print(f"[kvd] flush_cache refused before repeat {r}", flush=True)
                    before = load_seconds(args)
                    t, details = ttft(shared + tokens(f"kvd/{r}", sfx))
                    runs.append(t)
                    hits.append(details.get("storage", 0) or details.get("host", 0))
                    daemon.append(load_seconds(args) - before)
                    windows.append(dict(window))
                pool = role[len("kvd-"):]
                out[n] = {f"kvd/{pool}": runs, f"storage_hit_tokens/{pool}": hits,
                          f"daemon_load/{pool}": daemon}
                if args.trace:
                    lines = sglang_breakdown.read(trace)
                    out[n][f"breakdown/{pool}"] = [
                        sglang_breakdown.segments(lines, w["sent"], w["done"], d, w["sglang"],
                                                  w["offset"]) for w, d in zip(windows, daemon)]
            elif role == "host":
                out[n] = host_hits(ttft, shared, n, args)
            else:
                full, suffix = [], []
                for r in range(args.repeat):
                    fresh = tokens(f"fresh/{n}/{r}", n)
                    full.append(ttft(fresh + tokens(f"a/{r}", sfx))[0])    # the whole prefill
                    suffix.append(ttft(fresh + tokens(f"b/{r}", sfx))[0])  # prefix cached on the GPU
                out[n] = {"full": full, "suffix": suffix, "floor": [floor_s(args, n)]}
        if role == "store":
            wait_stored(args, 256 // PAGE + sum((n + sfx) // PAGE for n in args.prefix_list))
    finally:
        if role not in ("full", "host") and not role.startswith(("kvd-radix", "kvd-linker")):  # HiCache's
            detach(llm)
        llm.shutdown()
    return out


def linker_args(extra: dict) -> dict:
    """SGLang >= 0.5.23's engine arguments for kvd as the unified cache's external linker."""
    return {"enable_unified_cache_external_linker": True,
            "unified_cache_external_linker_backend": "dynamic",
            "unified_cache_external_linker_config": {
                "linker": "KvdLinker", "linker_module_path": "kvd_client.sglang.linker",
                "linker_extra_config": extra}}


def trace_file(runtime_dir: str, role: str, traced: bool) -> Path:
    """Where ``role``'s engine writes kvd's timeline; with ``traced``, put in this process's
    environment (``KVD_SGLANG_TRACE``), which SGLang's scheduler process inherits."""
    import os

    trace = Path(runtime_dir).parent / f"trace-{role}.jsonl"
    if traced:
        os.environ["KVD_SGLANG_TRACE"] = str(trace)
    return trace


def python_radix_core() -> None:
    """SGLang >= 0.5.23 in this process and its scheduler: kvd's token keys learn the token ids
    from SGLang's Python hashing, which its default (rust) radix tree core does not call."""
    import os

    os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")


def host_hits(ttft, shared: list, n: int, args) -> dict:
    """TTFT of ``shared`` plus a new suffix with the prefix in SGLang's host tier only: computed
    once (written through to the host tier), then before each repeat a filler prompt as long
    as the longest takes the device pool, which evicts the prefix from the GPU."""
    longest = max(args.prefix_list) + args.suffix
    ttft(shared + tokens("host/prime", args.suffix))
    runs, hits = [], []
    for r in range(args.repeat):
        ttft(tokens(f"filler/{n}/{r}", longest))
        t, details = ttft(shared + tokens(f"host/{r}", args.suffix))
        runs.append(t)
        hits.append(details.get("host", 0))
    return {"host": runs, "host_hit_tokens": hits}


def offer_plugin(folder: Path) -> None:
    """kvd-cache's ``sglang.srt.plugins`` entry point (``--radix-cache-backend kvd``) where
    kvd-cache is not installed in this environment (run from a checkout): a dist-info in
    ``folder``, put first on the PYTHONPATH SGLang's processes inherit."""
    import os
    from importlib.metadata import entry_points

    from kvd_client.sglang import plugin

    if not any(ep.name == plugin.NAME for ep in entry_points(group="sglang.srt.plugins")):
        os.environ["PYTHONPATH"] = os.pathsep.join([plugin.offer(folder), os.environ.get("PYTHONPATH", "")])


def detach(llm) -> None:
    """SGLang detaches kvd's backend, which closes it: its staging pool leaves /dev/shm (the
    scheduler process is killed at shutdown)."""
    try:
        out = llm.loop.run_until_complete(llm.tokenizer_manager.detach_hicache_storage())
        if not out.success:
            print(f"detaching the storage backend: {out.message}", flush=True)
    except Exception as exc:  # an SGLang without it: the next kvd pool removes the file
        print(f"detaching the storage backend failed ({exc})", flush=True)


def flushed(result) -> bool:
    return bool(getattr(result, "success", result if result is not None else True))


def wait_stored(args, chunks: int, timeout: float = 300.0) -> None:
    """SGLang backs pages up to kvd after the requests end: wait until the daemon holds them."""
    from kvd_client.transport import Channel
    from kvd_protocol.runtime import control_endpoint

    deadline = time.monotonic() + timeout
    ch = Channel(control_endpoint(Path(args.runtime_dir)), 5.0)
    try:
        while (stored := ch.request("stats").get("chunks_stored", 0)) < chunks:
            if time.monotonic() > deadline:
                raise SystemExit(f"[store] kvd holds {stored} of {chunks} chunks after {timeout} s")
            time.sleep(0.5)
    finally:
        ch.close()
    print(f"[store] kvd holds the {chunks} chunks", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prompt_args(ap, "2048,8192,16384,32768", layers=32, repeat=5)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--extra", default="{}", help="more of the storage backend's extra config (JSON)")
    ap.add_argument("--host-pools", default="shared",
                    help="the kvd engines, comma-separated: staging, shared (HiCache with kvd's "
                         "backend, its kvd_host_pool), radix (SGLang 0.5.16: kvd's radix cache, no "
                         "HiCache: straight into the GPU pool), linker (SGLang >= 0.5.23: the unified "
                         "cache's linker, the same, layer by layer); empty: none, the full role alone")
    ap.add_argument("--no-full", action="store_true", help="leave out the engine without kvd")
    ap.add_argument("--host-hit", action="store_true",
                    help="an engine with SGLang's own host tier: a hit from it, side by side")
    ap.add_argument("--trace", action="store_true",
                    help="kvd's timeline in the kvd engines: print where a hit's time goes")
    ap.add_argument("--sglang-times", action="store_true",
                    help="with --trace: SGLang's own request timestamps too (its enable_metrics)")
    ap.add_argument("--gil-switch-ms", default="0",
                    help="kvd_gil_switch_ms of the kvd engines, comma-separated: one engine per "
                         "value and host pool (0: Python's own 5 ms)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="an earlier report of this script (same GPU, SGLang, layers, suffix, attention "
                         "backend) whose figures this report keeps where this run measures nothing else")
    add_common_args(ap, gpu_share=False)
    ap.set_defaults(host_capacity="10GiB")
    args = ap.parse_args()
    args.prefix_list = [int(p) for p in args.prefixes.split(",")]
    if any(n % PAGE for n in args.prefix_list):
        raise SystemExit(f"prefixes must be whole pages of {PAGE} tokens")
    pools = [p for p in args.host_pools.split(",") if p]
    if not set(pools) <= {"staging", "shared", "radix", "linker"}:
        raise SystemExit(f"--host-pools: of staging, shared, radix, linker, not {args.host_pools!r}")
    try:
        gils = [float(g) for g in args.gil_switch_ms.split(",")]
    except ValueError:
        raise SystemExit(f"--gil-switch-ms: numbers, not {args.gil_switch_ms!r}") from None
    if any(g < 0 for g in gils):
        raise SystemExit("--gil-switch-ms: 0 or more")
    args.pool_list = [p + (f"@{g:g}" if g else "") for p in pools for g in gils]
    if args.role:
        Path(args.role_out).write_text(json.dumps(engine(args, args.role)))
        return
    earlier = read_earlier(args) if args.merge else None
    flags = ("--chunk-tokens", str(PAGE))
    with tempfile.TemporaryDirectory(prefix="kvd-sgl-ttft-") as tmp, \
            private_daemon(args, Path(tmp), flags) as model:
        tmp = Path(tmp)
        write_config(model, LLAMA3_8B, args.layers, max(args.prefix_list) + args.suffix + 64)
        if args.pool_list:  # nothing to store for the full role alone
            run_role(args, "store", tmp, __file__)
        roles = [f"kvd-{p}" for p in args.pool_list] + ([] if args.no_full else ["full"]) \
            + (["host"] if args.host_hit else [])
        rows = run_roles(args, roles, tmp, __file__,
                         lambda a, r: save(a, merged(earlier, r), earlier=earlier))
    rows = merged(earlier, rows)
    if earlier:
        args.pool_list += [p for p in earlier["args"]["pool_list"] if p not in args.pool_list]
    report(args, rows, earlier)


MATCH = ("layers", "suffix", "attention_backend")  # the report's args two merged runs must share


def read_earlier(args) -> dict:
    """The report ``--merge`` names, refused (before any engine starts) where its figures were
    measured otherwise than this run's would be."""
    try:
        earlier = json.loads(args.merge.read_text())
        runs, old = earlier["runs"], earlier["args"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--merge {args.merge}: not a report of this script ({exc})") from None
    here = {**environment("sglang"), **{k: getattr(args, k) for k in MATCH}}
    there = {**earlier, **old}  # its GPU and SGLang, and its arguments
    differ = [f"{k} {there.get(k)!r} there, {here[k]!r} here" for k in ("gpu", "sglang", *MATCH)
              if k in here and there.get(k) != here[k]]
    if differ:
        raise SystemExit(f"--merge {args.merge}: measured otherwise: {'; '.join(differ)}")
    earlier["runs"] = {int(n): r for n, r in runs.items()}
    return earlier


def merged(earlier: dict | None, rows: dict) -> dict:
    """This run's figures over the earlier report's, prefix by prefix."""
    if not earlier:
        return rows
    out = {n: dict(r) for n, r in earlier["runs"].items()}
    for n, r in rows.items():
        out.setdefault(n, {}).update(r)
    return dict(sorted(out.items()))


def report(args, rows: dict, earlier: dict | None = None) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items() if not k.startswith("breakdown/")}
           for n, r in rows.items()}
    for m in med.values():
        if "suffix" in m and m.get("floor"):
            m["bound"] = m["suffix"] + m["floor"]
    print(f"{'prefix':>8}{'pool':>12}{'full ms':>10}{'suffix ms':>11}{'bound ms':>10}{'kvd ms':>10}"
          f"{'in kvd ms':>11}{'kvd hit':>9}{'kvd/bound':>11}{'speedup':>9}")
    for n, m in med.items():
        for pool in args.pool_list:
            cells = "".join(f"{m[k] * 1e3:>{w}.1f}" if k in m else f"{'-':>{w}}" for k, w in
                            (("full", 10), ("suffix", 11), ("bound", 10), (f"kvd/{pool}", 10),
                             (f"daemon_load/{pool}", 11)))
            hit = m.get(f"storage_hit_tokens/{pool}")
            hit = f"{int(hit):>9d}" if hit is not None else f"{'-':>9}"
            kvd = m.get(f"kvd/{pool}")
            bound = f"{kvd / m['bound']:>10.2f}x" if kvd and "bound" in m else f"{'-':>11}"
            speed = f"{m['full'] / kvd:>8.1f}x" if "full" in m and kvd else f"{'-':>9}"
            print(f"{n:>8}{pool:>12}{cells}{hit}{bound}{speed}")
    if any("host" in m for m in med.values()):
        print(f"\n{'prefix':>8}{'SGLang host-tier hit ms':>24}{'host hit tokens':>17}"
              + "".join(f"{'kvd ' + p + ' / it':>22}" for p in args.pool_list))
        for n, m in med.items():
            host = m.get("host")
            if host is None:
                continue
            ratios = "".join(f"{m[f'kvd/{p}'] / host:>22.2f}" if f"kvd/{p}" in m else f"{'-':>22}"
                             for p in args.pool_list)
            print(f"{n:>8}{host * 1e3:>24.1f}{int(m['host_hit_tokens']):>17d}{ratios}")
    if any(k.startswith("breakdown/") for r in rows.values() for k in r):
        print("\nwhere a kvd hit's time goes (ms, medians; examples/sglang_breakdown.py):")
        cuts = {n: {pool: r.get(f"breakdown/{pool}", []) for pool in args.pool_list}
                for n, r in rows.items()}
        print("\n".join(sglang_breakdown.table(cuts)))
    save(args, rows, med, earlier)


def save(args, rows: dict, med: dict | None = None, earlier: dict | None = None) -> None:
    if args.out:
        env = environment("sglang")
        if earlier:
            env["command"] = f"{earlier['command']}; then {env['command']}"
        Path(args.out).write_text(json.dumps({**env, "args": vars(args), "runs": rows, "median": med},
                                             default=str, indent=1))


if __name__ == "__main__":
    main()
