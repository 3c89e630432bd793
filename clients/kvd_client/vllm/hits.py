"""How far a kvd hit may reach into a request: at vLLM's block granularity, not kvd's chunk's.

kvd keys whole chunks, but a load may end inside its last chunk at a block
boundary (``tail_pages``, docs/protocol.md §5.7): it then copies that chunk's
first blocks only. So a hit ends on a block, as vLLM's own prefix cache and its
native offloading do, and vLLM's rule that at least one token of a request is
computed costs at most one block instead of one chunk. State groups (Mamba,
kvd_client.vllm.states) keep chunk ends: a state exists only where a step
ended on one.

- ``top(num_tokens, chunk, block, partial)``: the most tokens a hit may cover
  (below ``num_tokens``, on a block; on a chunk unless ``partial``).
- ``chunks(top, num_tokens, chunk)``: the chunks a lookup asks for to cover it
  (those with a key: whole chunks of the request's tokens).
- ``layerwise_end(num_tokens, min_compute, granule)``: where a layer-wise hit
  must end so that ``min_compute`` tokens are left (its step is then no pure
  decode step, which vLLM may run as a full CUDA graph that skips the layer waits).
- ``tail(hit, chunk, block)``: the blocks of the hit's last chunk to load (0: it
  ends on a chunk).

Pure arithmetic on ints; nothing here imports vLLM.
"""

from __future__ import annotations


def top(num_tokens: int, chunk: int, block: int, partial: bool) -> int:
    granule = block if partial else chunk
    return max(0, num_tokens - 1) // granule * granule


def chunks(top_tokens: int, num_tokens: int, chunk: int) -> int:
    return min(-(-top_tokens // chunk), num_tokens // chunk)


def layerwise_end(num_tokens: int, min_compute: int, granule: int) -> int:
    return max(0, num_tokens - min_compute) // granule * granule


def tail(hit: int, chunk: int, block: int) -> int:
    return hit % chunk // block
