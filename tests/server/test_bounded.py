"""No local peer can grow the daemon (DESIGN.md, "Failure model"): real daemons, real sockets.

- Steady stores through a full host tier that keeps a few hot chunks
  resident: the warm-restart checksum queue stays within the tier's shards
  and the daemon's memory stays flat.
"""

from __future__ import annotations

import time

import workers_bounded as WB
from daemons import status_kib

HOT_S = 20.0  # the hot-traffic test's length
TIER_CHUNKS = 4096  # 64 MiB of 16 KiB chunks


def unsealed(d) -> int:
    return d.stats()["tiers"]["host"]["warm"]["unsealed_shards"]


def test_hot_traffic_keeps_the_checksum_queue_and_memory_flat(start_daemon, procs):
    """Copies never pause, so nothing is hashed; the hot chunks stay resident, the rest turns
    over. The checksums waiting stay below the tier's shard count and the daemon's resident
    memory after warm-up does not grow with the stores."""
    d = start_daemon(host_capacity="64MiB")
    pid = d.proc.pid
    job = procs.apply_async(WB.hot_writer, (str(d.runtime_dir), 1, HOT_S))
    t0 = time.monotonic()
    time.sleep(4.0)  # the tier is full after about 1,000 stores
    rss0, queued = status_kib(pid, "VmRSS"), []
    while time.monotonic() - t0 < HOT_S - 0.5:
        queued.append(unsealed(d))
        time.sleep(0.5)
    rss1 = status_kib(pid, "VmRSS")
    stores = job.get(30)["stores"]
    assert stores > 3000, stores  # a steady stream (about 1,000 a second here)
    assert max(queued) <= 2 * TIER_CHUNKS, queued
    assert rss1 - rss0 < 6 * 1024, f"grew {rss1 - rss0} KiB over {stores} stores"
    host = d.stats()["tiers"]["host"]
    assert host["entries"] <= TIER_CHUNKS
