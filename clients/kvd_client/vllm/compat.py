"""vLLM's connector API across versions: the pieces older vLLMs lack, and stand-ins.

``CacheHitSource`` and ``HIT_SOURCE`` (the label of kvd's hits): vLLM 0.34, else None.
``SupportsHMA`` and ``KVConnectorTransferResults`` (vLLM 0.32): several KV cache groups
and failures per request; on vLLM 0.26 a stand-in base vLLM does not recognise, and None.
"""

from __future__ import annotations

try:  # hits labelled by tier (get_external_cache_hit_sources: vLLM 0.34)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HIT_SOURCE = CacheHitSource.HOST
except ImportError:  # vLLM 0.26 does not label hits
    CacheHitSource = HIT_SOURCE = None

try:  # vLLM 0.32: several KV cache groups (the hybrid manager), failures per request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError:  # vLLM 0.26: one group (vLLM turns its hybrid manager off)
    KVConnectorTransferResults = None

    class SupportsHMA:  # noqa: D101 - a stand-in base that vLLM does not recognise
        pass
