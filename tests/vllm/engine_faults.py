"""KvdConnector whose worker freezes the daemon (SIGSTOP) just before its next loads.

For tests/vllm/engine.py: the runner sets ``freeze_pid`` on the in-process
worker connector between phases. The loads then wait out their deadline and
fail, as they would against a hung daemon; once none is in flight the
daemon is thawed (SIGCONT) and serves on. Everything else is the real
connector.
"""

from __future__ import annotations

import os
import signal

from kvd_client.vllm.connector import KvdConnector


class FaultyKvdConnector(KvdConnector):
    freeze_pid = None
    frozen = None

    def start_load_kv(self, forward_context, **kwargs):
        if self.freeze_pid and self._get_connector_metadata().plan.loads:
            os.kill(self.freeze_pid, signal.SIGSTOP)
            self.frozen, self.freeze_pid = self.freeze_pid, None
        super().start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        if self.frozen and not self.worker.sync and not self.worker.async_loads:
            os.kill(self.frozen, signal.SIGCONT)  # its loads ended (failed): thaw
            self.frozen = None
        return out
