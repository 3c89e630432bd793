"""Caps on every count and size a client sends: what real engines use, with room to spare.

The namespace (kvd_protocol.keys), the layout descriptor
(kvd_protocol.layout) and the wire validation (kvd_protocol.wire) refuse
values beyond these with ``ValueError`` / ``BadRequest`` (keys per request
beyond the daemon's ``max_keys_per_request``: ``TooLarge``), so no request
makes the daemon build huge integers or loop over huge counts. The host
tier keeps one bit per TP shard in an int, so ``MAX_TP_SIZE`` also bounds
those masks at 64 bits. docs/protocol.md §10 lists them.
"""

from __future__ import annotations

MAX_TP_SIZE = 64          # largest tensor-parallel group (8 nodes of 8 GPUs)
MAX_LAYERS = 1024         # DeepSeek-V3 has 61, Llama-3-405B 126
MAX_KV_HEADS = 256        # KV heads of one TP shard (MHA without GQA: 64-128)
MAX_HEAD_DIM = 1024       # elements per head (MLA latent: 576)
MAX_CHUNK_TOKENS = 8192   # tokens per chunk (the chunk_tokens knob; usual: 256)
MAX_PAGES = 2**32         # pages of one registered pool (SGLang token pools: page = 1 token)
MAX_BYTES = 2**48         # any byte size, offset or stride (256 TiB)
MAX_FDS = 4096           # file descriptors one registration passes (virtual-memory pieces)
MAX_EVENTS = 256          # CUDA IPC event handles of one registration
MAX_NAME_BYTES = 512      # model and fingerprint strings, UTF-8
MAX_TENANT_CHARS = 64     # a store's tenant label (quota accounting), printable characters
