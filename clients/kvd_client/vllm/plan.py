"""What the scheduler tells the workers each step, and what they tell it back.

Plain, picklable data (vLLM ships the step's metadata to worker processes):
chunk keys are computed once, by the scheduler, with the same namespace the
workers register, and travel as 16-byte strings with the block ids they go
to or come from. A page list holds ``blocks_per_chunk`` block ids per key.
``group`` is the item's KV cache group (its index in the connector's list,
kvd_client.vllm.groups): each group has its own namespace and block ids.
``StepPlan.namespace`` joins the groups' namespace digests.

- ``LoadItem``: copy ``keys`` into ``pages``. ``pages[:scratch]`` are writes
  to throw away: the first chunk of a load that starts inside a local
  prefix-cache hit covers blocks vLLM already holds (and shares with other
  requests), so those pages point at vLLM's null block, which no request
  reads (kvd_client.vllm.groups). ``layerwise``: a sync load
  inside the step (the forward waits per layer); otherwise asynchronous,
  between steps. ``tail``: a hit that ends inside its last chunk, at a block
  boundary, loads only that chunk's first ``tail`` blocks (``pages`` then
  holds ``tail`` ids for it; 0: the whole chunk). ``part``: the load (or
  store) of one partial entry of that many tokens (kvd_client.vllm.tails).
- ``StoreItem``: copy ``pages`` out under ``keys``; ``after_forward``: the
  step's forward writes that KV (submitted at ``wait_for_save``), else it
  is final already (submitted at ``start_load_kv``); ``tenant``: the label
  the daemon's quotas count the chunks under (the request's salt name).
- ``WorkerReport``: keys whose load failed, so the scheduler stops offering
  them for a while (re-offering a failed hit loops: vLLM asks again).
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
