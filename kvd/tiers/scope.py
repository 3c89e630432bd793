"""What one reader may read: its namespace digest and its shard geometry.

Keys come from clients, so the daemon cannot trust a key belongs to the sender's
namespace. Every read path (host, disk, remote, GDS, ``attach`` lookups) asks
``admits(entry)`` before it counts or copies: another namespace, shard count or shard size
is a miss that ends the prefix. A ``Scope`` is made per request; ``refused`` counts what it
turned away (once per request in ``foreign_ns_misses``).
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
