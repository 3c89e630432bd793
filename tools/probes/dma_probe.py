"""Which copy-engine-only way moves paged KV fastest: 1D batches or pitched (3D) batches.

A measurement probe, not part of kvd. On a machine with a CUDA GPU:

    python3 tools/probes/dma_probe.py [--reps 5] [--cases llama:16,mla:16,llama:64,mla:64,llama:1]

A case ``shape:page:shm`` (or ``shape:page:bo:shm``) takes its host buffer
from a registered /dev/shm file as kvd's arena is; ``:thp`` and ``:small``
from anonymous memory in 2 MiB or 4 KiB pages (registered the same way), in place of
``cudaHostAlloc`` memory. A case ``shape:page:bo`` uses a block-outer pool ``[page][layer*plane][page
bytes]`` (vLLM 0.32's ``BLHNC``-family layouts: a page's planes adjacent).

A pool ``[layer*plane][page][page bytes]`` (one allocation, so the
(layer, plane) planes sit at one pitch, as in vLLM >= 0.2x's single KV
backing allocation) and a host buffer of 8 chunks of 256 tokens laid out
``[chunk][layer*plane][token][row]`` as kvd's arena is. Random page ids.
Ways, each over 1/2/4/8 streams:

- ``1d``: ``cuMemcpyBatchAsync_v2``, one copy per (layer, plane, page) (kvd's
  plain DMA copies); ``1d-any``: the same with source access order ANY;
  ``1d-overlap``: with the PREFER_OVERLAP_WITH_COMPUTE flag.
- ``3d-rows``: ``cuMemcpy3DBatchAsync_v2`` with the 1d copies as one-row ops.
- ``3d-hN``: ops of N planes each (N divides layers x planes).
- ``3d``: ``cuMemcpy3DBatchAsync_v2``, one pitched op per page: width = page
  bytes, height = layers x planes, the pool's plane pitch on one side and
  the chunk's plane pitch on the other: 1/64 as many ops for Llama.
- ``3d-pagemajor``: the same ops into a host buffer laid out page by page
  (an op's host rows adjacent; not kvd's arena layout, no byte check): does
  the host side's scatter cost the copy engines?
- ``page1d`` (block-outer cases only): a page-major host buffer and one
  contiguous ``cuMemcpyBatchAsync`` copy per page of all its planes: the best
  a block-outer pool and a page-major arena could give (no byte check).
- ``d2d-3d`` / ``d2d-1d``: the same ops (3d) or copies (1d) between the pool
  and a GPU staging buffer laid out as the host buffer: how fast the copy
  engines gather and scatter pages inside the GPU (no byte check).
- ``staged-3d`` / ``staged-1d``: copy engines only, staged: per chunk, the
  d2d gather into the staging buffer, then one contiguous memcpy of the
  chunk to the host on a copy stream of its own, overlapped with the next
  chunk's gather (loads: memcpy in, then the d2d scatter).

``--batches N`` queues each way's batch N times back to back per timing, as
a daemon with requests in flight does: one batch alone waits for its own
enqueue (1 ms for 2,000 copies) before the copies start. ``--join`` makes
the first stream wait for the others after each batch (kvd's
``DmaQueue.enqueue``); ``--host-gib G`` puts the chunks at random places
in a host buffer of G GiB, as in a daemon's arena (1d and 3d ways).

Directions: device-to-host, host-to-device, and both at once (each with the
streams given). Ratio = memcpy time of the same bytes / the way's time (both:
two memcpys on two streams), the memcpys timed right after the way's row (a
baseline timed once per case drifted: 20-54 GB/s h2d in one run). Each way
is checked byte for byte against a torch gather once per direction. Prints
JSON lines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np
from interference_probe import _Attr, _Loc, timeit  # this tool's neighbours in tools/
from probe_host import anon_huge_kib, registered

from kvd.cuda.dma.plan import OP_DTYPE, OPERAND_POINTER, ORDER_STREAM

SHAPES = {"llama": (32, 2, 8 * 128 * 2), "mla": (61, 1, 1152)}  # layers, planes, row bytes
CHUNK, CHUNKS = 256, 8

_cuda = ctypes.CDLL("libcuda.so.1")


def _batch1d(stream, dst, src, size, order=1, flags=0):
    attr, at = _Attr(order, _Loc(0, 0), _Loc(0, 0), flags), ctypes.c_size_t(0)
    rc = _cuda.cuMemcpyBatchAsync_v2(
        ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(src.ctypes.data),
        ctypes.c_void_p(size.ctypes.data), ctypes.c_size_t(len(dst)), ctypes.byref(attr),
        ctypes.byref(at), ctypes.c_size_t(1), ctypes.c_void_p(stream))
    if rc:
        raise RuntimeError(f"cuMemcpyBatchAsync_v2 -> {rc}")


def _batch3d(stream, ops):
    rc = _cuda.cuMemcpy3DBatchAsync_v2(ctypes.c_size_t(len(ops)), ctypes.c_void_p(ops.ctypes.data),
                                       ctypes.c_ulonglong(0), ctypes.c_void_p(stream))
    if rc:
        raise RuntimeError(f"cuMemcpy3DBatchAsync_v2 -> {rc}")


class Case:
    """One pool, one host buffer, the page ids, and the piece / op lists both ways."""

    def __init__(self, torch, name, page, block_outer=False, host_kind="pinned", host_gib=0.0,
                 run_major=False):
        layers, planes, row = SHAPES[name]
        self.name, self.page, self.lp = name, page, layers * planes
        self.piece = page * row
        pages = 8 * CHUNK * CHUNKS // page
        shape = (pages, self.lp, self.piece) if block_outer else (self.lp, pages, self.piece)
        self.raw = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        self.pool = self.raw.permute(1, 0, 2) if block_outer else self.raw  # [plane][page][bytes]
        self.nbytes = self.lp * CHUNK * CHUNKS * row
        chunk, whole = self.nbytes // CHUNKS, 1 << 30
        # --host-gib: chunks at random places, none across a 1 GiB registration (kvd's arena)
        places = (np.arange(whole // chunk) * chunk + np.arange(max(1, int(host_gib)))[:, None]
                  * whole).reshape(-1) if host_gib else np.arange(CHUNKS) * chunk
        size = int(places[-1]) + chunk
        if host_kind in ("shm", "thp", "small"):  # registered in 1 GiB pieces, as kvd's arena
            self.hostbuf = torch.from_numpy(registered(size, host_kind))
        else:
            self.hostbuf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.at = np.sort(np.random.default_rng(page + 1).choice(places, CHUNKS, replace=False)) \
            if host_gib else places
        self.host = self.hostbuf[:self.nbytes]  # the memcpys' buffer (and the chunks', unscattered)
        self.ids = np.random.default_rng(page).choice(pages, CHUNK * CHUNKS // page, replace=False)
        ppc = CHUNK // page
        plane_pitch, chunk_plane = (self.piece if block_outer else pages * self.piece), CHUNK * row
        page_stride = self.lp * self.piece if block_outer else self.piece
        lp = np.arange(self.lp, dtype=np.uint64).reshape(1, -1, 1)
        ids = self.ids.astype(np.uint64).reshape(CHUNKS, 1, ppc)
        j = np.arange(ppc, dtype=np.uint64).reshape(1, 1, -1)
        c = self.at.astype(np.uint64).reshape(-1, 1, 1)
        base, hbase = np.uint64(self.pool.data_ptr()), np.uint64(self.host.data_ptr())
        self.dev1 = (base + lp * np.uint64(plane_pitch) + ids * np.uint64(page_stride)).reshape(-1)
        self.host1 = (hbase + c + lp * np.uint64(chunk_plane)
                      + j * np.uint64(self.piece)).reshape(-1)
        if run_major:  # kvd's order for one allocation per layer: a page's planes, then the next
            order = np.arange(self.dev1.size).reshape(CHUNKS, self.lp, ppc).transpose(0, 2, 1).reshape(-1)
            self.dev1, self.host1 = self.dev1[order], self.host1[order]
        self.size1 = np.full(self.dev1.size, self.piece, np.uint64)
        first_dev = (base + ids * np.uint64(page_stride)).reshape(-1)
        first_host = (hbase + c + j * np.uint64(self.piece)).reshape(-1)
        self.dev3 = (first_dev, plane_pitch)
        self.host3 = (first_host, chunk_plane)
        self.stage = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        self.to_stage = np.uint64(self.stage.data_ptr()) - hbase  # host address -> staging
        self.scattered = bool(host_gib)  # staging and page-major ways assume chunks in place
        self.copy_stream = torch.cuda.Stream()
        self.chunk_bytes = self.nbytes // CHUNKS

    def ops(self, to_host, height=0, stage=False, page_major=False):
        """One op per (group of ``height`` planes, page); all planes by default. ``stage``:
        the staging buffer in place of the host buffer; ``page_major``: a host layout
        ``[chunk][page][plane][rows]`` (not kvd's), so an op's host rows are adjacent."""
        height = height or self.lp
        groups = np.arange(0, self.lp, height, dtype=np.uint64)[:, None]
        dev = (self.dev3[0][None, :] + groups * np.uint64(self.dev3[1])).reshape(-1), self.dev3[1]
        first = self.page_major_host() if page_major else self.host3[0]
        pitch = self.piece if page_major else self.host3[1]
        host = (first[None, :] + groups * np.uint64(pitch)
                + (self.to_stage if stage else np.uint64(0))).reshape(-1), pitch
        (src, src_pitch), (dst, dst_pitch) = (dev, host) if to_host else (host, dev)
        return make_ops(src, src_pitch, dst, dst_pitch, self.piece, height)

    def page_major_host(self):
        """Where each page starts in a host buffer laid out page by page, all planes."""
        return np.uint64(self.host.data_ptr()) + np.arange(
            self.dev3[0].size, dtype=np.uint64) * np.uint64(self.lp * self.piece)

    def chunks(self, torch):
        """The case's chunks out of the host buffer, in order."""
        n = self.nbytes // CHUNKS
        return torch.cat([self.hostbuf[int(k):int(k) + n] for k in self.at])

    def reference(self, torch):
        """The host buffer a perfect device-to-host copy gives, as a GPU tensor."""
        idx = torch.as_tensor(self.ids.reshape(CHUNKS, -1), device="cuda")
        return self.pool[:, idx].permute(1, 0, 2, 3).reshape(-1)


def make_ops(src, src_pitch, dst, dst_pitch, width, height):
    """Pointer-to-pointer ``CUDA_MEMCPY3D_BATCH_OP``s in stream order."""
    ops = np.zeros(np.broadcast(src, dst).size, OP_DTYPE)
    ops["src_type"] = ops["dst_type"] = OPERAND_POINTER
    ops["src"], ops["src_pitch"], ops["dst"], ops["dst_pitch"] = src, src_pitch, dst, dst_pitch
    ops["width"], ops["height"], ops["depth"], ops["order"] = width, height, 1, ORDER_STREAM
    return ops


JOIN = False  # --join


def _split(n, k):
    return [slice(int(a), int(b)) for a, b in zip(np.linspace(0, n, k + 1)[:-1],
                                                   np.linspace(0, n, k + 1)[1:]) if b > a]


def enqueue(case, way, to_host, streams):
    _enqueue(case, way, to_host, streams)
    if JOIN:  # as kvd's DmaQueue: the first stream waits for the others after each batch
        for st in streams[1:]:
            streams[0].wait_stream(st)


def _enqueue(case, way, to_host, streams):
    if way.startswith("staged"):
        return staged(case, way[7:], to_host, streams)
    if way.startswith("d2d"):
        return d2d(case, way[4:], to_host, streams, slice(None))
    if way.startswith("3d"):
        height = int(way[4:]) if way.startswith("3d-h") else 1 if way == "3d-rows" else 0
        ops = case.ops(to_host, height, page_major=way == "3d-pagemajor")
        for s, st in zip(_split(len(ops), len(streams)), streams):
            _batch3d(st.cuda_stream, ops[s])
        return
    if way == "page1d":  # block-outer pool, page-major host: one contiguous copy per page
        dev, host = case.dev3[0], case.page_major_host()
        dst, src = (host, dev) if to_host else (dev, host)
        size = np.full(dev.size, case.lp * case.piece, np.uint64)
        for s, st in zip(_split(len(dst), len(streams)), streams):
            _batch1d(st.cuda_stream, dst[s], src[s], size[s])
        return
    order, flags = {"1d": (1, 0), "1d-any": (3, 0), "1d-overlap": (1, 1)}[way]
    dst, src = (case.host1, case.dev1) if to_host else (case.dev1, case.host1)
    for s, st in zip(_split(len(dst), len(streams)), streams):
        _batch1d(st.cuda_stream, dst[s], src[s], case.size1[s], order, flags)


def d2d(case, way, to_host, streams, part):
    """The pages of ``part`` (a slice of chunks) between the pool and the staging buffer."""
    if way == "3d":
        ops = case.ops(to_host, stage=True).reshape(CHUNKS, -1)[part].reshape(-1)
        for s, st in zip(_split(len(ops), len(streams)), streams):
            if s.stop > s.start:  # fewer ops than streams
                _batch3d(st.cuda_stream, ops[s])
        return
    stage, dev = (a.reshape(CHUNKS, -1)[part].reshape(-1) for a in (case.host1 + case.to_stage,
                                                                     case.dev1))
    dst, src = (stage, dev) if to_host else (dev, stage)
    size = np.full(dst.size, case.piece, np.uint64)
    for s, st in zip(_split(len(dst), len(streams)), streams):
        _batch1d(st.cuda_stream, dst[s], src[s], size[s])


def staged(case, way, to_host, streams):
    """Chunk by chunk: d2d gather then memcpy out, or memcpy in then d2d scatter, the
    memcpy on ``case.copy_stream`` so one chunk's memcpy overlaps the next one's d2d."""
    import torch
    cs, n = case.copy_stream, case.chunk_bytes
    for c in range(CHUNKS):
        if not to_host:
            with torch.cuda.stream(cs):
                case.stage[c * n:(c + 1) * n].copy_(case.host[c * n:(c + 1) * n], non_blocking=True)
            for st in streams:
                st.wait_stream(cs)
        d2d(case, way, to_host, streams, slice(c, c + 1))
        if to_host:
            for st in streams:
                cs.wait_stream(st)
            with torch.cuda.stream(cs):
                case.host[c * n:(c + 1) * n].copy_(case.stage[c * n:(c + 1) * n], non_blocking=True)
    for st in streams:
        st.wait_stream(cs)


def check(torch, case, way, streams):
    """Poison, copy each way, compare with the gather; returns the wrong bytes."""
    ref = case.reference(torch)
    case.hostbuf.fill_(0xA5)
    torch.cuda.synchronize()  # the legacy stream's work, before the copy streams start
    enqueue(case, way, True, streams)
    torch.cuda.synchronize()
    wrong = int((case.chunks(torch).cuda() != ref).sum())
    saved = case.pool.clone()
    case.pool.fill_(0x5A)
    torch.cuda.synchronize()
    enqueue(case, way, False, streams)
    torch.cuda.synchronize()
    idx = torch.as_tensor(case.ids, device="cuda")
    wrong += int((case.pool[:, idx] != saved[:, idx]).sum())
    untouched = torch.ones(case.pool.shape[1], dtype=torch.bool, device="cuda")
    untouched[idx] = False
    wrong += int((case.pool[:, untouched] != 0x5A).sum())
    case.pool.copy_(saved)
    return wrong


def run_case(torch, spec, a, pools) -> None:
    name, page, *pool = spec.split(":")
    bo = "bo" in pool
    host = next((k for k in ("shm", "thp", "small") if k in pool), "pinned")
    case, other = (Case(torch, name, int(page), bo, host, a.host_gib, a.run_major) for _ in range(2))
    dev = torch.empty(case.nbytes, dtype=torch.uint8, device="cuda")

    def both_memcpy():
        with torch.cuda.stream(pools[0][0]):
            case.host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(pools[1][0]):
            other.raw.view(-1)[:case.nbytes].copy_(other.host, non_blocking=True)

    def memcpy_times():  # measured next to every row: the baseline drifts between rows
        return {"d2h": timeit(lambda: case.host.copy_(dev, non_blocking=True), a.reps),
                "h2d": timeit(lambda: dev.copy_(case.host, non_blocking=True), a.reps),
                "both": timeit(both_memcpy, a.reps)}

    def gbps(times):
        return {k: round(case.nbytes / v / 1e9 * (2 if k == "both" else 1), 1)
                for k, v in times.items()}
    print(json.dumps({"case": spec, "piece": case.piece, "MB": round(case.nbytes / 1e6),
                      "anon_huge_MiB": anon_huge_kib() // 1024,
                      "memcpy_GBps": gbps(memcpy_times())}), flush=True)
    for way in a.ways.split(","):
        if (way == "page1d" and not bo) or (case.scattered and (way.startswith(("d2d", "staged"))
                                                               or way in ("3d-pagemajor", "page1d"))):
            continue
        row = {"case": spec, "way": way}
        try:
            if not way.startswith("d2d") and way not in ("3d-pagemajor", "page1d"):
                row["wrong_bytes"] = check(torch, case, way, pools[0][:4])
        except RuntimeError as e:
            print(json.dumps({**row, "error": str(e)}), flush=True)
            continue
        for n in map(int, a.streams.split(",")):
            s0, s1 = pools[0][:n], pools[1][:n]
            t = {"d2h": timeit(lambda w=way, s=s0: _times(a.batches, enqueue, case, w, True, s),
                               a.reps),
                 "h2d": timeit(lambda w=way, s=s0: _times(a.batches, enqueue, case, w, False, s),
                               a.reps),
                 "both": timeit(lambda w=way, s=s0, o=s1: _times(a.batches, both, case, other, w, s, o),
                                a.reps)}
            one = memcpy_times()
            t0 = time.perf_counter()
            enqueue(case, way, True, s0)
            host_ms = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            print(json.dumps({**row, "streams": n, "enqueue_ms": round(host_ms, 2),
                              "memcpy_GBps": gbps(one),
                              **{k: round(one[k] * a.batches / v, 3) for k, v in t.items()}}),
                  flush=True)


def both(case, other, way, s0, s1):
    """``case`` to the host on ``s0`` while ``other`` comes from it on ``s1``."""
    enqueue(case, way, True, s0)
    enqueue(other, way, False, s1)


def _times(n, fn, *args):
    """``fn(*args)`` ``n`` times back to back (queued behind each other, as pipelined requests
    are: the first batch's enqueue no longer delays the rest)."""
    for _ in range(n):
        fn(*args)


def pitch_check(torch, gib):
    """One 2-row op whose pool rows are ``gib`` GiB apart, both ways, checked."""
    pitch, width = int(gib * 2**30) // 4096 * 4096, 1 << 20
    pool = torch.zeros(pitch + width, dtype=torch.uint8, device="cuda")
    host = torch.randint(0, 256, (2 * width,), dtype=torch.uint8).pin_memory()
    ops = make_ops(host.data_ptr(), width, pool.data_ptr(), pitch, width, 2)
    s = torch.cuda.Stream()
    out = {"pitch_GiB": gib}
    try:
        _batch3d(s.cuda_stream, ops)
        torch.cuda.synchronize()
        rows = torch.stack([pool[:width], pool[pitch:pitch + width]]).cpu().reshape(-1)
        out["wrong_bytes"] = int((rows != host).sum())
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def main() -> None:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="llama:16,mla:16,llama:64,mla:64,llama:1")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--ways", default="1d,1d-any,1d-overlap,3d-rows,3d")
    ap.add_argument("--batches", type=int, default=1, help="the same batch queued this many "
                    "times back to back per timing (a pipelined daemon's queue; ratios against "
                    "as many memcpys)")
    ap.add_argument("--join", action="store_true", help="after each batch, the first stream "
                    "waits for the others, as kvd's DmaQueue.enqueue does")
    ap.add_argument("--run-major", action="store_true", help="1d copies page by page, each "
                    "page's planes in turn (kvd's order for pools of one allocation per layer), "
                    "not plane by plane within a chunk")
    ap.add_argument("--host-gib", type=int, default=0, help="a host buffer this large with "
                    "the case's chunks at random places in it, as in a daemon's arena (1d and 3d "
                    "ways only)")
    ap.add_argument("--pitch-check", default="", help="GiB pitches to try with a 2-row op, "
                    "e.g. 1.5,2.5,4.5: is the op accepted, are the bytes right")
    a = ap.parse_args()
    global JOIN
    JOIN = a.join
    for gib in filter(None, a.pitch_check.split(",")):
        print(json.dumps(pitch_check(torch, float(gib))), flush=True)
    torch.cuda.init()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    pools = [[torch.cuda.Stream() for _ in range(8)] for _ in range(2)]
    for spec in a.cases.split(","):
        run_case(torch, spec, a, pools)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
