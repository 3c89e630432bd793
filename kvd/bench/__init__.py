"""``kvd bench``: benchmarks, each through a private daemon it starts itself.

Owns one module per benchmark, each with ``run(args)`` (and ``add_arguments`` for its own
flags): ``host`` (default), ``gpu``, ``disk``, ``gds``, ``policy``, ``restart``, ``remote``;
``common`` holds what they share, ``plot`` draws a result table (``--plot``).
Promises: medians and ratios against a baseline measured in the same run; a missing Python
package of a GPU benchmark is one line naming what to install, exit status 2.
Never: asserts anything about speed; the daemon never imports kvd.bench.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from kvd_protocol.keys import DTYPE_SIZES
from kvd_protocol.layout import LAYOUTS

from .common import PAGE_ORDERS, BenchError, positive_int, size_arg, without_gpu_stack
from .gpu import DEFAULT_SHAPES, POOLS, SHAPES
from .pipeline import PHASES


def add_arguments(p) -> None:
    p.add_argument("--layout", default="vllm_flash_attn", choices=LAYOUTS, help="engine layout of the pool")
    p.add_argument("--layers", type=positive_int, default=32, help="model layers")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (1 for MLA layouts)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dim (latent width for MLA)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_SIZES), help="KV dtype")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per engine page")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per cached chunk")
    p.add_argument("--chunks", type=positive_int, default=8, help="chunks per store/load request")
    p.add_argument("--repeat", type=positive_int, default=5, help="timed runs; the median is reported")
    p.add_argument("--daemon-log", default=None, metavar="PATH", help="write the private daemon's "
                   "debug log to PATH (a line per copy: its size, how it went, its times)")
    p.add_argument("--daemon-profile", default=None, metavar="PATH", help="host and --gpu "
                   "benchmarks: run the private daemon under cProfile and write its stats to PATH "
                   "when it stops (read them with python3 -m pstats PATH); slows the daemon")
    p.add_argument("--json", default=None, metavar="PATH", help="the host benchmark: also write "
                   "each timed run's seconds as JSON to PATH (docs/data/host_bench_*.json); with "
                   "--gpu: every result row (the pipelined rows with each run's ratio); "
                   "with --remote: every run's GB/s "
                   "and load times")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the result table as a "
                   "bar chart (host, --gpu, --disk, --gds; needs matplotlib)")
    p.add_argument("--scrape-hz", type=float, default=0.0, help="host benchmark: the daemon serves "
                   "/metrics and another process scrapes it this often meanwhile (0: metrics off)")
    p.add_argument("--verify-loads", action="store_true", help="host benchmark: the daemon runs "
                   "with verify_loads = on and each load waits for its chunks' checksums first")
    p.add_argument("--gpu", action="store_true", help="benchmark the CUDA path (needs torch, cupy, "
                   "a GPU): Llama-3-8B and DeepSeek-MLA shaped pools vs pinned cudaMemcpy")
    p.add_argument("--spin-ms", type=float, default=0.0, help="with --gpu: the clients busy-poll "
                   "this long for each reply before sleeping (KvdClient spin_s)")
    p.add_argument("--gpu-pool", type=names_of(POOLS), default=["one", "per-layer"], metavar="A,B",
                   help="with --gpu: the pool kinds to measure, comma-separated (default: the two "
                   "engines allocate): one (all layers in one allocation, vLLM's), per-layer (each "
                   "layer its own allocation, SGLang's; at least 12 MiB each, so that PyTorch does "
                   "not pack layers into one), block-outer (one allocation with a block's layers "
                   "adjacent, vLLM 0.32's BLHNC-family layouts, an opt-in), vmm (CUDA virtual "
                   "memory shared by file descriptor, a segment per layer: vLLM 0.34's extensible "
                   "KV cache); --interference uses the first")
    p.add_argument("--page-order", choices=PAGE_ORDERS, default="random",
                   help="with --gpu: the engines' page ids: a random permutation (a free list "
                   "after churn, the worst case), sorted (a free list kept sorted, SGLang's "
                   "need_sort), or contiguous (a fresh engine's): pages at consecutive ids of a "
                   "chunk go as one copy")
    p.add_argument("--gpu-page-sizes", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 16, 64, 256], help="with --gpu: comma-separated page sizes")
    p.add_argument("--gpu-host-capacity", type=size_arg, default=None, metavar="SIZE",
                   help="with --gpu: the private daemon's host tier (e.g. 4GiB; default: room "
                   "for every request in flight of the largest shape measured)")
    p.add_argument("--gpu-shapes", type=names_of(SHAPES), default=DEFAULT_SHAPES, metavar="A,B",
                   help=f"with --gpu: the model shapes to measure ({', '.join(SHAPES)}; default "
                   f"{','.join(DEFAULT_SHAPES)}); --interference uses the first. The "
                   "llama3-8b-vllm-* shapes are vLLM's GPU blocks as kvd's vLLM connector keeps "
                   "them: token rows (gpu_block_format rows) or whole blocks (blocks, its default)")
    p.add_argument("--flood", action="store_true", help="a well-behaved client's latency alone and "
                   "next to a client flooding the daemon with requests (kvd.bench.flood)")
    p.add_argument("--interference", action="store_true", help="with --gpu: the slowdown of an "
                   "engine process's GEMM and decode step while a client process keeps kvd copying, per "
                   "copy path (kvd.bench.interference)")
    p.add_argument("--interference-variants", type=lambda v: v.split(";"), default=None,
                   metavar="A;B", help="with --interference: the copy paths to run (names as printed; "
                   "default: all)")
    p.add_argument("--interference-workloads", type=lambda v: v.split(","), default=["gemm", "decode"],
                   metavar="gemm,decode", help="with --interference: the engine's workloads")
    p.add_argument("--mps", action="store_true", help="with --interference: also run under CUDA MPS "
                   "(started and stopped by the benchmark when nvidia-cuda-mps-control is there)")
    p.add_argument("--pipeline", type=int, default=4, metavar="N", help="with --gpu: requests "
                   "in flight per engine (submit/poll), as serving engines keep them; 0: none, "
                   "only blocking requests")
    p.add_argument("--blocking", action="store_true", help="with --gpu: also measure one blocking "
                   "request at a time (store() and load(), each waited for before the next), and "
                   "a GEMM in this process while such copies run")
    p.add_argument("--clients", type=int, default=2, metavar="M", help="with --gpu: engines "
                   "(at least 2: for both directions half store while half load)")
    p.add_argument("--pipeline-rounds", type=int, default=4, metavar="R", help="with --pipeline: "
                   "each client sends N x R requests per timed run")
    p.add_argument("--pipeline-phases", type=names_of(PHASES), default=list(PHASES),
                   metavar="P,Q", help=f"with --pipeline: the phases to run ({', '.join(PHASES)}; "
                   "the others print nan)")
    p.add_argument("--gds", action="store_true", help="benchmark loads of disk-only chunks into "
                   "GPU pages, GPU Direct Storage vs the host tier path vs raw O_DIRECT reads (needs "
                   "torch, cupy, KvikIO, a GPU; uses --disk-dir, --disk-gib, --disk-threads, --chunks)")
    from .disk import add_arguments as add_disk_arguments
    from .policy import add_arguments as add_policy_arguments
    from .remote import add_arguments as add_remote_arguments
    from .restart import add_arguments as add_restart_arguments
    add_disk_arguments(p)
    add_remote_arguments(p)
    add_policy_arguments(p)
    add_restart_arguments(p)


def names_of(known):
    """An argparse type: a comma-separated list of names from ``known``, else a usage
    error (exit status 2) before anything starts."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} "
                                             f"(known: {', '.join(known)})")
        return names
    return parse


