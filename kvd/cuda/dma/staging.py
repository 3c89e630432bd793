"""Staged copies: SM kernels on the GPU side, DMA across PCIe.

A copy runs in pieces through a ring of device slots: store = kernel gathers pool rows into
a slot, DMA moves it to the arena; load = the reverse; piece k's DMA overlaps piece k+1's
kernel. ``plan_pieces`` splits chunks x layers into slot-sized pieces, layer groups
outermost (None when one layer of one chunk does not fit). ``host_runs`` groups chunk
addresses into strided runs, split at arena registration boundaries. ``StagingRing`` (one
GPU, one direction) only enqueues and returns the stream whose completion means the copy
landed; layer-wise loads write each layer's word as it lands; a slot is reused only after
its last piece, waited on the GPU. Never waits on another process or blocks the host.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_D2H, _H2D = 2, 1                 # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice
_EVENT_NO_TIMING = 0x2            # cudaEventDisableTiming
MAX_PITCH = 2**31 - 1             # cudaMemcpy2D pitch limit on current GPUs


def plan_pieces(n_chunks: int, layer_begin: int, layer_end: int, layer_bytes: int,
                slot_bytes: int, per_layer: bool) -> list[tuple[int, int, int, int]] | None:
    """Pieces ``(c0, c1, a, b)`` covering the copy, each at most ``slot_bytes``."""
    layers = layer_end - layer_begin
    if n_chunks < 1 or layers < 1:
        return []
    fit = slot_bytes // layer_bytes           # chunk-layers one slot holds
    if fit < 1:
        return None
    group = _balanced(n_chunks, min(n_chunks, fit))
    per = _balanced(layers, 1 if per_layer else max(1, min(layers, fit // group)))
    return [(c0, min(c0 + group, n_chunks), a, min(a + per, layer_end))
            for a in range(layer_begin, layer_end, per)
            for c0 in range(0, n_chunks, group)]


def _balanced(total: int, most: int) -> int:
    """The smallest part size that splits ``total`` into as few parts as ``most`` does."""
    parts = -(-total // most)
    return -(-total // parts)


def host_runs(addrs: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first, count, stride)`` runs of ``addrs`` with a constant stride in
    ``(0, MAX_PITCH]`` (``count == 1`` runs have stride 0)."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(addrs)
    while i < n:
        j, stride = i + 1, 0
        if j < n and 0 < addrs[j] - addrs[i] <= MAX_PITCH:
            stride = addrs[j] - addrs[i]
            while j < n and addrs[j] - addrs[j - 1] == stride:
                j += 1
        runs.append((i, j - i, stride))
        i = j
    return runs


def piece_spans(addr: int, length: int, base: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` parts of the host range ``[addr, addr + length)``, split
    where memory registered in ``piece``-byte pieces from ``base`` changes piece:
    one DMA must stay inside one registration (CUDA rejects it otherwise)."""
    out, done = [], 0
    while done < length:
        at = addr + done
        end = base + ((at - base) // piece + 1) * piece
        part = min(length - done, end - at)
        out.append((done, part))
        done += part
    return out


class StagingRing:
    """Pieces of one direction of one GPU through ``slots`` device buffers."""

    def __init__(self, cp: Any, kind: str, copier: Any, kernel_stream: Any, dma_stream: Any,
                 slots: int, slot_bytes: int, host_pieces: tuple[int, int] = (0, 2**62)) -> None:
        if kind not in ("gather", "scatter"):
            raise ValueError("kind must be gather or scatter")
        self.cp, self.rt, self.kind, self.copier = cp, cp.cuda.runtime, kind, copier
        self.kernel_stream, self.dma_stream = kernel_stream, dma_stream
        self.slot_bytes = slot_bytes
        self.pieces = host_pieces  # (base, piece bytes): a DMA never crosses a registration
        self._mem = [cp.cuda.alloc(slot_bytes) for _ in range(slots)]
        self.slot_ptrs = [int(m.ptr) for m in self._mem]
        self._kernel_done = [self.rt.eventCreateWithFlags(_EVENT_NO_TIMING) for _ in range(slots)]
        self._dma_done = [self.rt.eventCreateWithFlags(_EVENT_NO_TIMING) for _ in range(slots)]
        self._next = 0

    def plan(self, n_chunks: int, layer_begin: int, layer_end: int, layer_bytes: int,
             per_layer: bool):
        return plan_pieces(n_chunks, layer_begin, layer_end, layer_bytes, self.slot_bytes, per_layer)

    def run(self, pieces: list, bases: np.ndarray, page_ids: np.ndarray, shard_ptrs: Sequence[int],
            geometry: dict, signal: Any = None, copier: Any = None) -> Any:
        """Enqueue ``pieces`` (from ``plan``); returns the stream that finishes last.
        ``copier``: what fills and empties the slots instead of the ring's kernels."""
        rt, k_stream, d_stream = self.rt, self.kernel_stream.ptr, self.dma_stream.ptr
        shard_ptrs = [int(p) for p in shard_ptrs]
        layer_bytes = geometry["planes"] * geometry["chunk_tokens"] * geometry["row_bytes"]
        slots = [(self._next + j) % len(self.slot_ptrs) for j in range(len(pieces))]
        self._next = (self._next + len(pieces)) % len(self.slot_ptrs)
        kernel_ptrs = []
        for (c0, c1, a, b), s in zip(pieces, slots):
            width = (b - a) * layer_bytes
            kernel_ptrs += [(self.slot_ptrs[s] + k * width - a * layer_bytes) % 2**64
                            for k in range(c1 - c0)]
        runs = {}
        gather = self.kind == "gather"
        cancel = None if signal is None else signal.cancel
        with (copier or self.copier).batch(self.kind, bases, page_ids, kernel_ptrs,
                                           stream=self.kernel_stream, cancel=cancel,
                                           **geometry) as batch:
            ptr_first = 0
            for j, ((c0, c1, a, b), s) in enumerate(zip(pieces, slots)):
                if (c0, c1) not in runs:
                    runs[c0, c1] = [(c0 + i, n, st) for i, n, st in host_runs(shard_ptrs[c0:c1])]
                if gather:
                    rt.streamWaitEvent(k_stream, self._dma_done[s], 0)
                    batch.launch(c0, c1 - c0, a, b, ptr_first)
                    rt.eventRecord(self._kernel_done[s], k_stream)
                    rt.streamWaitEvent(d_stream, self._kernel_done[s], 0)
                    self._dma(runs[c0, c1], c0, s, a, b, layer_bytes, shard_ptrs)
                    rt.eventRecord(self._dma_done[s], d_stream)
                else:
                    rt.streamWaitEvent(d_stream, self._kernel_done[s], 0)
                    self._dma(runs[c0, c1], c0, s, a, b, layer_bytes, shard_ptrs)
                    rt.eventRecord(self._dma_done[s], d_stream)
                    rt.streamWaitEvent(k_stream, self._dma_done[s], 0)
                    batch.launch(c0, c1 - c0, a, b, ptr_first)
                    rt.eventRecord(self._kernel_done[s], k_stream)
                    last_of_layers = j + 1 == len(pieces) or pieces[j + 1][2] != a
                    if signal is not None and signal.layerwise and last_of_layers:
                        signal.layers_landed(k_stream, range(a, b))
                ptr_first += c1 - c0
        return self.dma_stream if gather else self.kernel_stream

    def _dma(self, runs, c0: int, s: int, a: int, b: int, layer_bytes: int,
             shard_ptrs: Sequence[int]) -> None:
        """DMAs between slot ``s`` (chunks from ``c0``, ``width`` bytes each) and
        layers ``[a, b)`` of the chunks' shards in the arena."""
        rt, stream = self.rt, self.dma_stream.ptr
        width = (b - a) * layer_bytes
        for first, count, stride in runs:
            host = shard_ptrs[first] + a * layer_bytes
            dev = self.slot_ptrs[s] + (first - c0) * width
            if count > 1 and len(piece_spans(host, stride * (count - 1) + width, *self.pieces)) == 1:
                if self.kind == "gather":
                    rt.memcpy2DAsync(host, stride, dev, width, width, count, _D2H, stream)
                else:
                    rt.memcpy2DAsync(dev, width, host, stride, width, count, _H2D, stream)
                continue
            for i in range(count):
                for offset, length in piece_spans(host + i * stride, width, *self.pieces):
                    h, d = host + i * stride + offset, dev + i * width + offset
                    if self.kind == "gather":
                        rt.memcpyAsync(h, d, length, _D2H, stream)
                    else:
                        rt.memcpyAsync(d, h, length, _H2D, stream)


    def close(self) -> None:
        """Free the slots and events; the caller synchronized both streams."""
        for ev in self._kernel_done + self._dma_done:
            self.rt.eventDestroy(ev)
        self._mem = []
