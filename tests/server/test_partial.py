"""Partial chunks end to end: a real ``kvd serve``, real client processes.

A load may end inside its last chunk at a page boundary (``tail_pages``,
docs/protocol.md): the daemon copies that chunk's first pages only. Checked on
every layout, layer-wise or not: the loaded token rows are the storer's bytes
(regenerated from its seed in the loading process), and no other byte of the
poisoned destination pool changes, the pages past the tail included.
"""

from __future__ import annotations

import pytest
import workers_data as W
import workers_partial as P

from kvd_protocol.layout import LAYOUTS

CHUNK = W.CHUNK
MHA = {"heads": 2, "dim": 12}
MLA = {"heads": 1, "dim": 36}


def spec(layout: str, page_size: int = 4, dtype: str = "float16", layers: int = 2) -> dict:
    geo = MLA if layout.endswith("mla") else MHA
    return {"layout": layout, "layers": layers, "page_size": page_size, "dtype": dtype,
            "num_pages": 7 * (CHUNK // page_size) + 1, **geo}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_ends_inside_its_last_chunk(daemon, procs, layout, layerwise):
    s = spec(layout)
    tokens = W.seq_tokens(31, [3 * CHUNK + 3])[0]
    rd = str(daemon.runtime_dir)
    assert procs.apply(W.store_one, (rd, s, 31, tokens, "partial")) == 3 * CHUNK
    got = procs.apply(P.partial_loads, (rd, s, 31, tokens[:3 * CHUNK], "partial", layerwise))
    assert got == {t: 2 * CHUNK + t * 4 for t in (1, 2, 3)}


def test_a_partial_load_of_a_chunk_not_stored_stops_before_it(daemon, procs):
    s = spec("vllm_flash_attn", page_size=8)
    tokens = W.seq_tokens(41, [3 * CHUNK])[0]
    rd = str(daemon.runtime_dir)
    assert procs.apply(W.store_one, (rd, s, 41, tokens[:2 * CHUNK], "partial")) == 2 * CHUNK
    assert procs.apply(P.partial_load_of_a_miss, (rd, s, 42, tokens, "partial")) == 2 * CHUNK


@pytest.mark.parametrize("layout", ["vllm_flash_attn", "vllm_mla", "sglang_mha", "opaque"])
@pytest.mark.parametrize("chunks", [2, 0])
def test_a_tail_stored_as_a_partial_entry_loads_back_exact(daemon, procs, layout, chunks):
    """Whole chunks and the tail after them as a partial entry (protocol §8.5): a lookup with
    partial candidates finds the stored length; the partial entry loads into its pages
    exactly; read as a whole chunk or as another length it is a miss that writes nothing."""
    s = spec(layout)
    tokens = W.seq_tokens(51, [chunks * CHUNK + 12])[0]
    rd = str(daemon.runtime_dir)
    assert procs.apply(P.store_with_tail, (rd, s, 51, tokens, "tails", 8)) == chunks * CHUNK + 8
    got = procs.apply(P.load_with_tail, (rd, s, 51, tokens, "tails", 8))
    assert got == {"lookup": chunks * CHUNK + 8, "part": 8, "plain_lookup": chunks * CHUNK,
                   "loaded": chunks * CHUNK, "part_loaded": 8, "as_chunk": 0, "as_shorter": 0}
    host = daemon.stats()["tiers"]["host"]
    assert host["entries"] == chunks + 1
