"""Both directions at steady state on the copy engines, without the daemon: is it the GPU?

A measurement probe, not part of kvd. On a machine with a CUDA GPU:

    python3 tools/probes/dma_steady.py [--case mla:16] [--copies 64] [--reps 3]

``kvd bench --gpu --pipeline`` moves DeepSeek-MLA pages of 16 (block-outer
pool, one page per chunk) at 0.94-0.98 of a memcpy one way but 0.6-0.8 both
ways, even when the daemon keeps copies queued in both directions nearly
all the time (docs/benchmarks.md in git history, 2026-11-26). This replays what the
daemon queues, from one thread that never lets a queue run dry: a
request's pages (``--pages``, 128 of 1.1 MB for MLA: 144 MB) as one
``cuMemcpyBatchAsync`` of one copy per page between a block-outer pool at
random page ids and a page-major registered /dev/shm buffer (kvd's arena),
stores (device to host) on one stream and loads (host to device) on
another, ``--depth`` copies queued per direction, ``--copies`` per
direction. Variants: loads in steps (the daemon's load window cuts a 144
MB load in three), a ``cuStreamWriteValue32`` after each load (the done
word), a stream of this process waiting for each done word
(``cuStreamWaitValue32`` on host memory, as an engine's stream waits for a
load), and spreading each copy over 8 streams. ``plane rows`` variants copy
each (plane, page) alone (what a pool of one allocation per layer costs:
72 KiB copies for ``--case mla:64``) between the pool and kvd's chunk layout. Baseline:
the same loop with one contiguous memcpy of the request's bytes per copy,
timed right before each variant. Prints JSON lines: GB/s both ways and
each direction's finish time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections import deque

import numpy as np
from dma_probe import Case, _batch1d, _split  # this tool's neighbours in tools/
from probe_host import registered

from kvd_protocol import cuda_driver

_cuda = ctypes.CDLL("libcuda.so.1")


class Direction:
    """One direction's copies, queued ``depth`` ahead: ``copy(streams)`` queues one."""

    def __init__(self, torch, streams, copy, word=None, engine=None) -> None:
        self.torch, self.streams, self.copy, self.word = torch, streams, copy, word
        self.engine = engine  # a stream that waits for each done word, as an engine's does
        self.pending: deque = deque()
        self.queued = self.done = 0
        self.finished = None

    def enqueue(self) -> None:
        self.copy(self.streams, self.queued)
        for st in self.streams[1:]:  # later work on streams[0] follows every stream
            ev = self.torch.cuda.Event()
            ev.record(st)
            self.streams[0].wait_event(ev)
        if self.word is not None:
            cuda_driver.stream_write_u32(self.streams[0].cuda_stream, self.word, self.queued + 1)
            if self.engine is not None:
                cuda_driver.stream_wait_u32(self.engine.cuda_stream, self.word, self.queued + 1)
        ev = self.torch.cuda.Event()
        ev.record(self.streams[0])
        self.pending.append(ev)
        self.queued += 1

    def poll(self) -> None:
        while self.pending and self.pending[0].query():
            self.pending.popleft()
            self.done += 1


def rows_copy(dst, src, size, steps: int):
    """One ``cuMemcpyBatchAsync`` per step, its rows spread over the streams given; ``dst``
    or ``src`` may be a function of the copy's number (the host side's region)."""
    def copy(streams, i) -> None:
        d, s_ = (x(i) if callable(x) else x for x in (dst, src))
        for part in _split(len(d), steps):
            n = part.stop - part.start
            for s, st in zip(_split(n, len(streams)), streams):
                r = slice(part.start + s.start, part.start + s.stop)
                _batch1d(st.cuda_stream, d[r], s_[r], size[r])
    return copy


def memcpy_copy(dst, src, nbytes: int):
    def copy(streams, i) -> None:
        d, s_ = (x(i) if callable(x) else x for x in (dst, src))
        rc = _cuda.cuMemcpyAsync(ctypes.c_uint64(d), ctypes.c_uint64(s_),
                                 ctypes.c_size_t(nbytes), ctypes.c_void_p(streams[0].cuda_stream))
        if rc:
            raise RuntimeError(f"cuMemcpyAsync -> {rc}")
    return copy


