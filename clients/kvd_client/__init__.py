"""kvd_client: the thin engine-side library for the kvd KV-cache daemon.

    client = kvd_client.connect()
    client.register_kv(pool, model="meta-llama/Llama-3-8B")  # a SharedKVPool or CudaKVPool
    cached = client.lookup(tokens)          # tokens of the longest cached prefix
    client.load(tokens[:cached], page_ids)  # copy them into your pages
    client.store(tokens, page_ids)          # offload whole chunks
    t = client.submit_load(tokens, page_ids); done = client.poll()  # pipelined

Imports kvd_protocol only, never the daemon. Engine adapters live in kvd_client.vllm and
kvd_client.sglang (imported only on request).
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
