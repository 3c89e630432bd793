"""kvd_client.vllm: vLLM's KV connector on kvd (``KvdConnector``).

Every vLLM-specific line of kvd lives here, so a vLLM upgrade touches one folder:
``connector`` (imports vLLM), ``scheduler``/``worker`` (the two halves), ``plan``,
``support`` (refusals), ``access``, ``layers``, ``groups``, ``states``, ``spec``/``geometry``,
``pool``/``shm_alloc``, ``settings``, ``counters``/``stats``. Versions tested and the
launch flag: docs/vllm.md. Imports ``kvd_client`` and ``kvd_protocol`` only; importing it
does not import vLLM (``KvdConnector`` loads on first access).
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
