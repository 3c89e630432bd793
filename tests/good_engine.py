"""The well-behaved engine of the bad-input tests (tests/server/test_bad_input.py,
tests/server/test_bad_register.py).

``Good(daemon)`` stores 4 chunks through kvd_client before the raw DEALERs
(``engine``: tests/rawwire.py on the daemon's engine socket) send their bad
requests; ``assert_intact(n)`` then checks the daemon is still healthy, its
``errors`` counter grew by exactly ``n``, nothing was stored, registered or
leased by the bad requests, and the chunks load back bit-exact (raw bytes:
random float16 bytes contain NaNs).
"""

from __future__ import annotations

import numpy as np
from rawwire import Raw

import kvd_client
from kvd_protocol.runtime import engine_endpoint

GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")  # layers, pages, page size, heads, dim
TOKENS = np.arange(64)  # 4 chunks of 16 tokens
KEY = b"\x07" * 16


class Good:
    """A well-behaved engine with 4 chunks stored from pages 0..15."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.client = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True)
        self.client.connect()
        self.pool = kvd_client.SharedKVPool(*GEOMETRY)
        self.pool.raw[:] = np.random.default_rng(3).integers(0, 256, self.pool.raw.size, dtype=np.uint8)
        self.reg = self.client.register_kv(self.pool, model="good")
        assert self.client.store(TOKENS, np.arange(16)) == 64
        self.keys = self.client.keys(TOKENS)
        self.stats0 = daemon.stats()

    def assert_intact(self, error_replies: int) -> None:
        """Healthy, errors counted, nothing changed, chunks bit-exact."""
        d = self.daemon
        assert d.control("health")["status"] == "ok"
        assert d.proc.poll() is None
        stats = d.stats()
        assert stats["errors"] - self.stats0["errors"] == error_replies
        host0, host = self.stats0["tiers"]["host"], stats["tiers"]["host"]
        assert (host["chunks"], host["entries"], host["used_bytes"]) == \
               (host0["chunks"], host0["entries"], host0["used_bytes"])
        assert stats["chunks_stored"] == self.stats0["chunks_stored"]
        assert stats["registrations"] == 1
        assert stats["leases"] == 0
        for t in self.pool.tensors:
            t.view(np.uint8)[:, 16:48] = 0
        assert self.client.lookup(TOKENS) == 64
        assert self.client.load(TOKENS, np.arange(16, 32)) == 64
        for t in self.pool.tensors:
            raw = t.view(np.uint8)
            assert (raw[:, 16:32] == raw[:, 0:16]).all()
            assert not raw[:, 32:48].any()

    def close(self):
        self.client.close()
        self.pool.close()


def engine(daemon, zctx) -> Raw:
    return Raw(engine_endpoint(daemon.runtime_dir), zctx)
