"""KvdConnector that records the bytes of every state block (Mamba) it stores and loads.

For tests/vllm/engine.py (a spec with ``"state_digests": true``, in-process
engines): a SHA-256 over the block's bytes in every layer of its group, read
through vLLM's own tensors (the conv and SSM state of the block id), keyed
by the chunk key's hex. A store is digested when it is submitted (the step
that computed the state ran; the block is not rewritten before the store
ends: state groups are fenced), a load when it is done, before vLLM runs
the request on it. ``take()`` returns what was recorded since the last call.
Everything else is the real connector.
"""

from __future__ import annotations

import hashlib

from kvd_client.vllm.connector import KvdConnector

_RECORDED: dict = {"stored": {}, "loaded": {}}


def take() -> dict:
    out = {k: dict(v) for k, v in _RECORDED.items()}
    for v in _RECORDED.values():
        v.clear()
    return out


class StateDigestKvdConnector(KvdConnector):
    def register_kv_caches(self, kv_caches):
        self.state_tensors = {g: [kv_caches[n] for n in group.names]
                              for g, group in enumerate(self.groups) if group.state}
        super().register_kv_caches(kv_caches)

    def _digest(self, group: int, block: int) -> str:
        h = hashlib.sha256()
        for entry in self.state_tensors[group]:
            for t in entry if isinstance(entry, (list, tuple)) else [entry]:
                h.update(t[block].contiguous().cpu().numpy().tobytes())
        return h.hexdigest()

    def _record_stores(self, after_forward: bool) -> None:
        for item in self._get_connector_metadata().plan.stores:
            if item.group in self.state_tensors and item.after_forward == after_forward:
                _RECORDED["stored"][item.keys[0].hex()] = self._digest(item.group, item.pages[0])

    def start_load_kv(self, forward_context, **kwargs):
        self._record_stores(False)
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self):
        self._record_stores(True)
        super().wait_for_save()

    def get_finished(self, finished_req_ids):
        pending = {req: list(loads) for req, loads in self.worker.async_loads.items()}
        sending, recving = super().get_finished(finished_req_ids)
        for req in recving or ():  # vLLM runs these on their blocks only after this call
            for item, t in pending.get(req, ()):
                if item.group in self.state_tensors and t.ok:
                    _RECORDED["loaded"][item.keys[0].hex()] = self._digest(item.group,
                                                                          item.pages[0])
        return sending, recving
