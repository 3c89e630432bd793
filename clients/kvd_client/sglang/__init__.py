"""kvd_client.sglang: kvd as the storage tier (L3) of SGLang's hierarchical cache (HiCache).

Written against SGLang 0.5.23 and 0.5.16. Owns ``backend`` (the ``HiCacheStorage``),
``options`` (the ``kvd_*`` extra-config keys), ``host_pages``, ``staging``, ``shared_host``
(SGLang's host pool as kvd sees it), ``chain``, ``hashing``, ``keyring`` (page hashes to kvd
keys), ``timeline`` (``KVD_SGLANG_TRACE``) and, SGLang >= 0.5.23 only, ``linker``
(``KvdLinker``: SGLang's GPU pool by CUDA IPC, ``device_pages``, ``layer_wait``).
``options``, ``chain``, ``timeline`` and ``layer_wait`` need neither SGLang nor torch.
Nothing here is imported by ``import kvd_client``. Launch flags: docs/sglang.md.
"""
