"""A cluster secret (``remote_secret``): a value forged in the remote store is never served.

Anyone who can write to the store can re-pack other bytes under a chunk's
name with valid checksums (header digest, payload digest): without a
secret such a value is served, the store is trusted (docs/cluster.md).
With one, every value carries a BLAKE2b tag keyed with it: nodes of the
same secret share chunks byte for byte, a forged value (untagged, or tagged
with another secret) is a miss, counted ``corrupt`` and deleted, and a
node with another secret or none uses other names. A real redis-server,
real daemons, engines in spawned processes (tests/workers_disk.py checks
every byte it loads against the storer's seed).
"""

from __future__ import annotations

import time

import numpy as np
import workers_disk as D
import workers_remote as R

from kvd.tiers.disk import chunk_file as F
from kvd.tiers.remote.value import Seal, pack

CHUNK = D.CHUNK
SPEC = {"layout": "vllm_flash_attn", "layers": 2, "page_size": 16, "dtype": "float16",
        "heads": 2, "dim": 64, "num_pages": 65}
SECRET = "a long random string the cluster's nodes share"
BOTH = [(2 * CHUNK, 2 * CHUNK)]


def node(start_daemon, redis_server, secret: str = SECRET):
    d = start_daemon(remote_backend="redis", remote_address=redis_server.url,
                     remote_prefix="keyed", remote_timeout_s=0.5, remote_breaker_retry_s=0.2,
                     env={"KVD_REMOTE_SECRET": secret} if secret else None)
    wait_remote(d, lambda r: r["breaker"] == "closed", "the store to answer")
    return d


def wait_remote(d, ok, what: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(r := d.stats()["tiers"]["remote"]):
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}: {r}\n{d.log()[-3000:]}"
        time.sleep(0.02)
    return r


def stored_names(procs, d, seed: int, model: str) -> list:
    """Store one sequence of 2 chunks on ``d``; the names its values got in the store."""
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, seed, 1, 2, model, False)) == 2 * CHUNK
    r = wait_remote(d, lambda r: r["puts"] == 2, "the puts")
    return procs.apply(R.store_names, (rd, SPEC, seed, 1, 2, model, r["prefix"]))


def forge(redis_server, names: list, seal: Seal | None) -> None:
    """Other bytes under each name, with valid checksums, tagged by ``seal`` (None: untagged)."""
    client = redis_server.client()
    try:
        for i, name in enumerate(names):
            head = F.unpack_header(client.get(name)[:F.HEADER.size])
            other = np.random.default_rng(i).integers(0, 256, head.length, np.uint8)
            client.set(name, bytes(pack(head.ns, head.key, other, head.shards, head.shard_bytes,
                                        seal)))
    finally:
        client.close()


def present(redis_server, names: list) -> list:
    client = redis_server.client()
    try:
        return [bool(client.exists(n)) for n in names]
    finally:
        client.close()


def test_without_a_secret_the_store_is_trusted(redis_server, start_daemon, procs):
    """What the secret is for: a re-packed value passes every unkeyed check and is served."""
    a, b = node(start_daemon, redis_server, ""), node(start_daemon, redis_server, "")
    names = stored_names(procs, a, 90, "remote/trusted")
    assert names[0].startswith("keyed/") and not a.stats()["tiers"]["remote"]["keyed"]
    forge(redis_server, names, None)
    assert procs.apply(R.load_unchecked, (str(b.runtime_dir), SPEC, 90, 1, 2,
                                          "remote/trusted")) == BOTH
    assert b.stats()["tiers"]["remote"]["corrupt"] == 0


def test_with_a_secret_nodes_share_chunks_and_forged_values_are_refused(redis_server,
                                                                         start_daemon, procs):
    a, b = node(start_daemon, redis_server), node(start_daemon, redis_server)
    model = "remote/keyed"
    names = stored_names(procs, a, 91, model)
    r = a.stats()["tiers"]["remote"]
    assert r["keyed"] and r["prefix"] == f"keyed/{Seal(SECRET).key_id}"
    assert SECRET not in a.log() and "remote_secret = \"<hidden>\" (env)" in a.log()
    assert procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 91, 1, 2, model)) == BOTH
    # nodes without the secret or with another one share nothing with them: other names
    for secret in ("", "another secret"):
        other = node(start_daemon, redis_server, secret)
        assert procs.apply(D.load_seqs, (str(other.runtime_dir), SPEC, 91, 1, 2, model)) == \
            [(0, 0)]
    # forged by someone without the secret (untagged) and with another secret
    forge(redis_server, names[:1], None)
    forge(redis_server, names[1:], Seal("another secret"))
    c = node(start_daemon, redis_server)
    got = procs.apply(D.load_seqs, (str(c.runtime_dir), SPEC, 91, 1, 2, model))
    assert got == [(2 * CHUNK, 0)]  # the store had both names; neither value was served
    r = wait_remote(c, lambda r: r["corrupt"] == 2, "both forged values counted")
    assert r["promotions"] == 0 and c.stats()["tiers"]["host"]["chunks"] == 0
    assert "keyed tag mismatch" in c.log() and "with a keyed tag" in c.log()
    deadline = time.monotonic() + 10
    while any(present(redis_server, names)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert present(redis_server, names) == [False, False]  # deleted from the store
