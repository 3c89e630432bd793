#!/usr/bin/env python3
"""A stream of stores through a small host tier: store GB/s and what the checksums did.

    python3 tools/probes/store_stream.py [--seconds 8] [--capacity 256MiB] [--requests-chunks 8]

Starts a private daemon (host backend, default config but ``host_capacity``),
then one client stores fresh Llama-3-8B-shaped chunks (256 tokens, 32 MiB
each) back to back for ``--seconds``: every store evicts older chunks, as
under a sustained offload. Prints the store rate and the warm-restart
journal's checksum counters (``sealed_shards``, ``checksums_skipped``:
shards evicted before their checksum's turn, never read; ``checksums_stale``:
read, then evicted before the digest was written). Run it with
``PYTHONPATH`` on another checkout (from outside the repository, so that
``python -m kvd`` does not pick up the current directory) to compare
versions. A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import kvd_client
from kvd.bench.common import control, start_daemon, stop_daemon
from kvd.config import parse_size

CHUNK, LAYERS, HEADS, DIM, PAGE = 256, 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--capacity", default="256MiB")
    ap.add_argument("--request-chunks", type=int, default=8)
    a = ap.parse_args()
    pages = a.request_chunks * CHUNK // PAGE
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 2
    with tempfile.TemporaryDirectory(prefix="kvd-stream-") as rundir:
        daemon = start_daemon(rundir, capacity=parse_size(a.capacity), chunk_tokens=CHUNK)
        try:
            client = kvd_client.KvdClient(runtime_dir=rundir, raise_errors=True).connect()
            pool = kvd_client.SharedKVPool("vllm_flash_attn", num_layers=LAYERS, num_pages=pages,
                                           page_size=PAGE, kv_heads=HEADS, head_dim=DIM,
                                           dtype="bfloat16")
            client.register_kv(pool, model="store-stream")
            t0, n = time.monotonic(), 0
            while time.monotonic() - t0 < a.seconds:
                tokens = np.arange(a.request_chunks * CHUNK) + 10**9 + n * a.request_chunks * CHUNK
                client.store(tokens, np.arange(pages))
                n += 1
            elapsed = time.monotonic() - t0
            time.sleep(2)  # the checksums queued last
            warm = control(rundir, "stats")["tiers"]["host"].get("warm", {})
            gb = n * a.request_chunks * chunk_bytes / 1e9
            print(f"{n} stores of {a.request_chunks} chunks, {gb:.1f} GB in {elapsed:.1f} s: "
                  f"{gb / elapsed:.2f} GB/s; shards sealed {warm.get('sealed_shards')}, "
                  f"skipped {warm.get('checksums_skipped', 'n/a')}, "
                  f"read then evicted {warm.get('checksums_stale', 'n/a')}, "
                  f"unsealed {warm.get('unsealed_shards')}")
            client.close()
            pool.close()
        finally:
            stop_daemon(daemon, rundir)


if __name__ == "__main__":
    main()