def run(torch, dirs: list, copies: int, depth: int) -> dict:
    """Queue ``copies`` per direction, ``depth`` ahead; seconds until each was done."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while any(d.done < copies for d in dirs):
        for d in dirs:
            while d.queued < copies and d.queued - d.done < depth:
                d.enqueue()
            d.poll()
            if d.done == copies and d.finished is None:
                d.finished = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"elapsed": time.perf_counter() - t0, "finished": [d.finished for d in dirs]}


def _regions(nbytes: int, n: int) -> list[int]:
    """Offsets of ``n`` regions of ``nbytes``, none across a registered piece's end (one
    copy cannot span two registrations; kvd cuts its copies there)."""
    from kvd.cuda.devices import REGISTER_PIECE
    out, at = [], 0
    while len(out) < n:
        if at // REGISTER_PIECE != (at + nbytes - 1) // REGISTER_PIECE:
            at = (at // REGISTER_PIECE + 1) * REGISTER_PIECE
        out.append(at)
        at += nbytes
    return out


def main() -> None:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="mla:16")
    ap.add_argument("--copies", type=int, default=64)
    ap.add_argument("--depth", default="2,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arena-copies", type=int, default=1, help="host memory of this many "
                    "requests per direction, copy i in region i mod N (the daemon's arena "
                    "spans many requests)")
    ap.add_argument("--variants", default="", help="variant names separated by ';' (default: "
                    "all; memcpy always runs first)")
    a = ap.parse_args()
    name, page = a.case.split(":")
    torch.cuda.init()
    store, load = (Case(torch, name, int(page), True, "shm") for _ in range(2))
    nbytes = store.nbytes
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [[torch.cuda.Stream() for _ in range(8)] for _ in range(2)]
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    engine = torch.cuda.Stream()

    starts = _regions(nbytes, a.arena_copies)
    arenas = {id(c): registered(starts[-1] + nbytes, "shm") if a.arena_copies > 1 else None
              for c in (store, load)}

    def region(case):
        """Copy i's host address -> of region i mod N (the case's own buffer for N = 1)."""
        arena = arenas[id(case)]
        if arena is None:
            return lambda i: case.host.data_ptr()
        return lambda i: arena.ctypes.data + starts[i % len(starts)]

    def copies(case, dev_side, host_side, size, to_host, steps):
        """``rows_copy`` of ``case``'s copies, their host side moved to copy i's region."""
        at, offsets = region(case), host_side - np.uint64(case.host.data_ptr())

        def host(i):
            return offsets + np.uint64(at(i))
        return rows_copy(*((host, dev_side) if to_host else (dev_side, host)), size, steps)

    def rows(case, to_host, steps=1):
        """One copy per page of all its planes (block-outer pool, page-major host)."""
        size = np.full(case.dev3[0].size, case.lp * case.piece, np.uint64)
        return copies(case, case.dev3[0], case.page_major_host(), size, to_host, steps)

    def plane_rows(case, to_host, steps=1):
        """One copy per (plane, page): a pool of one allocation per layer's copies."""
        return copies(case, case.dev1, case.host1, case.size1, to_host, steps)

    s0, s1 = streams

    variants = {  # name -> () -> (store Direction, load Direction)
        "memcpy": lambda: (
            Direction(torch, s0[:1], memcpy_copy(region(store), dev[0].data_ptr(), nbytes)),
            Direction(torch, s1[:1], memcpy_copy(dev[1].data_ptr(), region(load), nbytes))),
        "rows, 1 stream": lambda: (Direction(torch, s0[:1], rows(store, True)),
                                   Direction(torch, s1[:1], rows(load, False))),
        "rows, load in 3 steps": lambda: (Direction(torch, s0[:1], rows(store, True)),
                                          Direction(torch, s1[:1], rows(load, False, 3))),
        "rows, 3 steps, done word": lambda: (
            Direction(torch, s0[:1], rows(store, True)),
            Direction(torch, s1[:1], rows(load, False, 3), word.data_ptr())),
        "rows, 3 steps, done word, engine waits": lambda: (
            Direction(torch, s0[:1], rows(store, True)),
            Direction(torch, s1[:1], rows(load, False, 3), word.data_ptr(), engine)),
        "rows, 8 streams": lambda: (Direction(torch, s0, rows(store, True)),
                                    Direction(torch, s1, rows(load, False))),
        "plane rows": lambda: (Direction(torch, s0[:1], plane_rows(store, True)),
                               Direction(torch, s1[:1], plane_rows(load, False))),
        "plane rows, 3 steps, done word, engine waits": lambda: (
            Direction(torch, s0[:1], plane_rows(store, True)),
            Direction(torch, s1[:1], plane_rows(load, False, 3), word.data_ptr(), engine)),
        "plane rows, 2 streams": lambda: (Direction(torch, s0[:2], plane_rows(store, True)),
                                          Direction(torch, s1[:2], plane_rows(load, False))),
    }
    wanted = set(filter(None, a.variants.split(";")))
    variants = {k: v for k, v in variants.items() if k == "memcpy" or not wanted or k in wanted}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "case": a.case, "MB": nbytes / 1e6,
                      "copies": a.copies, "arena_copies": a.arena_copies}), flush=True)
    for depth in map(int, a.depth.split(",")):
        for _ in range(a.reps):
            base = None
            for label, make in variants.items():
                out = {"both": [], "store": [], "load": []}
                for phase in ("store", "load", "both"):
                    word.zero_()  # each run's done words count from 1
                    pair = make()
                    dirs = {"store": pair[:1], "load": pair[1:], "both": pair}[phase]
                    try:
                        r = run(torch, list(dirs), a.copies, depth)
                    except RuntimeError as exc:
                        print(json.dumps({"variant": label, "error": str(exc)}), flush=True)
                        torch.cuda.synchronize()
                        break
                    out[phase] = len(dirs) * a.copies * nbytes / r["elapsed"] / 1e9
                    if phase == "both":
                        out["finished_ms"] = [round(f * 1e3, 1) for f in r["finished"]]
                else:
                    if label == "memcpy":
                        base = out
                    row = {"depth": depth, "variant": label,
                           **{f"{k}_GBps": round(out[k], 1) for k in ("store", "load", "both")},
                           "finished_ms": out["finished_ms"]}
                    if base is not None and label != "memcpy":
                        row.update({f"{k}_ratio": round(out[k] / base[k], 3)
                                    for k in ("store", "load", "both")})
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
