"""The independent reference of the data-path tests, and their client helpers.

The engine halves run in spawned processes build on it: those of
tests/server/test_data_path.py (tests/workers_data_sharing.py,
tests/workers_data_eviction.py), workers_disk, workers_ops, workers_partial
and workers_remote. Each engine owns a ``SharedKVPool`` filled with bytes
drawn from a seed, talks to a real daemon through ``KvdClient`` and checks
what lands in its pool.

Expected bytes never come from kvd: ``token_row`` reads a token row from
the engine's numpy tensors by the engine's own indexing (the tensor shapes
of DESIGN.md's layout table), and a storer's bytes are regenerated in the
checking process from the storer's seed (``make_pool``), so the daemon's
gather/scatter is checked against an independent reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kvd_client
from kvd_client.transport import Channel
from kvd_protocol.runtime import control_endpoint

CHUNK = 16          # the test daemons' chunk_tokens
POISON_SEED = 0xA5


# ---- the independent reference --------------------------------------------------

def expected_shapes(layout: str, layers: int, pages: int, ps: int, heads: int, dim: int) -> list:
    """Tensor shapes each engine allocates (DESIGN.md, 'Engine-side layouts')."""
    if layout == "vllm_flash_attn":
        return [(2, pages, ps, heads, dim)] * layers
    if layout == "vllm_flashinfer":
        return [(pages, 2, ps, heads, dim)] * layers
    if layout == "vllm_mla":
        return [(pages, ps, dim)] * layers
    if layout == "vllm_kv_blocks":
        return [(pages, heads, ps, 2 * dim)] * layers
    if layout == "sglang_mha":
        return [(pages * ps, heads, dim)] * (2 * layers)  # K0, V0, K1, V1, ...
    if layout == "sglang_mla":
        return [(pages * ps, 1, dim)] * layers
    if layout == "page_first":
        return [(pages, layers, 2, ps, heads, dim)]
    if layout == "opaque":
        return [(pages, heads, ps, dim)] * layers
    raise AssertionError(f"no reference for layout {layout!r}")


def token_row(layout: str, tensors: list, layer: int, plane: int, page: int, slot: int,
              page_size: int) -> np.ndarray:
    """uint8 view of the (heads x dim) row of token ``slot`` of page ``page``, (layer, plane):
    1-d, or ``[heads, dim bytes]`` where the heads of a row are apart (vLLM GPU blocks,
    whose ``tensors`` are the logical ``[blocks, heads, block_size, 2 * dim]`` views)."""
    if layout == "vllm_flash_attn":      # per layer [2, blocks, block_size, heads, dim]
        row = tensors[layer][plane, page, slot]
    elif layout == "vllm_flashinfer":    # per layer [blocks, 2, block_size, heads, dim]
        row = tensors[layer][page, plane, slot]
    elif layout == "vllm_mla":           # per layer [blocks, block_size, latent]
        assert plane == 0
        row = tensors[layer][page, slot]
    elif layout.startswith("vllm_kv_blocks"):  # per layer [blocks, heads, block_size, 2 * dim]
        half = tensors[layer].shape[-1] // 2   # K: each head's first half, V: its second
        row = tensors[layer][page, :, slot, plane * half:(plane + 1) * half]
        out = row.view(np.uint8)
        assert np.shares_memory(out, row)
        return out
    elif layout == "sglang_mha":         # K and V per layer [tokens, heads, dim]
        row = tensors[2 * layer + plane][page * page_size + slot]
    elif layout == "sglang_mla":         # per layer [tokens, 1, latent]
        assert plane == 0
        row = tensors[layer][page * page_size + slot]
    elif layout == "page_first":         # [pages, layers, 2, page_size, heads, dim]
        row = tensors[0][page, layer, plane, slot]
    elif layout == "opaque":             # per layer [blocks, heads, block_size, dim]: whole pages
        assert plane == 0                # move byte for byte; "row" t is the page's t-th slice
        row = tensors[layer][page].reshape(page_size, -1)[slot]
    else:
        raise AssertionError(f"no reference for layout {layout!r}")
    out = row.view(np.uint8).reshape(-1)
    assert np.shares_memory(out, row)
    return out


def planes(spec: dict) -> int:
    return 1 if spec["layout"].endswith("mla") or spec["layout"] == "opaque" else 2


def ppc(spec: dict) -> int:
    return CHUNK // spec["page_size"]


def make_pool(spec: dict, seed: int) -> kvd_client.SharedKVPool:
    """The pool of ``spec`` filled with the random bytes of ``seed`` (reproducible)."""
    pool = kvd_client.SharedKVPool(spec["layout"], spec["layers"], spec["num_pages"],
                                   spec["page_size"], spec["heads"], spec["dim"], spec["dtype"])
    shapes = expected_shapes(spec["layout"], spec["layers"], spec["num_pages"], spec["page_size"],
                             spec["heads"], spec["dim"])
    assert [t.shape for t in pool.tensors] == shapes, f"{spec['layout']} pool has unexpected shapes"
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def store_pages(spec: dict, seed: int, n: int) -> np.ndarray:
    """The random distinct pages a storer with ``seed`` takes its chunks from."""
    return np.random.default_rng([seed, 1]).permutation(spec["num_pages"])[:n]


def seq_tokens(seed: int, lengths: list) -> list:
    rng = np.random.default_rng([seed, 2])
    return [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.int64) for n in lengths]


def read_rows(spec: dict, tensors: list, pages, n_tokens: int) -> np.ndarray:
    """[token, layer, plane, row bytes] of ``n_tokens`` tokens kept in ``pages``."""
    ps = spec["page_size"]
    rows = None
    for t in range(n_tokens):
        for layer in range(spec["layers"]):
            for plane in range(planes(spec)):
                r = token_row(spec["layout"], tensors, layer, plane, int(pages[t // ps]), t % ps,
                              ps).reshape(-1)
                if rows is None:
                    rows = np.empty((n_tokens, spec["layers"], planes(spec), r.size), np.uint8)
                rows[t, layer, plane] = r
    return rows


def source_rows(spec: dict, seed: int, pages, n_tokens: int) -> np.ndarray:
    """The rows a storer with ``seed`` held in ``pages``, regenerated here."""
    shadow = make_pool(spec, seed)
    try:
        return read_rows(spec, shadow.tensors, pages, n_tokens)
    finally:
        shadow.close()


def poison(pool) -> np.ndarray:
    pool.raw[:] = np.random.default_rng(POISON_SEED).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool.raw.copy()


def _tensors_over(pool, raw: np.ndarray) -> list:
    """The pool's tensors, re-created over another byte array of the same size."""
    base = pool.raw.ctypes.data
    return [raw[t.ctypes.data - base:t.ctypes.data - base + t.nbytes].view(t.dtype).reshape(t.shape)
            for t in pool.tensors]


