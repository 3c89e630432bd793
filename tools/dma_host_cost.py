#!/usr/bin/env python3
"""Host time the daemon spends queuing one DMA copy, with CUDA's calls stubbed out.

The daemon plans and queues every DMA copy on its event loop; while it does,
nothing else is queued, so where that host time nears the copy's PCIe time
the daemon, not the bus, sets the rate ("enqueued in" in the daemon's debug
log: 1.2-1.3 ms for a straight 268 MB store, 2.2-3.1 ms for a load, ~3 ms
staged, on the H100 host, docs/benchmarks.md in git history). This tool times kvd's own
part of it on any machine, no GPU: ``kvd.cuda.dma.path.DmaPath.store`` and
``load`` (straight and staged) with a stand-in for CuPy's streams, events and
runtime calls and for the driver's batch calls, each of which returns at
once. What it prints is therefore Python and NumPy time only; the driver's
own time per call and per op comes on top on a real GPU.

Shapes as ``kvd bench --gpu``: llama3-8b (32 layers, K and V, 2 KiB rows)
and deepseek-mla (61 layers, one 1152-byte plane), every layer in one
allocation (vLLM's pools; ``--pool block-outer``: a page's layers adjacent;
``--pool per-layer``: each layer its own allocation),
pages at random ids, defaults of the ``gpu_dma_*`` knobs and 64 MiB staging slots. Per shape, page size, path
and direction: the median of ``--repeat`` copies in microseconds, and its
share of the copy's time at ``--pcie-gbs``; ``--streams``, ``--spread-below`` and
``--load-window`` set those knobs (the driver calls a copy makes). Stores
and loads as the event loop queues them without ``gpu_dma_store_thread`` and
``gpu_dma_load_thread`` (with them, the loop only plans them: the driver's part
goes to the threads). Usage:
``.venv/bin/python tools/dma_host_cost.py [--chunks 8] [--page-sizes 16,64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from itertools import count

import numpy as np

from kvd.bench.common import size_arg
from kvd.copy.poll import EventPoller
from kvd.cuda.dma import path as dma
from kvd.cuda.dma import plan as dma_plan
from kvd.cuda.dma.staging import StagingRing
from kvd_protocol import cuda_driver
from kvd_protocol.layout import LayoutDescriptor

SHAPES = {"llama3-8b": (32, 2, 2048), "deepseek-mla": (61, 1, 1152)}
POOL_PAGES = 1 << 14
ARENA, PIECE = 1 << 40, 1 << 30  # the arena's base and registration piece, as the daemon's
SLOTS, SLOT_BYTES = 4, 64 << 20
_ptrs = count(1 << 20, 1 << 12)


class _Stream:
    def __init__(self, non_blocking: bool = True) -> None:
        self.ptr = next(_ptrs)

    def wait_event(self, event) -> None:
        pass


class _Event:
    done = True

    def __init__(self, block: bool = False, disable_timing: bool = True) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class _Runtime:
    @staticmethod
    def eventCreateWithFlags(flags: int) -> int:
        return next(_ptrs)

    def __getattr__(self, name: str):  # eventRecord, streamWaitEvent, memcpy2DAsync, ...
        return lambda *args: None


class _Device:
    def __init__(self, ordinal: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def use(self) -> None:
        pass


class _Alloc:
    def __init__(self, nbytes: int) -> None:
        self.ptr = next(_ptrs) << 20


class _Cuda:
    Stream, Event, Device, runtime = _Stream, _Event, _Device, _Runtime()

    @staticmethod
    def alloc(nbytes: int) -> _Alloc:
        return _Alloc(nbytes)


class StubCupy:
    """What kvd.cuda.dma.path and kvd.cuda.dma.staging call of CuPy, each call returning at once."""
    cuda = _Cuda


def stub_driver() -> None:
    cuda_driver.memcpy3d_batch_async = lambda stream, addr, n: None
    cuda_driver.memcpy_batch_async = lambda stream, dsts, srcs, sizes: None


def pool(layers: int, planes: int, row: int, page_size: int, kind: str = "one") -> tuple:
    """A layout and its plane bases: every (layer, plane) in one allocation, plane after
    plane (``one``: vLLM's single allocation) or page after page (``block-outer``: a
    page's planes adjacent, vLLM 0.32's ``BLHNC`` family); or each layer its own
    allocation (``per-layer``: SGLang's)."""
    plane_page = page_size * row
    stride = plane_page * layers * planes if kind == "block-outer" else plane_page
    apart = plane_page if kind == "block-outer" else POOL_PAGES * plane_page
    if kind == "per-layer":
        bases = tuple((i // planes, (i % planes) * apart) for i in range(layers * planes))
        apart += 1 << 21  # the allocations lie apart: no pitch spans two
    else:
        bases = tuple((0, i * apart) for i in range(layers * planes))
    d = LayoutDescriptor(layers, planes, POOL_PAGES, page_size, row, stride, row, bases)
    return d, np.uint64(1 << 30) + np.arange(layers * planes, dtype=np.uint64) * np.uint64(apart)


def make_path(stage_below: int, poller: EventPoller, **knobs) -> dma.DmaPath:
    """A DMA path on the stubs; ``knobs``: other ``dma.DmaSettings`` fields."""
    cp = StubCupy()
    rings = tuple(StagingRing(cp, kind, None, cp.cuda.Stream(), cp.cuda.Stream(), SLOTS,
                              SLOT_BYTES, (ARENA, PIECE)) for kind in ("gather", "scatter"))
    settings = dma.DmaSettings(stage_below=stage_below, store_thread=False, load_thread=False,
                               **knobs)
    return dma.DmaPath(cp, 0, settings, (ARENA, PIECE), poller, rings)


async def time_copies(path: dma.DmaPath, d, bases, groups, chunks: int, chunk_tokens: int,
                      store: bool, repeat: int, seed: int) -> tuple[float, set]:
    rng = np.random.default_rng(seed)
    shard = d.shard_bytes(chunk_tokens)
    ptrs = np.uint64(ARENA) + np.arange(chunks, dtype=np.uint64) * np.uint64(shard)
    times, hows = [], set()
    for _ in range(repeat):
        ids = rng.permutation(POOL_PAGES)[: chunks * chunk_tokens // d.page_size]
        t0 = time.perf_counter()
        if store:
            _, how, _ = path.store(d, bases, groups, ids, ptrs, chunk_tokens)
        else:
            how, rest = path.load(d, bases, groups, ids, ptrs, chunk_tokens, None)
            if rest is not None:
                await rest()
        times.append(time.perf_counter() - t0)
        hows.add(how)
    return statistics.median(times) * 1e6, hows


async def run(args: argparse.Namespace) -> None:
    poller = EventPoller()
    print(f"{'shape':<13} {'page':>4} {'path':<10} {'copy':<5} {'host us':>8} {'MB':>6} "
          f"{'share of PCIe':>13}")
    for name, (layers, planes, row) in SHAPES.items():
        for page in (int(s) for s in args.page_sizes.split(",")):
            d, bases = pool(layers, planes, row, page, args.pool)
            groups = dma_plan.pool_groups(d, bases)
            nbytes = args.chunks * d.shard_bytes(args.chunk_tokens)
            for label, stage_below in (("straight", 0), ("staged", 1 << 62)):
                for store in (True, False):
                    path = make_path(stage_below, poller, streams=args.streams,  # the other
                                     spread_below=args.spread_below,  # way idle: staged
                                     load_window=args.load_window)  # goes staged
                    us, hows = await time_copies(path, d, bases, groups, args.chunks,
                                                 args.chunk_tokens, store, args.repeat, page)
                    went = "/".join(sorted(hows))
                    share = us / (nbytes / (args.pcie_gbs * 1e3))
                    print(f"{name:<13} {page:>4} {went:<10} {'store' if store else 'load':<5} "
                          f"{us:>8.0f} {nbytes / 1e6:>6.1f} {share:>13.2f}")
                    path.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=8, help="chunks per copy (kvd bench's default)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--page-sizes", default="16,64", help="comma-separated tokens per page")
    p.add_argument("--pool", choices=("one", "block-outer", "per-layer"), default="one",
                   help="the pool's allocation, as kvd bench --gpu-pool")
    p.add_argument("--streams", type=int, default=dma.DmaSettings._field_defaults["streams"],
                   help="gpu_dma_streams: streams a copy of small pieces is spread over")
    p.add_argument("--spread-below", type=size_arg, default=dma.DmaSettings._field_defaults["spread_below"],
                   help="gpu_dma_spread_below: pieces under this many bytes are spread (0: never)")
    p.add_argument("--load-window", type=size_arg, default=dma.DmaSettings._field_defaults["load_window"],
                   help="gpu_dma_load_window: a load goes in steps of a quarter of this")
    p.add_argument("--repeat", type=int, default=100, help="copies per figure (median)")
    p.add_argument("--pcie-gbs", type=float, default=50.0, help="PCIe rate for the share column")
    args = p.parse_args()
    stub_driver()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
