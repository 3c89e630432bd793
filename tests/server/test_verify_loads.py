"""``verify_loads``: a byte flipped in a running daemon's host tier (real daemons).

With ``on`` the load checks each host chunk against the checksum the warm
restart index holds: the corrupt chunk is dropped and counted, the load
stops before it (``loaded`` is its index), the engine's pages for the later
chunks are untouched, and a second lookup stops before it too. With the
default ``off`` the flipped byte is served: the host tier is trusted, which
is the trade-off ``verify_loads`` exists for.
"""

from __future__ import annotations

import numpy as np
import workers_warm as W
from test_warm_restart import Checker, flip_byte, host, record_offset, sealed

from kvd.cli.format import format_stats

KNOBS = {"chunk_tokens": W.CHUNK, "host_capacity": "64MiB"}
BAD = 5  # the chunk of prompt 1 whose byte is flipped


def corrupt_one(d) -> Checker:
    """Store prompts 0..2, wait for their checksums, flip a byte of prompt 1's chunk BAD."""
    checker = Checker(d.runtime_dir)
    for i in range(3):
        assert checker.store(i) == W.CHUNKS * W.CHUNK
    sealed(d, 3 * W.CHUNKS)
    bad_key = checker.client.keys(W.tokens_of(1))[BAD]
    flip_byte(d.runtime_dir, record_offset(d.runtime_dir, bad_key) + W.CHUNK_BYTES // 3)
    return checker


def load_all(checker: Checker, i: int) -> tuple[int, np.ndarray, list]:
    """Load every chunk of prompt ``i`` into fresh pages (zeroed first): (chunks loaded,
    the pages, each tensor's bytes afterwards)."""
    dst = np.arange(W.PAGES // 2, W.PAGES // 2 + W.CHUNKS)
    for t in checker.pool.tensors:
        t.view(np.uint8)[:, dst] = 0
    loaded = checker.client.load(W.tokens_of(i), dst) // W.CHUNK
    return loaded, dst, [t.view(np.uint8) for t in checker.pool.tensors]


def test_on_drops_the_corrupt_chunk_and_the_load_stops_before_it(start_daemon):
    d = start_daemon(verify_loads="on", **KNOBS)
    with corrupt_one(d) as checker:
        loaded, dst, raws = load_all(checker, 1)
        assert loaded == BAD
        src = W.pages_of(1)
        for raw in raws:
            assert (raw[:, dst[:BAD]] == raw[:, src[:BAD]]).all()
            assert not raw[:, dst[BAD:]].any(), "pages past the corrupt chunk were written"
        stats = d.stats()
        assert stats["host_corrupt_dropped"] == 1, stats
        assert host(d)["chunks"] == 3 * W.CHUNKS - 1
        assert checker.hits(1) == BAD * W.CHUNK
        assert [checker.served_exactly(i) for i in (0, 2)] == [W.CHUNKS, W.CHUNKS]
        assert checker.store(1) == W.CHUNKS * W.CHUNK  # recomputed, stored again: served
        assert host(d)["chunks"] == 3 * W.CHUNKS
        assert checker.served_exactly(1) == W.CHUNKS
    assert "failed its checksum on load: dropped" in d.log()
    assert "corrupt host chunks dropped 1" in format_stats(d.stats())
    assert d.stats()["host_corrupt_dropped"] == 1


def test_off_serves_the_flipped_byte(start_daemon):
    d = start_daemon(**KNOBS)  # verify_loads = off: the host tier is trusted
    with corrupt_one(d) as checker:
        loaded, dst, raws = load_all(checker, 1)
        assert loaded == W.CHUNKS
        src = W.pages_of(1)
        assert any((raw[:, dst[BAD]] != raw[:, src[BAD]]).any() for raw in raws)
        assert d.stats()["host_corrupt_dropped"] == 0


def test_on_needs_warm_restart(start_daemon):
    d = start_daemon(wait=False, verify_loads="on", warm_restart="false", **KNOBS)
    assert d.proc.wait(30) == 2
    assert "verify_loads" in d.log() and "warm_restart" in d.log()



