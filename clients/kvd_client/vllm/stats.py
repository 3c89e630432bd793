"""The connector's counters the way vLLM exposes connector stats.

``KvdConnectorStats`` (vLLM's ``KVConnectorStats``) maps ``"<source>/<counter>"`` to running
totals per source (scheduler or a worker); ``aggregate`` keeps the larger total, so merging
twice counts nothing twice; ``reduce()`` sums over sources. ``KvdPromMetrics.observe`` adds
each total's growth to ``vllm:kvd_<counter>_total``, so a dropped step counts with the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .counters import HELP


def _counter(key: str) -> str:
    return key.rpartition("/")[2]


@dataclass
class KvdConnectorStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, total in other.data.items():
            self.data[key] = max(self.data.get(key, 0), total)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int] = {}
        for key, total in self.data.items():
            out[_counter(key)] = out.get(_counter(key), 0) + total
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvdPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        self.seen: dict[tuple[int, str], int] = {}  # (engine, source/counter) -> total counted
        for name, text in HELP.items():
            metric = self._counter_cls(name=f"vllm:kvd_{name}", documentation=f"kvd connector: {text}",
                                       labelnames=labelnames)
            self.counters[name] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, total in transfer_stats_data.items():
            per_engine = self.counters.get(_counter(key))
            if per_engine is None or engine_idx not in per_engine:
                continue
            grown = total - self.seen.get((engine_idx, key), 0)
            if grown > 0:
                self.seen[(engine_idx, key)] = total
                per_engine[engine_idx].inc(grown)