def run(args) -> int:
    """The benchmark the flags name; one that cannot run here (its daemon did not start, no
    room in /dev/shm for its pools) is one line and exit status 1."""
    try:
        return _run(args)
    except BenchError as exc:
        print(f"kvd bench: {exc}", file=sys.stderr)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        print(f"kvd bench: {exc.strerror}", file=sys.stderr)
    return 1


def _run(args) -> int:
    args.gpu = args.gpu or args.interference  # --interference measures the GPU path only
    if args.plot:
        from .plot import PlotUnavailable, require
        try:
            require()  # before minutes of benchmark, not after
        except PlotUnavailable as exc:
            print(f"kvd bench: {exc}")
            return 2
    if args.json and args.interference or args.json and not args.gpu and _other_bench(args):
        print("kvd bench: --json is for the host benchmark (the default), --gpu (without "
              "--interference) and --remote", file=sys.stderr)
        return 2
    if args.json:
        problem = _writable_file(args.json)
        if problem:  # before minutes of benchmark, not after
            print(f"kvd bench: --json {args.json}: {problem}", file=sys.stderr)
            return 2
    if args.gds and without_gpu_stack("--gds", ("torch", "cupy", "kvikio")):
        return 2  # before --disk-dir is made
    if args.disk_policy or args.gds or args.disk:
        problem = _usable_dir(args.disk_dir)
        if problem:
            print(f"kvd bench: --disk-dir {args.disk_dir}: {problem}", file=sys.stderr)
            return 2
    if args.disk_policy:
        from .policy import run as run_policy
        return run_policy(args)
    if args.remote:
        from .remote import run as run_remote
        return run_remote(args)
    if args.restart:
        from .restart import run as run_restart
        return run_restart(args)
    if args.gds:
        from .gds import run as run_gds
        return run_gds(args)
    if args.disk:
        from .disk import run as run_disk
        return run_disk(args)
    if args.flood:
        from .flood import run as run_flood
        return run_flood(args)
    if args.gpu and args.interference:
        from .interference import run as run_interference
        return run_interference(args)
    if args.gpu:
        from .gpu import run as run_gpu
        return run_gpu(args)
    from .host import run as run_host
    return run_host(args)


def _usable_dir(path: str) -> str | None:
    """Create ``path`` if missing, its last component only (as ``kvd serve`` does its
    disk_dir); why it cannot be benchmarked in, or None."""
    p = Path(path)
    try:
        p.mkdir(exist_ok=True)
    except FileExistsError:
        return "not a directory"
    except FileNotFoundError:
        return f"cannot create it: {p.parent} does not exist (only the last directory is created)"
    except OSError as exc:
        return f"cannot create it: {exc.strerror}"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"not writable by uid {os.geteuid()}"
    return None


def _other_bench(args) -> bool:
    """Whether the flags name a benchmark other than the host one (the default) and --gpu."""
    return any((args.disk_policy, args.restart, args.gds, args.disk, args.flood))


def _writable_file(path: str) -> str | None:
    """Why ``path`` cannot be written (its directory missing or not writable), or None."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"not writable by uid {os.geteuid()}"
    return None
