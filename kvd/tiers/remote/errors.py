"""The error a remote store backend raises for a failure the store itself reported.

Shared by the backends (kvd/tiers/remote/store.py, kvd/tiers/remote/mooncake.py,
kvd/tiers/remote/redis_arena.py); the remote tier (kvd/tiers/remote/tier.py) counts any
exception of a store call as a failure, this one included.
"""


class RemoteError(Exception):
    """The store answered with an error (or a backend's own error code)."""


def unless_all_failed(out: list) -> list:
    """``out`` (a multi-value call's outcome per value), unless every value failed: then the
    first ``RemoteError``, raised (the tier counts the call as failed)."""
    if out and all(isinstance(v, RemoteError) for v in out):
        raise out[0]
    return out
