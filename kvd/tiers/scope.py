"""What one reader may read: its namespace digest and its shard geometry.

Keys are computed by clients, so the daemon cannot trust that a key it is
sent belongs to the sender's namespace: a client registered as another
model, TP size or shard size may send keys it learnt elsewhere. Every read
path (host tier, disk tier, remote tier, GPU Direct Storage, and lookups of
``attach`` registrations) asks ``admits(entry)`` before it counts or copies
an entry; an entry of another namespace digest, shard count or shard size
is a miss for this reader and ends its prefix there.

A ``Scope`` is made per request (``Registration.scope()``): ``shard_bytes``
is None for a registration without a pool (``attach``), whose namespace
fixes the shard size anyway. ``refused`` counts the entries it turned away,
so the request can be counted once in the daemon's ``foreign_ns_misses``.
Entries of every tier (kvd/tiers/host/entry.py, kvd/tiers/disk/entry.py's
``DiskEntry``, a remote value's ``ChunkHeader``) carry ``ns``, ``shards``
and ``shard_bytes``.
"""

from __future__ import annotations


class Scope:
    __slots__ = ("ns", "shards", "shard_bytes", "refused")

    def __init__(self, ns: bytes, shards: int, shard_bytes: int | None):
        self.ns = ns
        self.shards = shards
        self.shard_bytes = shard_bytes
        self.refused = 0

    def admits(self, entry) -> bool:
        """Whether ``entry`` is a chunk of this reader's namespace and geometry; counts it
        in ``refused`` when not."""
        if (entry.ns == self.ns and entry.shards == self.shards
                and (self.shard_bytes is None or entry.shard_bytes == self.shard_bytes)):
            return True
        self.refused += 1
        return False
