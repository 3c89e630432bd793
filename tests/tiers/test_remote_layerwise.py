"""Layer-wise loads whose prefix goes on in the remote store, against real stores and daemons.

A real ``redis-server`` or ``mooncake_master`` on loopback and two real
``kvd serve`` daemons (tests/tiers/test_remote_tier.py's nodes): node A
stores, node B holds the first half of each prefix and loads it whole,
layer-wise, without a lookup first, so every fetch happens inside the load
(kvd/server/remote_load.py: the local half's copy queued at once, each
remote run's as it lands, the layer words with the last piece). The engine
(a spawned process, tests/workers_remote.py) checks each layer of every
loaded chunk, local and remote, as soon as that layer's word arrives, and
every byte at the end. A value that fails mid-prefix gives a shorter
load: no error, the layer words still arrive, later pages keep their poison.
"""

from __future__ import annotations

import workers_disk as D
import workers_remote as R
from test_remote_tier import PREFIX, SPEC, corrupt, remote, store, wait_remote  # noqa: F401
from test_remote_zero_copy import node

CHUNK = D.CHUNK


def test_a_layerwise_half_local_half_remote_load_lands_every_layer_in_order(store, start_daemon,
                                                                           procs):
    a, b = node(start_daemon, store), node(start_daemon, store)
    ra, rb, model = str(a.runtime_dir), str(b.runtime_dir), f"remote/layerwise/{store.backend}"
    count, chunks, local = 3, 6, 3
    names = procs.apply(R.store_names, (ra, SPEC, 67, count, chunks, model, PREFIX))
    assert procs.apply(D.store_seqs, (ra, SPEC, 67, count, chunks, model, False)) \
        == count * chunks * CHUNK
    wait_remote(a, lambda r: r["puts"] == count * chunks, "node A's puts")
    assert procs.apply(R.load_prefix, (rb, SPEC, 67, count, chunks, local, model)) \
        == [(local * CHUNK, local * CHUNK)] * count
    pieces = remote(b)["load_pieces"]
    corrupt(store, [names[chunks * (count - 1) + 4]])  # the last sequence's fifth chunk
    expect = [chunks] * (count - 1) + [4]
    got = procs.apply(R.load_layerwise, (rb, SPEC, 67, count, chunks, model, expect))
    r = remote(b)
    assert got == [n * CHUNK for n in expect], r
    # each load copied its local half, then its remote runs, as pieces
    assert r["load_pieces"] >= pieces + count and r["corrupt"] == 1
    assert r["promotions"] == count * chunks - 1  # the local halves came from the store too
    assert r["errors"] == 0 and r["timeouts"] == 0
