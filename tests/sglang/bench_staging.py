"""What the staging copy costs: SGLang's host pool <-> kvd, with the copy measured alone.

Run in the SGLang venv against a running daemon (docs/sglang.md, "Measured"):

    .venv/bin/kvd serve --runtime-dir /tmp/kvd-bench --chunk-tokens 64 --host-capacity 4GiB \\
        --warm-restart false &      # false: its host tier leaves /dev/shm when it stops
    PYTHONPATH=clients TORCH_EXTENSIONS_DIR=.venv-sglang/torch_extensions \\
        .venv-sglang/bin/python tests/sglang/bench_staging.py --runtime-dir /tmp/kvd-bench

For each host layout: ``batch_set_v1`` and ``batch_get_v1`` of one batch of
pages through the real backend (fresh keys each round, so nothing is
deduplicated), and, in the same run, the copies between the host pool and
the staging pool alone (what registering SGLang's pool in place would save),
a plain contiguous copy of the same bytes in every round as their baseline, plus
SGLang's generic interface (``batch_set``/``batch_get`` of flat pages,
without ``interface_v1``). Medians of ``--rounds``; GB/s of KV moved. Each
value of ``--load-pipeline-pages`` (the backend's ``kvd_load_pipeline_pages``)
is a run of every layout of its own: the loads with and without overlap.
``--host-pool shared`` runs the backend with SGLang's host pool shared in
place (``kvd_host_pool``): store and load only, no copy to time.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402


def build(args, layout, pipeline: int):
    tokens = 2 * args.pages * args.page_size
    dev = MHATokenToKVPool(size=tokens, page_size=args.page_size, dtype=torch.bfloat16,
                           head_num=args.heads, head_dim=args.dim, layer_num=args.layers,
                           device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=args.layers)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, args.page_size,
                                layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=args.layers)
    del dev
    extra = {"backend_name": "kvd", "module_path": "kvd_client.sglang.backend",
             "class_name": "KvdHiCacheStorage", "interface_v1": 1,
             "kvd_runtime_dir": args.runtime_dir, "kvd_key_mode": "hashes",
             "kvd_staging_pages": args.pages, "kvd_timeout_s": 60.0,
             "kvd_load_pipeline_pages": pipeline, "kvd_host_pool": args.host_pool}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                  is_page_first_layout=layout == "page_first",
                                  model_name=f"bench-{layout}", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return host, backend


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_layout(args, layout, round_keys, pipeline: int, memcpy):
    host, be = build(args, layout, pipeline)
    idx = host.alloc(args.pages * args.page_size)
    host.kv_buffer.view(torch.uint8).random_()
    slots = be.pages.page_slots(idx, args.pages)
    out = {k: [] for k in ("copy_out", "store", "copy_in", "load", "generic_store", "generic_load",
                           "memcpy")}
    flat = [host.get_dummy_flat_data_page() for _ in range(args.pages)]

    def copy_out():
        for j, s in enumerate(slots):
            be.staging.slot(args.pages + j).copy_(be.pages.page(s))

    def copy_in():
        for j, s in enumerate(slots):
            be.pages.page(s).copy_(be.staging.slot(j))

    in_place = be.shared is not None  # kvd_host_pool 'shared' took: no staging pool
    for r in range(args.rounds):
        keys = round_keys(layout, r)
        out["memcpy"].append(timed(memcpy))  # each round: this machine's memory speed drifts
        out["copy_out"].append(math.nan if in_place else timed(copy_out))
        out["store"].append(timed(lambda: be.batch_set_v1(keys, idx)))
        out["copy_in"].append(math.nan if in_place else timed(copy_in))
        got = []
        out["load"].append(timed(lambda: got.append(be.batch_get_v1(keys, idx))))
        if not all(got[0]):
            raise RuntimeError(f"{layout}: a load missed: raise the daemon's host capacity")
        if in_place:  # no staging pool: the generic interface is not served
            out["generic_store"].append(math.nan)
            out["generic_load"].append(math.nan)
            continue
        gkeys = round_keys(layout + "-generic", r)
        pages = [host.get_data_page(s) for s in slots]  # what SGLang's generic path does
        out["generic_store"].append(timed(
            lambda: be.batch_set(gkeys, [host.get_data_page(s) for s in slots])))
        out["generic_load"].append(timed(lambda: [
            host.set_from_flat_data_page(s, f) for s, f in
            zip(slots, be.batch_get(gkeys, flat))]))
        del pages
    be.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages", type=int, default=32, help="pages per batch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layouts", default="layer_first,page_first,page_first_direct,page_head")
    ap.add_argument("--host-pool", choices=("staging", "shared"), default="staging",
                    help="kvd_host_pool: 'shared' loads and stores SGLang's host pool in place "
                         "(no copy columns)")
    ap.add_argument("--load-pipeline-pages", default="8",
                    help="comma list of kvd_load_pipeline_pages values, each a run of its own "
                         "(--pages or more: one kvd request per batch)")
    args = ap.parse_args()
    page_bytes = args.layers * 2 * args.page_size * args.heads * args.dim * 2
    total = page_bytes * args.pages
    print(f"{args.pages} pages of {page_bytes / 2**20:.1f} MiB ({total / 2**20:.0f} MiB per batch), "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    nonce = os.urandom(4).hex()
    src = torch.empty(total, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # its pages faulted in before any timing

    def round_keys(layout, r):
        return [f"{hash((nonce, layout, r, i)) & (2**256 - 1):064x}" for i in range(args.pages)]

    print(f"{'layout':18} {'copy out':>9} {'store':>9} {'copy in':>9} {'load':>9} "
          f"{'gen store':>9} {'gen load':>9} {'memcpy':>9}   GB/s; load / memcpy; copy share of "
          "store / load")
    runs = [(layout, int(p)) for p in args.load_pipeline_pages.split(",")
            for layout in args.layouts.split(",")]
    for layout, pipeline in runs:
        m = run_layout(args, layout, lambda lay, r: round_keys(f"{lay}/{pipeline}", r), pipeline,
                       lambda: dst.copy_(src))
        gbs = {k: total / v / 1e9 for k, v in m.items()}
        print(f"{layout + '/' + str(pipeline):18} " + " ".join(f"{gbs[k]:9.2f}" for k in
                                         ("copy_out", "store", "copy_in", "load", "generic_store",
                                          "generic_load", "memcpy"))
              + f"   {m['memcpy'] / m['load']:.2f}"
              + ("" if math.isnan(m["copy_out"]) else
                 f"   {m['copy_out'] / m['store']:.0%} / {m['copy_in'] / m['load']:.0%}"))


if __name__ == "__main__":
    main()
