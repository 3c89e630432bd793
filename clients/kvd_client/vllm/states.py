"""State groups in the scheduler: which chunk ends have a state in kvd, what a hit loads and a step stores.

With prefix caching off a request holds one state block, rewritten every step; a hit of N
tokens loads the state after token N. ``store_item`` keeps a state only where a step ended
on a chunk end (fenced before the next step rewrites it). ``submit`` asks per candidate
chunk end (newest ``MAX_CANDIDATES``); ``combine`` picks the last end every group reaches
and the leases to keep. ``load_item``: the state into the group's block. Failure is a value
(0 or None). Nothing here imports vLLM.
"""

from __future__ import annotations

from kvd_client.registration import ChunkKeys

from .groups import NULL_BLOCK, KVGroup
from .plan import LoadItem, StoreItem

MAX_CANDIDATES = 16  # chunk ends a state lookup asks for: bounds the messages per request


def submit(client, groups: list[KVGroup], regs: list, keys: list[list[bytes]], usable: int,
           local_chunks: int, lease_ms: int) -> tuple[list, list[tuple[int, int | None]]]:
    """The lookups for the first ``usable`` chunks, and what each asks: ``(group, chunk)``,
    chunk None for an attention group's prefix, else the chunk whose end state it asks for."""
    lookups, asked = [], []
    for g, (group, reg) in enumerate(zip(groups, regs)):
        if not group.state:
            lookups.append(client.submit_lookup(ChunkKeys(keys[g][:usable]), lease_ms, reg=reg))
            asked.append((g, None))
            continue
        for i in range(usable - 1, max(local_chunks, usable - MAX_CANDIDATES) - 1, -1):
            lookups.append(client.submit_lookup(ChunkKeys([keys[g][i]]), lease_ms, reg=reg))
            asked.append((g, i))
    return lookups, asked


def combine(answers: list[tuple[int, int | None]], asked: list[tuple[int, int | None]],
            groups: list[KVGroup], chunk: int) -> tuple[int, list[int | None], list[int]]:
    """``(tokens of the hit, a lease per group, leases to release)`` from the lookups' answers
    (``(tokens, lease)`` each, in ``submit``'s order)."""
    prefix, present, leases = None, {}, [None] * len(groups)
    spare: list[int] = []
    for (found, lease), (g, i) in zip(answers, asked):
        if i is None:
            prefix = found if prefix is None else min(prefix, found)
            leases[g] = lease
        elif found:
            present.setdefault(g, {})[i] = lease
    state_groups = {g for g, group in enumerate(groups) if group.state}
    if not state_groups:
        return prefix or 0, leases, spare
    common = set.intersection(*(set(present.get(g, {})) for g in state_groups))
    best = max((i for i in common if (i + 1) * chunk <= (prefix or 0)), default=None)
    for g in state_groups:
        for i, lease in present.get(g, {}).items():
            if i == best:
                leases[g] = lease
            elif lease is not None:
                spare.append(lease)
    return (best + 1) * chunk if best is not None else 0, leases, spare


def load_item(req_id: str, keys: list[bytes], ids: list[int], hit_chunks: int, g: int,
              tokens: int) -> LoadItem | None:
    """The state after chunk ``hit_chunks`` into the request's state block (None: no block)."""
    if not ids or ids[0] == NULL_BLOCK or hit_chunks < 1:
        return None
    return LoadItem(req_id, [keys[hit_chunks - 1]], [ids[0]], 0, False, g, tokens)


def store_item(req_id: str, keys: list[bytes], ids: list[int], end: int, chunk: int,
               stored: int, after_forward: bool, tenant: str | None, g: int) -> StoreItem | None:
    """The state after ``end`` computed tokens (in the request's block once the step ran),
    when ``end`` is a chunk end past the last one stored (``stored`` chunks)."""
    if end < chunk or end % chunk or end // chunk <= stored or not ids or ids[0] == NULL_BLOCK:
        return None
    return StoreItem(req_id, [keys[end // chunk - 1]], [ids[0]], after_forward, tenant, g)
