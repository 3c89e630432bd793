"""kvd_client.sglang: kvd as the storage tier (L3) of SGLang's hierarchical cache (HiCache).

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvd",
            "module_path": "kvd_client.sglang.backend", "class_name": "KvdHiCacheStorage",
            "interface_v1": 1, "kvd_runtime_dir": "/run/kvd"}'

Written against SGLang 0.5.23 and 0.5.16 (their ``HiCacheStorage`` interface
and host pool classes). Modules: ``backend`` (the ``HiCacheStorage``), ``options``
(the ``kvd_*`` keys of the extra config), ``host_pages`` (SGLang's host pool
layouts, one page at a time), ``staging`` (the /dev/shm pool kvd copies
through), ``shared_host`` (SGLang's host pool moved into a file kvd maps),
``chain``, ``hashing`` and ``keyring`` (SGLang page hashes to kvd keys),
``timeline`` (per-call timings, ``KVD_SGLANG_TRACE``). SGLang ≥ 0.5.23 only:
``linker`` (``KvdLinker``, the unified cache's ``UnifiedCacheLinker``: SGLang's
GPU pool registered by CUDA IPC, ``device_pages``, and loaded layer by layer,
``layer_wait``). ``options``, ``chain``, ``timeline`` and ``layer_wait`` need
neither SGLang nor torch; the others import one or both. Nothing here is
imported by ``import kvd_client``. See docs/sglang.md.
"""
