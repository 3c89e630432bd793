"""What the scheduler tells the workers each step, and what they tell it back.

Plain, picklable data: keys computed once by the scheduler, 16-byte strings with the block
ids (``blocks_per_chunk`` per key) and the item's KV cache ``group``.
``LoadItem``: ``keys`` into ``pages`` (``pages[:scratch]`` are throw-away writes, sent to
vLLM's null block; ``layerwise``: inside the step; ``tail``: only the last chunk's first
``tail`` blocks; ``part``: one partial entry of that many tokens). ``StoreItem``: ``pages``
out under ``keys`` (``after_forward``: at ``wait_for_save``; ``tenant``; ``part``).
``StepPlan.namespace`` joins the groups' digests. ``WorkerReport``: keys whose load failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadItem:
    req_id: str
    keys: list[bytes]
    pages: list[int]
    scratch: int = 0
    layerwise: bool = True
    group: int = 0
    tokens: int = 0         # tokens of the hit it serves (a sliding window loads fewer)
    tail: int = 0           # blocks of the last chunk to load (0: all of it)
    part: int = 0           # tokens of the one partial entry it loads (keys: its partial key)

    def complete(self, loaded_tokens: int, chunk: int, block_size: int) -> bool:
        """Whether a load that brought ``loaded_tokens`` (scratch pages counted) brought it all."""
        if self.part:
            return loaded_tokens >= self.part
        short = chunk - self.tail * block_size if self.tail else 0
        return loaded_tokens >= len(self.keys) * chunk - short

    def real_pages(self, from_chunk: int, blocks_per_chunk: int) -> set[int]:
        """The request's own blocks from chunk ``from_chunk`` of this load on."""
        return set(self.pages[max(from_chunk * blocks_per_chunk, self.scratch):])


@dataclass
class StoreItem:
    req_id: str
    keys: list[bytes]
    pages: list[int]
    after_forward: bool = True
    tenant: str | None = None
    group: int = 0
    part: int = 0           # tokens of the one partial entry it stores (keys: its partial key)


@dataclass
class StepPlan:
    namespace: bytes = b""                      # the scheduler's namespace digests, joined
    loads: list[LoadItem] = field(default_factory=list)
    stores: list[StoreItem] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class WorkerReport:
    failed_keys: set[bytes] = field(default_factory=set)

    def merge(self, other: WorkerReport) -> WorkerReport:
        self.failed_keys |= other.failed_keys
        return self