def expect_after_load(pool, spec: dict, before: np.ndarray, writes) -> np.ndarray:
    """``before`` with ``rows`` written to ``pages`` for every (pages, rows) in ``writes``."""
    exp = before.copy()
    tensors = _tensors_over(pool, exp)
    ps = spec["page_size"]
    for pages, rows in writes:
        for t in range(rows.shape[0]):
            for layer in range(spec["layers"]):
                for plane in range(planes(spec)):
                    row = token_row(spec["layout"], tensors, layer, plane, int(pages[t // ps]),
                                    t % ps, ps)
                    row[...] = rows[t, layer, plane].reshape(row.shape)
    return exp


def assert_rows(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Per token row: [token, layer, plane, bytes] arrays must be equal."""
    bad = np.argwhere((got != want).any(axis=-1))
    assert bad.size == 0, (f"{what}: {len(bad)} token rows differ from the storer's bytes, first "
                           f"(token, layer, plane) = {tuple(int(x) for x in bad[0])}")


def assert_pool(pool, exp: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(pool.raw != exp)
    assert bad.size == 0, (f"{what}: {bad.size} of {exp.size} pool bytes differ from the reference "
                           f"(first at byte {bad[0]})")


def client(runtime_dir: str) -> kvd_client.KvdClient:
    return kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=20, raise_errors=True).connect()


def daemon_stats(runtime_dir: str) -> dict:
    ch = Channel(control_endpoint(Path(runtime_dir)), 5.0)
    try:
        return ch.request("stats")
    finally:
        ch.close()


def store_one(runtime_dir: str, spec: dict, seed: int, tokens, model: str, salt=None) -> int:
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            n = len(tokens) // CHUNK
            return c.store(tokens, store_pages(spec, seed, n * ppc(spec)), salt=salt)
    finally:
        pool.close()
