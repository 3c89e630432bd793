"""What one DMA copy queues: pitched (3D) copy ops between pool pages and arena chunks.

Why pitched: below ~64 KiB the copy engines pay per copy, not per byte; one 3D op per run
of pages over all (layer, plane) planes at one pitch moves 0.82-1.04 of a memcpy where
single copies moved 0.4-0.75. ``OP_DTYPE`` is the driver's ``CUDA_MEMCPY3D_BATCH_OP``.
``row_groups``/``pool_groups`` find the pool's planes at one pitch in one allocation.
``CopyOps`` plans one copy once: ops per (row group, run of pages; a ``SKIP_PAGE`` id is in no
run: a partial load's tail), cut where rows overlap or the host side crosses an arena
registration; ``steps(most)`` cover it exactly once. Promises little NumPy per copy:
planning runs on the event loop (0.4-0.7 ms for 268 MB).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

OP_DTYPE = np.dtype({
    "names": ["src_type", "src", "src_pitch", "src_layer", "src_loc", "src_loc_id",
              "dst_type", "dst", "dst_pitch", "dst_layer", "dst_loc", "dst_loc_id",
              "width", "height", "depth", "order", "flags"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<i4"] * 2 + ["<u8"] * 3 + ["<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 36, 40, 48, 56, 64, 72, 76, 80, 88, 96, 104, 108],
    "itemsize": 112})
OPERAND_POINTER, ORDER_STREAM = 1, 1
MAX_PITCH = 4 << 30  # 1.5, 2.5 and 4.5 GiB pitches were checked on an H100
MIN_ROWS = 16  # fewer rows go one by one: 32 KiB rows, 2/4/8 per op 0.35/0.5/0.73 of a
# memcpy, one by one 0.75, 64 per op 0.95 (H100)


def pool_groups(layout: Any, bases: np.ndarray) -> list[tuple[int, int, int, int]]:
    """``row_groups`` of a pool: its planes' ``bases`` in the layout's allocations."""
    return row_groups(bases, layout.num_layers, layout.planes, [buf for buf, _ in layout.bases])


def row_groups(bases: np.ndarray, layers: int, planes: int,
               buffers: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """The (layer, plane) planes as ``(first, step, count, pitch)`` groups (module doc);
    planes of different ``buffers`` (allocations) are never in one group."""
    key = [(int(buf), int(b)) for buf, b in zip(buffers or [0] * len(bases), bases)]
    in_order = _runs(key, list(range(layers * planes)), 1)
    by_plane = [g for k in range(planes)
                for g in _runs(key, list(range(k, layers * planes, planes)), planes)]
    return in_order if len(in_order) <= len(by_plane) else sorted(by_plane)


def _runs(key: list[tuple[int, int]], seq: list[int], step: int) -> list[tuple[int, int, int, int]]:
    def gap(a: int, b: int) -> int:  # pitch from plane a to plane b, 0 if they cannot share an op
        (buf_a, at_a), (buf_b, at_b) = key[a], key[b]
        return at_b - at_a if buf_a == buf_b and 0 < at_b - at_a <= MAX_PITCH else 0

    out, i = [], 0
    while i < len(seq):
        n, pitch = 1, 0
        if i + 1 < len(seq) and gap(seq[i], seq[i + 1]):
            pitch, n = gap(seq[i], seq[i + 1]), 2
            while i + n < len(seq) and gap(seq[i + n - 1], seq[i + n]) == pitch:
                n += 1
        out.append((seq[i], step, n, pitch))
        i += n
    return out


class Step(NamedTuple):
    """Part of a copy: ``ops`` (pitched, several rows each) and single rows."""
    ops: np.ndarray
    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    @property
    def nbytes(self) -> int:
        return int((self.ops["width"] * self.ops["height"]).sum() + self.size.sum())


class CopyOps:
    """One copy, planned once (module doc)."""

    def __init__(self, layout: Any, bases: np.ndarray, page_ids: np.ndarray,
                 shard_ptrs: np.ndarray, chunk_tokens: int, host_pieces: tuple[int, int],
                 to_host: bool, by_layer: bool = False, groups: list | None = None) -> None:
        self.planes, self.num_layers, self.by_layer = layout.planes, layout.num_layers, by_layer
        self.to_host, self.host_pieces = to_host, host_pieces
        page_bytes, self.plane_bytes = layout.page_size * layout.row_bytes, chunk_tokens * layout.row_bytes
        ppc = chunk_tokens // layout.page_size
        ids = np.asarray(page_ids, np.int64).reshape(len(shard_ptrs), ppc)
        start = np.ones(ids.shape, bool)
        if layout.page_stride == page_bytes:  # pages adjacent in the pool: runs merge
            start[:, 1:] = ids[:, 1:] != ids[:, :-1] + 1
        skip = ids < 0  # SKIP_PAGE (kvd.copy.plan): a partial load's tail, in no run
        ends = np.flatnonzero(start | skip) if skip.any() else np.flatnonzero(start)
        start &= ~skip
        c, j = np.nonzero(start)
        self.run_chunk = c  # the chunk each run of pages is in
        first = np.flatnonzero(start)
        self.run_width = (np.append(ends, ids.size)[np.searchsorted(ends, first) + 1] - first) \
            .astype(np.uint64) * np.uint64(page_bytes)
        self.run_host = np.asarray(shard_ptrs, np.uint64)[c] + j.astype(np.uint64) * np.uint64(page_bytes)
        run_pool = ids[c, j].astype(np.uint64) * np.uint64(layout.page_stride)
        groups = pool_groups(layout, bases) if groups is None else groups
        self.layer_bytes = self.planes * (ids.size - int(skip.sum())) * page_bytes
        self.row_layer, self.rows_per_run = None, 0  # > 0: rows run-major, this many per run
        if not by_layer and ppc == 1 and self._chunk_per_row(bases, run_pool, groups):
            return
        first, step, count, pitch = _columns(tuple(map(tuple, groups)), by_layer, MIN_ROWS)
        # entries (run, group), run-major: ops come out in run order
        pool = run_pool[:, None] + bases[first.astype(np.int64)][None, :]
        host = self.run_host[:, None] + (first * np.uint64(self.plane_bytes))[None, :]
        host_pitch, width = step * np.uint64(self.plane_bytes), self.run_width[:, None]
        single = count.max() == 1  # every plane its own group: single rows
        pitched = count.min() > 1 and self.run_width.max() <= pitch.min()
        if (single or pitched) and not _crosses(host, host_pitch, count, width, host_pieces).any():
            if single:
                self._contiguous(pool, host, width, first)
                return
            if (width == pitch).all() and (pitch == host_pitch).all():
                self._contiguous(pool, host, width * count, first)
                return
            self.ops = _ops(pool, host, width, count, pitch, host_pitch, to_host).reshape(-1)
            self.op_run = np.repeat(np.arange(pool.shape[0], dtype=np.uint64), pool.shape[1])
            self.rows = {k: np.zeros(0, np.uint64) for k in ("pool", "host", "width", "run", "plane")}
            return  # the usual case: every entry one pitched op, no single rows
        self._entries(pool, host, width, count, pitch, host_pitch, first, step)

    def _chunk_per_row(self, bases, run_pool, groups) -> bool:
        """What ``_contiguous`` makes of a block-outer copy whose chunk is one page (each run
        one chunk), without the general pass's NumPy calls (the daemon's event loop plans every
        copy): each chunk one row, when the pool's planes are one group adjacent at a page's
        pitch and no chunk's host side crosses a registration. False otherwise."""
        n_planes, page_bytes = self.planes * self.num_layers, self.plane_bytes
        if n_planes < MIN_ROWS or len(groups) != 1 or tuple(groups[0]) != (0, 1, n_planes, page_bytes):
            return False
        size = np.uint64(n_planes * page_bytes)
        if _crosses(self.run_host, size, np.uint64(1), size, self.host_pieces).any():
            return False
        n = run_pool.size  # what _contiguous makes of these, without its broadcasts
        self._single_rows(run_pool + bases[0], self.run_host, np.full(n, size),
                          np.arange(n, dtype=np.uint64), np.zeros(n, np.uint64), 1)
        return True

    def _contiguous(self, pool, host, size, first) -> None:
        """Every entry one single row, no pitched op: its rows adjacent on both sides (a
        block-outer pool whose page is a chunk), or one row each (every plane its own
        group: a pool of one allocation per layer, a layer-wise copy)."""
        shape = pool.shape
        # flatten(), not reshape(): a broadcast view would keep its 0 strides, and the
        # driver reads each array as contiguous
        self._single_rows(pool.reshape(-1), host.reshape(-1), np.broadcast_to(size, shape).flatten(),
                          np.repeat(np.arange(shape[0], dtype=np.uint64), shape[1]),
                          np.broadcast_to(first, shape).flatten(), shape[1])

    def _single_rows(self, pool, host, width, run, plane, per_run: int) -> None:
        """A plan of single rows only, ``per_run`` of them per run, run-major."""
        self.ops, self.op_run, self.rows_per_run = np.zeros(0, OP_DTYPE), np.zeros(0, np.uint64), per_run
        self.rows = {"pool": pool, "host": host, "width": width, "run": run, "plane": plane}
        self.row_layer = plane // np.uint64(self.planes)

    def _entries(self, pool, host, width, count, pitch, host_pitch, first, step) -> None:
        """The general case: entries that make whole pitched ops, and single rows."""
        shape = pool.shape
        run = np.arange(shape[0], dtype=np.uint64)[:, None]
        g = {k: np.broadcast_to(v, shape).reshape(-1) for k, v in (
            ("pool", pool), ("host", host), ("width", width), ("count", count),
            ("pool_pitch", pitch), ("host_pitch", host_pitch), ("run", run), ("plane", first),
            ("step", step))}
        whole = ((g["count"] == 1) | (g["width"] <= g["pool_pitch"])) & ~_crosses(
            g["host"], g["host_pitch"], g["count"], g["width"], self.host_pieces)
        multi = whole & (g["count"] > 1)
        self.ops = _ops(*(g[k][multi] for k in ("pool", "host", "width", "count", "pool_pitch",
                                                "host_pitch")), self.to_host)
        self.op_run = g["run"][multi]
        single = {k: v[whole & (g["count"] == 1)] for k, v in g.items()}
        rest = _split(_rows({k: v[~whole] for k, v in g.items()}), *self.host_pieces)
        self.rows = {k: np.concatenate([single[k], rest[k]]) for k in ("pool", "host", "width",
                                                                        "run", "plane")}
        self.row_layer = self.rows["plane"] // np.uint64(self.planes)

    def run_steps(self, most: int) -> list[slice]:
        """Consecutive groups of runs of at most ``most`` bytes over all layers (at least
        one run each), in order."""
        per_run = self.run_width * np.uint64(self.planes * self.num_layers)
        if int(per_run.sum()) <= most:
            return [slice(0, per_run.size)]
        out, start, acc = [], 0, 0
        for r, n in enumerate(per_run.tolist()):
            if acc and acc + n > most:
                out.append(slice(start, r))
                start, acc = r, 0
            acc += n
        return out + [slice(start, per_run.size)]

    def steps(self, most: int) -> list[Step]:
        """The whole copy in steps (module doc)."""
        if self.by_layer:
            return [self._take(slice(0, 0), self.row_layer == layer)
                    for layer in range(self.num_layers)]
        runs = self.run_steps(most)
        at = np.searchsorted(self.op_run, [r.start for r in runs] + [self.run_width.size]).tolist()
        if not self.rows["run"].size:
            return [self._take(slice(at[i], at[i + 1]), None) for i in range(len(runs))]
        if k := self.rows_per_run:
            return [self._take(slice(at[i], at[i + 1]), slice(r.start * k, r.stop * k))
                    for i, r in enumerate(runs)]
        return [self._take(slice(at[i], at[i + 1]),
                           (self.rows["run"] >= r.start) & (self.rows["run"] < r.stop))
                for i, r in enumerate(runs)]

    def _take(self, ops: slice, row_mask: np.ndarray | slice | None) -> Step:
        """Step of ``self.ops[ops]`` (ops are in run order) and the rows in ``row_mask``."""
        rows = self.rows if row_mask is None else {k: self.rows[k][row_mask]
                                                   for k in ("pool", "host", "width")}
        dst, src = (rows["host"], rows["pool"]) if self.to_host else (rows["pool"], rows["host"])
        return Step(self.ops[ops], dst, src, rows["width"])


