"""What vLLM carries between the connector's instances: plans, reports, the handshake.

The scheduler instance hands each step's plan to the workers (``KvdConnectorMetadata``),
the workers report back (``KvdWorkerMetadata``, merged across ranks), and each worker
tells the scheduler once what its tensors fix (``KvdHandshake``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .plan import StepPlan, WorkerReport


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvdWorkerMetadata(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        self.report.merge(other.report)
        return self


@dataclass
class KvdHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once, at start-up: its fp8 KV scales' digest and
    the order inside its GPU blocks kept whole (what its tensors have)."""

    kv_scales: str = ""
    interior: str = ""
