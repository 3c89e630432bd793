"""The connector's counters the way vLLM exposes connector stats.

``KvdConnectorStats`` is vLLM's ``KVConnectorStats``: a dict of counter
deltas (kvd_client.vllm.counters) that vLLM collects from the workers and
the scheduler every step, sums (``aggregate``), logs as "KV Transfer
metrics: ..." with the engine's stats log, and hands to
``KvdPromMetrics.observe``, which adds them to Prometheus counters named
``vllm:kvd_<counter>_total`` (labelled per engine like vLLM's own metrics;
``LLM.get_metrics()`` lists them when stats are on).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .counters import HELP


@dataclass
class KvdConnectorStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvdPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, text in HELP.items():
            metric = self._counter_cls(name=f"vllm:kvd_{name}", documentation=f"kvd connector: {text}",
                                       labelnames=labelnames)
            self.counters[name] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for name, n in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and engine_idx in per_engine and n > 0:
                per_engine[engine_idx].inc(n)
