"""What one reader may read: its namespace digest and its shard geometry.

Keys come from clients, so the daemon cannot trust a key belongs to the sender's
namespace. Every read path (host, disk, remote, GDS, ``attach`` lookups) asks
``admits(entry)`` before it counts or copies: another namespace, shard count or shard size
is a miss that ends the prefix; a partial entry is read only by a scope of its exact
``part`` tokens, a whole chunk never by such a scope. A ``Scope`` is made per request;
``refused`` counts what it turned away (once per request in ``foreign_ns_misses``).
"""

from __future__ import annotations


class Scope:
    __slots__ = ("ns", "shards", "shard_bytes", "part", "refused")

    def __init__(self, ns: bytes, shards: int, shard_bytes: int | None, part: int = 0):
        self.ns = ns
        self.shards = shards
        self.shard_bytes = shard_bytes
        self.part = part  # tokens of the partial entries it reads; 0: whole chunks only
        self.refused = 0

    def admits(self, entry) -> bool:
        """Whether ``entry`` is a chunk of this reader's namespace and geometry; counts it
        in ``refused`` when not."""
        if (entry.ns == self.ns and entry.shards == self.shards
                and getattr(entry, "part", 0) == self.part
                and (self.shard_bytes is None or entry.shard_bytes == self.shard_bytes)):
            return True
        self.refused += 1
        return False
