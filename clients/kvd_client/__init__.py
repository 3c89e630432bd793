"""kvd_client: the thin engine-side library for the kvd KV-cache daemon.

    import kvd_client
    client = kvd_client.connect()
    pool = kvd_client.SharedKVPool("vllm_flash_attn", num_layers=32, num_pages=1024,
                                   page_size=16, kv_heads=8, head_dim=128, dtype="bfloat16")
    client.register_kv(pool, model="meta-llama/Llama-3-8B")
    cached = client.lookup(tokens)          # tokens of the longest cached prefix
    client.load(tokens[:cached], page_ids)  # copy them into your pages
    client.store(tokens, page_ids)          # offload whole chunks

    t = client.submit_load(tokens, page_ids)  # pipelined: returns at once
    for done in client.poll(): ...            # transfers that ended (ok or failed) and are fenced
"""

from kvd_protocol.errors import (
                                 Busy,
                                 Cancelled,
                                 DaemonUnavailable,
                                 KvdError,
                                 NoSpace,
                                 OverQuota,
                                 ServerError,
                                 Timeout,
                                 TransportError,
)

from .client import KvdClient, KVRegistration, connect
from .lookup import Lookup
from .pool import SharedKVPool
from .registration import ChunkKeys
from .retry import Retry
from .transfer import Transfer

__all__ = ["KvdClient", "KVRegistration", "SharedKVPool", "ChunkKeys", "Transfer", "Lookup", "Retry",
           "connect",
           "KvdError", "TransportError", "DaemonUnavailable", "Timeout", "ServerError", "NoSpace",
           "OverQuota", "Busy", "Cancelled"]
