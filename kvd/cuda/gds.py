"""GPU Direct Storage: disk-only chunks read straight into an engine's GPU pages.

With ``disk_gds`` on, chunk files are read with KvikIO (cuFile, or its compat mode) into a
per-GPU slot, verified on the GPU against their header digest (kvd.cuda.digest) and
scattered into the engine's pages; the host tier is not involved. ``open_gds`` returns
KvikIO and a mode line, or ``(None, reason)``. ``GdsLoader.prepare`` (at registration,
never on the request path) compiles and allocates; ``load`` returns ``(n, io_error)``: the
verified prefix queued on the pool's load stream, the rest for the host path. A bad chunk
ends the prefix, never written. Slots alternate; a slot is reused only after its kernels
finished; disk entries stay pinned for the whole load.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvd.tiers.disk.chunk_file import HEADER_BYTES, ChunkCorrupt, read_header
from kvd.tiers.disk.digest import combine, padded_length

log = logging.getLogger("kvd")
SLOTS = 2


def open_gds(threads: int) -> tuple[Any, str]:
    """(kvikio, mode) or (None, why not)."""
    try:
        import kvikio
        import kvikio.defaults
    except (ImportError, OSError) as exc:  # not installed, or its libraries (cuFile) missing
        return None, f"KvikIO is not importable ({type(exc).__name__}: {exc})"
    kvikio.defaults.set("num_threads", threads)
    if kvikio.defaults.is_compat_mode_preferred():
        return kvikio, "compat: cuFile unavailable, KvikIO reads through host bounce buffers"
    return kvikio, "gds"


@dataclass
class _Slot:
    array: Any          # cupy uint8 device array
    stream: Any         # digest kernels
    free: Any           # event: the scatter that last read this slot is done
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ptr(self) -> int:
        return int(self.array.data.ptr)


@dataclass
class _GpuState:
    hasher: Any
    slots: list
    next: int = 0


class GdsLoader:
    def __init__(self, kvikio: Any, mode: str, disk, slot_bytes: int):
        self.kvikio, self.mode, self.disk = kvikio, mode, disk
        self.slot_bytes = slot_bytes
        self.gpus: dict[int, _GpuState] = {}
        self.counters = {"direct_loads": 0, "direct_chunks": 0, "direct_bytes": 0, "fallbacks": 0}

    # ---- set-up ----------------------------------------------------------------------

    def prepare(self, reg) -> None:
        if getattr(reg.engine, "name", "") != "cuda" or reg.pool.device.ordinal in self.gpus:
            return
        import cupy as cp

        from kvd.cuda.digest import SegmentHasher
        ordinal = reg.pool.device.ordinal
        with cp.cuda.Device(ordinal):
            slots = []
            for _ in range(SLOTS):
                array = cp.empty(self.slot_bytes, dtype=cp.uint8)
                self.kvikio.buffer.memory_register(array)  # a no-op in compatibility mode
                free = cp.cuda.Event(block=True, disable_timing=True)
                free.record()
                slots.append(_Slot(array, cp.cuda.Stream(non_blocking=True), free))
            self.gpus[ordinal] = _GpuState(SegmentHasher(ordinal), slots)
        log.info("GPU Direct Storage on GPU %d: %d x %d MiB slots (%s)", ordinal, SLOTS,
                 self.slot_bytes >> 20, self.mode)

    def eligible(self, reg) -> bool:
        return (getattr(reg.engine, "name", "") == "cuda" and reg.ns.shards == 1
                and reg.pool.device.ordinal in self.gpus
                and padded_length(reg.shard_bytes) <= self.slot_bytes)

    # ---- loads ------------------------------------------------------------------------

    def disk_run(self, keys: list, host, scope) -> list:
        """Disk entries of the longest run of ``keys`` on disk as chunks ``scope`` may read
        (kvd/tiers/scope.py: the reader's namespace, one shard of its size) and not ready
        in ``host``."""
        run = []
        for key in keys:
            entry = host.entries.get(key)
            d = self.disk.get(key)
            if (entry is not None and entry.ready) or d is None or not scope.admits(d):
                break
            run.append(d)
        return run

    async def load(self, reg, keys: list, pages, host, check_deadline,
                   cancel: tuple[int, int] | None, scope) -> tuple[int, bool]:
        run = self.disk_run(keys, host, scope)
        if not run:
            return 0, False
        gpu = self.gpus[reg.pool.device.ordinal]
        stride = padded_length(reg.shard_bytes)
        per_slot = self.slot_bytes // stride
        progress = {"done": 0, "stop": False, "io_error": False}
        tasks, prev = [], None
        for e in run:  # pinned: the disk LRU must not delete a file this load will read
            e.refs += 1
        try:
            # batch k+1 reads into the other slot while batch k is verified and queued
            for b0 in range(0, len(run), per_slot):
                slot = gpu.slots[gpu.next]
                gpu.next = (gpu.next + 1) % len(gpu.slots)
                prev = asyncio.ensure_future(self._batch(
                    reg, gpu, slot, stride, run[b0:b0 + per_slot], pages, prev, progress,
                    check_deadline, cancel))
                tasks.append(prev)
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            for e in run:
                e.refs -= 1
        done = progress["done"]
        c = self.counters
        c["direct_loads"] += 1
        c["direct_chunks"] += done
        c["direct_bytes"] += done * reg.shard_bytes
        c["fallbacks"] += progress["io_error"]
        return done, progress["io_error"]

    async def _batch(self, reg, gpu, slot: _Slot, stride: int, batch: list, pages, prev,
                     progress: dict, check_deadline, cancel) -> None:
        """Read and verify ``batch`` into ``slot``; once the previous batch is queued (in
        order, so the loaded chunks stay a prefix), queue its scatter."""
        async with slot.lock:
            if progress["stop"]:
                return
            ok = await self.disk.read_many(batch, partial(self._read_batch, gpu, slot, stride,
                                                          progress))
            if prev is not None:
                await prev
            await reg.engine.table_slot(reg.pool.device)  # nothing awaits from here to the queueing
            if progress["stop"] or reg.closing:  # closing: the pool may be unmapped next
                progress["stop"] = True
                return
            if ok:
                check_deadline()  # raises when the client gave up: its pages stay as they are
                ppc, done = reg.pages_per_chunk, progress["done"]
                stream = reg.engine.scatter_device(
                    reg.pool, reg.layout, pages[done * ppc:(done + ok) * ppc],
                    [slot.ptr + i * stride for i in range(ok)], reg.ns.chunk_tokens, cancel)
                slot.free.record(stream)
                progress["done"] = done + ok
            progress["stop"] = ok < len(batch)

    def _read_batch(self, gpu: _GpuState, slot: _Slot, stride: int, progress: dict,
                    entries: list) -> list:
        """On an IO thread: read and verify ``entries`` into ``slot``; per entry None or
        the exception that makes it unusable (the first failure ends the batch). A
        failure other than a bad or vanished file sets ``progress["io_error"]``."""
        results = self._read_verify(gpu, slot, stride, entries)
        if any(r is not None and not isinstance(r, (ChunkCorrupt, FileNotFoundError))
               for r in results):
            progress["io_error"] = True
        return results

    def _read_verify(self, gpu: _GpuState, slot: _Slot, stride: int, entries: list) -> list:
        slot.free.synchronize()
        results: list = [None] * len(entries)
        reads = []
        try:
            for i, e in enumerate(entries):
                head = read_header(e.path)
                if (head.ns, head.key, head.length) != (e.ns, e.key, e.length):
                    raise ChunkCorrupt("header names another chunk")
                f = self.kvikio.CuFile(e.path, "r")
                view = slot.array[i * stride:(i + 1) * stride]
                reads.append((i, head, f, f.pread(view, stride, HEADER_BYTES)))
        except Exception as exc:  # noqa: BLE001 - reported per chunk to the disk tier
            results[len(reads)] = exc
        for i, _head, f, fut in reads:
            try:
                if fut.get() != stride:
                    raise ChunkCorrupt("file shorter than its header says")
            except Exception as exc:  # noqa: BLE001
                if results[i] is None:
                    results[i] = exc
            finally:
                f.close()
        n = next((i for i, r in enumerate(results) if r is not None), len(entries))
        if n:
            digests = gpu.hasher.digests(slot.ptr, stride, stride, n, slot.stream)
            for i, head, _f, _fut in reads[:n]:
                if combine(digests[i]) != head.digest:
                    results[i] = ChunkCorrupt("payload checksum mismatch")
                    break
        return results

    def stats(self) -> dict:
        return {"mode": self.mode, "gpus": sorted(self.gpus), **self.counters}
