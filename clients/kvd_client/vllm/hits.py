"""How far a kvd hit may reach into a request: at vLLM's block granularity, not kvd's chunk's.

A load may end inside its last chunk at a block boundary (``tail_pages``, protocol §5.7),
so a hit ends on a block, as vLLM's own prefix cache does: vLLM's rule that one token is
computed costs one block, not one chunk. State groups (kvd_client.vllm.states) keep chunk
ends. ``top``: the most tokens a hit may cover; ``chunks``: the chunks a lookup asks for;
``layerwise_end``: where a layer-wise hit must end to leave ``min_compute`` tokens (no
pure-decode step, which vLLM may run as a full CUDA graph skipping the layer waits);
``tail``: the blocks of the hit's last chunk to load (0: it ends on a chunk). Pure
arithmetic on ints; nothing here imports vLLM.
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
