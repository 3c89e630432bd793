"""KvdConnector whose worker freezes the daemon (SIGSTOP) just before its next loads.

For tests/vllm/engine.py: the runner sets ``freeze_pid`` on the in-process
worker connector between phases. The loads then wait out their deadline and
fail, as they would against a hung daemon; once none is in flight the
daemon is thawed (SIGCONT) and serves on. While a freeze is armed the
scheduler half waits up to ``ARMED_LOOKUP_WAIT_S`` for lookup replies, so
every prompt of the phase gets its answer (and its load) in the same step
and all of them meet the frozen daemon; a lookup still unanswered at the
freeze would turn into a miss instead. Everything else is the real
connector.
"""

from __future__ import annotations

import os
import signal

from kvd_client.vllm.connector import KvdConnector


ARMED_LOOKUP_WAIT_S = 5.0


class FaultyKvdConnector(KvdConnector):
    freeze_pid = None
    frozen = None
    armed = False  # class-wide: the runner arms the worker, the scheduler half reads it

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if FaultyKvdConnector.armed:
            self.sched.wait_left = max(self.sched.wait_left, ARMED_LOOKUP_WAIT_S)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def start_load_kv(self, forward_context, **kwargs):
        if self.freeze_pid and self._get_connector_metadata().plan.loads:
            os.kill(self.freeze_pid, signal.SIGSTOP)
            self.frozen, self.freeze_pid = self.freeze_pid, None
            FaultyKvdConnector.armed = False
        super().start_load_kv(forward_context, **kwargs)

    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        if self.frozen and not self.worker.sync and not self.worker.async_loads:
            os.kill(self.frozen, signal.SIGCONT)  # its loads ended (failed): thaw
            self.frozen = None
        return out
