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
from test_remote_tier import HALF_SEQS, SPEC, half_local, remote, store  # noqa: F401

CHUNK = D.CHUNK


def test_a_layerwise_half_local_half_remote_load_lands_every_layer_in_order(store, start_daemon,
                                                                           procs):
    # store calls may take 2 s: a loaded 2-core VM has stalled a 16 KiB put past 0.2 s
    b, model, pieces = half_local(start_daemon, store, procs, 67, "layerwise", remote_timeout_s=2.0)
    count, chunks = HALF_SEQS
    expect = [chunks] * (count - 1) + [4]
    got = procs.apply(R.load_layerwise, (str(b.runtime_dir), SPEC, 67, count, chunks, model, expect))
    r = remote(b)
    assert got == [n * CHUNK for n in expect], r
    # each load copied its local half, then its remote runs, as pieces
    # a piece per run of remote chunks whose fetches landed together (they land in any
    # order): one to three (the remote half) per load, one for the damaged load's last
    assert pieces + count <= r["load_pieces"] <= pieces + (count - 1) * (chunks // 2) + 1, r
    assert r["corrupt"] == 1
    assert r["promotions"] == count * chunks - 1  # the local halves came from the store too
    assert r["errors"] == 0 and r["timeouts"] == 0