@functools.lru_cache(maxsize=256)
def _columns(groups: tuple, by_layer: bool, min_rows: int) -> tuple[np.ndarray, ...]:
    """``(first, step, count, pitch)`` arrays of a pool's groups as a copy cuts them (one
    plane each when ``by_layer``, else ``_cut``), read-only: cached per pool, as the
    Python loop over a pool of one allocation per layer cost the event loop ~40 us a copy
    (``min_rows`` is MIN_ROWS, a key so that a changed value is never served stale)."""
    cut = [(f + t * st, st, 1, 0) for f, st, n, p in groups for t in range(n)] if by_layer \
        else _cut(list(groups), min_rows)
    cols = tuple(np.array(col, np.uint64) for col in zip(*cut))
    for col in cols:
        col.flags.writeable = False
    return cols


def _cut(groups: list[tuple[int, int, int, int]], min_rows: int) -> list[tuple[int, int, int, int]]:
    """Groups of fewer than ``min_rows`` planes as one group per plane."""
    out = []
    for first, step, count, pitch in groups:
        out += [(first, step, count, pitch)] if count >= min_rows else \
            [(first + t * step, step, 1, 0) for t in range(count)]
    return out


def _crosses(host, host_pitch, count, width, host_pieces) -> np.ndarray:
    base, piece = (np.uint64(v) for v in host_pieces)
    end = host + (count - np.uint64(1)) * host_pitch + width - np.uint64(1)
    return (host - base) // piece != (end - base) // piece


