#!/usr/bin/env python3
"""Where the time of kvd's GPU copies goes (a diagnostic, not a test).

In one process, Llama-3-8B-shaped pools (bf16, vLLM flash-attn), 8 chunks of
256 tokens (268 MB) unless told otherwise:

1. host memory: cudaHostAlloc vs a cudaHostRegister-ed /dev/shm mapping
   (the daemon's arena): one DMA, DMA in 8 MiB pieces (1-D and 2-D), both
   directions at once, and zero-copy SM kernels at several block caps;
2. the staged path (kvd.cuda_staging: kernels into device slots + DMA)
   at several page sizes, checked bit-exact against the zero-copy kernel;
3. both directions at once through two staging rings;
4. the slowdown of a bf16 GEMM running in another process (as an engine
   would) while copies of each kind loop, and the copy throughput meanwhile.

Times are host wall clock around enqueue + synchronize, medians of --reps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_bench import make_pool  # noqa: E402

from kvd.arena import SharedArena  # noqa: E402
from kvd.cuda_kernels import KernelCopier, desc_params, plane_bases  # noqa: E402
from kvd.cuda_staging import StagingRing  # noqa: E402

CHUNK = 256
D2H, H2D = 2, 1
ROWS = []


def emit(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def med_s(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class Host:
    """Two host buffers of ``nbytes`` of one kind: hostalloc or shm-registered."""
    made = 0

    def __init__(self, kind, nbytes):
        self.kind = kind
        Host.made += 1
        if kind == "hostalloc":
            self._mem = cp.cuda.alloc_pinned_memory(2 * nbytes)
            self.view = np.frombuffer(self._mem, np.uint8, 2 * nbytes)
        else:
            self.arena = SharedArena(Path("/dev/shm"), f"probe{Host.made}", 2 * nbytes)
            self.view = self.arena.view
            cp.cuda.runtime.hostRegister(self.view.ctypes.data, 2 * nbytes, 0x3)
        self.ptr = self.view.ctypes.data
        self.view[:] = 0x11

    def close(self):
        if self.kind != "hostalloc":
            cp.cuda.runtime.hostUnregister(self.ptr)
            self.view = None
            self.arena.close()


def env_info():
    rt = cp.cuda.runtime
    info = {"driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion(), "cupy": cp.__version__}
    for p in ("/sys/kernel/mm/transparent_hugepage/shmem_enabled",
              "/sys/kernel/mm/transparent_hugepage/enabled"):
        try:
            info[p] = Path(p).read_text().strip()
        except OSError as exc:
            info[p] = str(exc)
    try:
        info["shm_mount"] = [ln for ln in Path("/proc/mounts").read_text().splitlines() if "/dev/shm" in ln]
    except OSError:
        pass
    props = rt.getDeviceProperties(0)
    info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info["sms"] = props["multiProcessorCount"]
    emit(part="env", **info)


def memory_kinds(reps, nbytes):
    dev = cp.empty(2 * nbytes, cp.uint8)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    desc, size = make_pool("llama", 32, 16, 4 * 8 * CHUNK)
    pool = cp.random.random(size // 4, dtype=cp.float32).view(cp.uint8)
    pages = np.random.default_rng(1).choice(desc.num_pages, 8 * CHUNK // 16, replace=False)
    bases = plane_bases(desc, [pool.data.ptr])
    shard = desc.shard_bytes(CHUNK)
    params = dict(desc_params(desc), chunk_tokens=CHUNK)
    for kind in ("hostalloc", "shm-registered"):
        h = Host(kind, nbytes)
        rt = cp.cuda.runtime

        def one(direction, stream=s1, off=0):
            if direction == "d2h":
                rt.memcpyAsync(h.ptr + off, dev.data.ptr + off, nbytes, D2H, stream.ptr)
            else:
                rt.memcpyAsync(dev.data.ptr + off, h.ptr + off, nbytes, H2D, stream.ptr)

        for direction in ("d2h", "h2d"):
            t = med_s(lambda: (one(direction), s1.synchronize()), reps)
            emit(part="mem", host=kind, op=f"dma-1x-{direction}", ms=t * 1e3, GBps=nbytes / t / 1e9)
            piece = 8 << 20

            def pieces(direction=direction):
                for off in range(0, nbytes, piece):
                    n = min(piece, nbytes - off)
                    if direction == "d2h":
                        rt.memcpyAsync(h.ptr + off, dev.data.ptr + off, n, D2H, s1.ptr)
                    else:
                        rt.memcpyAsync(dev.data.ptr + off, h.ptr + off, n, H2D, s1.ptr)
                s1.synchronize()
            t = med_s(pieces, reps)
            emit(part="mem", host=kind, op=f"dma-8MiB-{direction}", ms=t * 1e3, GBps=nbytes / t / 1e9)

            def two_d(direction=direction):  # 32 x (8 rows of 1 MiB, host pitch = shard)
                for layer in range(32):
                    hp, dp = h.ptr + layer * (1 << 20), dev.data.ptr + layer * (8 << 20)
                    if direction == "d2h":
                        rt.memcpy2DAsync(hp, shard, dp, 1 << 20, 1 << 20, 8, D2H, s1.ptr)
                    else:
                        rt.memcpy2DAsync(dp, 1 << 20, hp, shard, 1 << 20, 8, H2D, s1.ptr)
                s1.synchronize()
            t = med_s(two_d, reps)
            emit(part="mem", host=kind, op=f"dma-2d-{direction}", ms=t * 1e3, GBps=nbytes / t / 1e9)

        def both():
            one("d2h", s1, 0)
            one("h2d", s2, nbytes)
            s1.synchronize()
            s2.synchronize()
        t = med_s(both, reps)
        emit(part="mem", host=kind, op="dma-both", ms=t * 1e3, GBps=2 * nbytes / t / 1e9)
        ptrs = [h.ptr + k * shard for k in range(8)]
        for cap in (32, 132, 264):
            cop = KernelCopier(0, max_blocks=cap)
            for direction in ("gather", "scatter"):
                fn = getattr(cop, direction)
                t = med_s(lambda: (fn(bases, pages, ptrs, stream=s1, **params), s1.synchronize()), reps)
                emit(part="mem", host=kind, op=f"zero-copy-{direction}", cap=cap, ms=t * 1e3,
                     GBps=8 * shard / t / 1e9)
        h.close()



class Setup:
    """A pool, an arena, reference pages; for staged runs."""

    def __init__(self, kind, page, n_chunks):
        layers = 32 if kind == "llama" else 61
        ppc = CHUNK // page
        self.desc, size = make_pool(kind, layers, page, max(4 * n_chunks * CHUNK, 2 * page))
        self.pool = cp.random.random(size // 4, dtype=cp.float32).view(cp.uint8)
        self.shard = self.desc.shard_bytes(CHUNK)
        self.n = n_chunks
        rng = np.random.default_rng(page)
        perm = rng.permutation(self.desc.num_pages)
        self.src, self.dst = perm[:n_chunks * ppc], perm[n_chunks * ppc:2 * n_chunks * ppc]
        self.bases = plane_bases(self.desc, [self.pool.data.ptr])
        self.geometry = dict(desc_params(self.desc), chunk_tokens=CHUNK)
        self.layer_bytes = self.desc.planes * CHUNK * self.desc.row_bytes
        self.host = Host("shm-registered", n_chunks * self.shard)
        self.ptrs = [self.host.ptr + k * self.shard for k in range(n_chunks)]
        self.nbytes = n_chunks * self.shard

    def close(self):
        self.host.close()
        del self.pool


def staged(reps):
    cop_cache = {}
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    for kind, page, n in (("llama", 16, 8), ("llama", 1, 8), ("llama", 256, 8), ("llama", 16, 1),
                          ("mla", 16, 8)):
        st = Setup(kind, page, n)
        ref = None
        for slot_mib, slots, cap in ((32, 2, 32),):
            cop = cop_cache.setdefault(cap, KernelCopier(0, max_blocks=cap))
            rings = [StagingRing(cp, "gather", cop, streams[0], streams[1], slots, slot_mib << 20),
                     StagingRing(cp, "scatter", cop, streams[2], streams[3], slots, slot_mib << 20)]
            for ring, direction in zip(rings, ("gather", "scatter")):
                for per_layer in ((False, True) if direction == "scatter" else (False,)):
                    pieces = ring.plan(st.n, 0, st.desc.num_layers, st.layer_bytes, per_layer)
                    pids = st.src if direction == "gather" else st.dst
                    enq = []

                    def go():
                        t0 = time.perf_counter()
                        s = ring.run(pieces, st.bases, pids, st.ptrs, st.geometry)
                        enq.append(time.perf_counter() - t0)
                        s.synchronize()
                    t = med_s(go, reps)
                    emit(part="staged", pool=kind, page=page, chunks=n, dir=direction,
                         per_layer=per_layer, slot_MiB=slot_mib, slots=slots, cap=cap,
                         pieces=len(pieces), ms=t * 1e3, GBps=st.nbytes / t / 1e9,
                         enqueue_ms=statistics.median(enq) * 1e3)
            # correctness: gather = zero-copy gather; scatter back into dst = src pages
            rings[0].run(rings[0].plan(st.n, 0, st.desc.num_layers, st.layer_bytes, False),
                         st.bases, st.src, st.ptrs, st.geometry).synchronize()
            got = st.host.view[:st.nbytes].copy()
            if ref is None:
                cop.gather(st.bases, st.src, st.ptrs, stream=streams[0], **st.geometry)
                streams[0].synchronize()
                ref = st.host.view[:st.nbytes].copy()
            ok_g = bool(np.array_equal(got, ref))
            rev = st.ptrs[::-1]  # 1-D DMA path, scatter in reverse chunk order
            st.host.view[:st.nbytes] = ref
            rings[1].run(rings[1].plan(st.n, 0, st.desc.num_layers, st.layer_bytes, True),
                         st.bases, st.dst, rev, st.geometry).synchronize()
            st.host.view[:st.nbytes] = 0
            cop.gather(st.bases, st.dst, rev, stream=streams[0], **st.geometry)
            streams[0].synchronize()
            ok_s = bool(np.array_equal(st.host.view[:st.nbytes], ref))
            emit(part="staged-check", pool=kind, page=page, chunks=n, slot_MiB=slot_mib, cap=cap,
                 gather_ok=ok_g, scatter_ok=ok_s)
            for r in rings:
                r.close()
        st.close()


def both_directions(reps):
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    for cap in (32, 132):
        st = Setup("llama", 16, 8)
        cop = KernelCopier(0, max_blocks=cap)
        g = StagingRing(cp, "gather", cop, streams[0], streams[1], 2, 32 << 20)
        s = StagingRing(cp, "scatter", cop, streams[2], streams[3], 2, 32 << 20)
        other = Host("shm-registered", st.nbytes)
        optrs = [other.ptr + k * st.shard for k in range(8)]
        pieces = g.plan(8, 0, 32, st.layer_bytes, False)

        def go():
            a = g.run(pieces, st.bases, st.src, st.ptrs, st.geometry)
            b = s.run(pieces, st.bases, st.dst, optrs, st.geometry)
            a.synchronize()
            b.synchronize()
        t = med_s(go, reps)
        emit(part="both-staged", cap=cap, ms=t * 1e3, GBps=2 * st.nbytes / t / 1e9)

        def zc():
            cop.gather(st.bases, st.src, st.ptrs, stream=streams[0], **st.geometry)
            cop.scatter(st.bases, st.dst, optrs, stream=streams[2], **st.geometry)
            streams[0].synchronize()
            streams[2].synchronize()
        t = med_s(zc, reps)
        emit(part="both-zero-copy", cap=cap, ms=t * 1e3, GBps=2 * st.nbytes / t / 1e9)
        g.close()
        s.close()
        other.close()
        st.close()


def gemm_child(conn):
    import torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def ms(iters=20):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            a @ b
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / iters

    ms(5)
    conn.send("ready")
    while conn.recv() == "go":
        conn.send(statistics.median(ms() for _ in range(5)))


def gemm(reps):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=gemm_child, args=(child,))
    proc.start()
    assert parent.recv() == "ready"
    st = Setup("llama", 16, 8)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    dev = cp.empty(st.nbytes, cp.uint8)

    def loop_for(mode, cap, slots=2, slot_mib=16):
        cop = KernelCopier(0, max_blocks=cap)
        rings = [StagingRing(cp, "gather", cop, streams[0], streams[1], slots, slot_mib << 20),
                 StagingRing(cp, "scatter", cop, streams[2], streams[3], slots, slot_mib << 20)]
        pieces = rings[0].plan(8, 0, 32, st.layer_bytes, False)

        def step():
            if mode == "staged":
                rings[0].run(pieces, st.bases, st.src, st.ptrs, st.geometry).synchronize()
                rings[1].run(pieces, st.bases, st.dst, st.ptrs, st.geometry).synchronize()
            elif mode == "zero-copy":
                cop.gather(st.bases, st.src, st.ptrs, stream=streams[0], **st.geometry)
                streams[0].synchronize()
                cop.scatter(st.bases, st.dst, st.ptrs, stream=streams[2], **st.geometry)
                streams[2].synchronize()
            elif mode == "dma-only":
                cp.cuda.runtime.memcpyAsync(st.host.ptr, dev.data.ptr, st.nbytes, D2H, streams[1].ptr)
                streams[1].synchronize()
                cp.cuda.runtime.memcpyAsync(dev.data.ptr, st.host.ptr, st.nbytes, H2D, streams[3].ptr)
                streams[3].synchronize()
            else:
                time.sleep(0.005)
        return step, rings

    for mode, cap, slots, slot_mib in (("idle", 0, 2, 32), ("zero-copy", 32, 2, 32),
                                       ("staged", 32, 2, 32), ("staged", 132, 2, 32),
                                       ("staged", 32, 2, 64), ("dma-only", 0, 2, 32)):
        step, rings = loop_for(mode, max(cap, 1), slots, slot_mib)
        step()
        stop = threading.Event()
        count = [0]
        span = []

        def work():
            with cp.cuda.Device(0):
                span.append(time.perf_counter())
                while not stop.is_set():
                    step()
                    count[0] += 1
                span.append(time.perf_counter())
        th = threading.Thread(target=work)
        th.start()
        time.sleep(0.1)
        parent.send("go")
        ms = parent.recv()
        stop.set()
        th.join()
        for r in rings:
            r.close()
        emit(part="gemm", mode=mode, cap=cap, slots=slots, slot_MiB=slot_mib, gemm_ms=ms,
             copy_GBps=2 * st.nbytes * count[0] / (span[1] - span[0]) / 1e9)
    parent.send("stop")
    proc.join(30)
    st.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="")
    ap.add_argument("--parts", default="env,mem,staged,both,gemm")
    args = ap.parse_args()
    parts = args.parts.split(",")
    steps = {"env": env_info, "mem": lambda: memory_kinds(args.reps, 8 * 32 * 2 * CHUNK * 2048),
             "staged": lambda: staged(args.reps), "both": lambda: both_directions(args.reps),
             "gemm": lambda: gemm(args.reps)}
    for name in parts:
        t0 = time.perf_counter()
        try:
            steps[name]()
        except Exception as exc:  # noqa: BLE001 - report and go on with the other parts
            import traceback
            traceback.print_exc()
            emit(part=name, error=f"{type(exc).__name__}: {exc}")
        print(f"== part {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
