"""What the scheduler keeps per request (kvd_client.vllm.scheduler owns every change).

Per KV cache group: the chunk keys (computed once, extended as tokens arrive),
the block ids vLLM gave, the lease of the last lookup answer and the chunks known
to be in kvd; per request: the lookups in flight, what they found, the hit
offered (vLLM's own prefix-cache hit plus kvd's), the loads planned for the next
step and whether stores or an async load are in flight. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd_client.lookup import Lookup

from .plan import LoadItem


@dataclass
class ReqState:
    request: object
    salt: str | None
    tenant: str | None = None  # the stores' label for the daemon's quotas
    keys: list[list[bytes]] = field(default_factory=list)     # per group
    blocks: list[list[int]] = field(default_factory=list)     # per group
    leases: list[int | None] = field(default_factory=list)   # per group, of the last answer
    lookups: list[Lookup] | None = None  # in flight, or answered and not yet read
    questions: list = field(default_factory=list)  # per lookup: (group, chunk) (kvd_client.vllm.states)
    asked: int = 0          # chunks the last lookup asked for
    found: int = 0          # tokens it found
    tiers: tuple = (0, 0)   # of its prefix's chunks: on kvd's disk tier, on the remote tier
    found_at: float | None = None  # when it was answered (None: no answer to reuse)
    local: int = 0          # vLLM's own prefix-cache hit, tokens
    hit: int = 0            # local + what kvd adds, tokens
    served: int = 0         # the most tokens not computed at an admission (local, or a load)
    tail: object = None     # kvd_client.vllm.tails.Tail: the partial lookup where the hit stops
    asynchronous: bool = False
    loads: list[LoadItem] = field(default_factory=list)  # per group, for the next step
    loading: bool = False   # an async load was sent and has not been reported
    stored: list[int] = field(default_factory=list)  # per group: chunks known to be in kvd
    stores_sent: bool = False
    cacheable: bool = True  # token ids say it all (no images, no prompt embeddings)