def _ops(pool, host, width, height, pool_pitch, host_pitch, to_host: bool) -> np.ndarray:
    """Ops of the given sides, their arrays broadcast against ``pool``'s shape."""
    ops = np.zeros(pool.shape, OP_DTYPE)
    src, dst = ("host", "pool") if not to_host else ("pool", "host")
    side = {"pool": (pool, pool_pitch), "host": (host, host_pitch)}
    ops["src_type"] = ops["dst_type"] = OPERAND_POINTER
    ops["src"], ops["src_pitch"] = side[src]
    ops["dst"], ops["dst_pitch"] = side[dst]
    ops["width"], ops["height"], ops["depth"], ops["order"] = width, height, 1, ORDER_STREAM
    return ops


def rows(ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst, src, size)`` of every row of ``ops``: the same copies one row each."""
    r = _rows({"pool": ops["dst"], "host": ops["src"], "width": ops["width"],
               "count": ops["height"], "pool_pitch": ops["dst_pitch"], "host_pitch": ops["src_pitch"]})
    return r["pool"], r["host"], r["width"]


def _rows(g: dict) -> dict:
    """Entries of several rows as one entry per row (``plane`` per row, where given)."""
    n = g["count"].astype(np.int64)
    i = (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)).astype(np.uint64)
    r = {k: np.repeat(v, n) for k, v in g.items()}
    out = {"pool": r["pool"] + i * r["pool_pitch"], "host": r["host"] + i * r["host_pitch"],
           "width": r["width"]}
    if "plane" in r:
        out.update(run=r["run"], plane=r["plane"] + i * r["step"])
    return out


def _split(g: dict, base: int, piece: int) -> dict:
    """Rows cut where the host side crosses from one registered piece to the next."""
    host, size = g["host"], g["width"]
    first = (host - np.uint64(base)) // np.uint64(piece)
    last = (host + size - np.uint64(1) - np.uint64(base)) // np.uint64(piece)
    crosses = first != last
    out: dict[str, list[int]] = {k: [] for k in g}
    for p, h, z, run, plane in zip(*(g[k][crosses].tolist() for k in ("pool", "host", "width",
                                                                      "run", "plane"))):
        at, end = h, h + z
        while at < end:
            cut = min(end, base + ((at - base) // piece + 1) * piece)
            for k, v in zip(("pool", "host", "width", "run", "plane"),
                            (p + at - h, at, cut - at, run, plane)):
                out[k].append(v)
            at = cut
    return {k: np.concatenate([g[k][~crosses], np.array(out[k], np.uint64)]) for k in g}
