"""``KvdConnector``: vLLM's ``KVConnectorBase_V1`` on kvd (vLLM 0.34, 0.32 and 0.26's APIs).

Translates vLLM's calls only: the SCHEDULER instance plans (kvd_client.vllm.scheduler), each
WORKER moves KV (kvd_client.vllm.worker). Both first ask kvd_client.vllm.support and raise
its one-line reason before vLLM allocates anything. fp8 scales and GPU block order reach the
scheduler through vLLM's connector handshake. ``SupportsHMA``: each KV cache group is its own
namespace (kvd_client.vllm.groups). Sets ``kv_load_failure_policy`` to ``recompute``: a kvd
failure costs a recompute, never a request. CPU engines get their KV cache in a /dev/shm
file kvd maps (``get_mem_pool_context``); GPU engines are registered by CUDA IPC or file
descriptor. Counters go out as vLLM connector stats.
"""

from __future__ import annotations

import logging
import os

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvd_client import shm
from kvd_client.client import KvdClient
from kvd_protocol.errors import KvdError
from kvd_protocol.layout import TensorRef

from . import access, layers, spec, support
from .compat import HIT_SOURCE, CacheHitSource, KVConnectorTransferResults, SupportsHMA
from .counters import Counters
from .groups import kv_groups
from .messages import KvdConnectorMetadata, KvdHandshake, KvdWorkerMetadata
from .plan import StepPlan
from .pool import cuda_pool, host_pool, state_block
from .scheduler import SchedulerSide
from .settings import Settings
from .stats import KvdConnectorStats, KvdPromMetrics
from .worker import WorkerSide

log = logging.getLogger("vllm.kvd")  # under vLLM's logger: its format and level
LOAD_SLOTS = 256  # the most a flag page has: async loads in flight at once
DEFAULT_CHUNK_TOKENS = 256  # the daemon's default chunk_tokens



class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    if HIT_SOURCE is not None:
        _cache_hit_source = HIT_SOURCE  # vLLM's metrics label kvd's hits as host-tier hits

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvd's connector needs vLLM's KVCacheConfig (vLLM >= 0.26)")
        reason = support.refusal(vllm_config, kv_cache_config, os.environ)
        if reason:  # before any allocation or connection: one line naming the setting
            raise ValueError(reason)
        cfg = self._kv_transfer_config
        self.settings = Settings.from_extra(cfg.kv_connector_extra_config)
        self.counters = Counters()
        self.source = f"{role.name.lower()}:{os.getpid()}"  # whose running totals (stats.py)
        self.client = KvdClient(runtime_dir=self.settings.runtime_dir or None,
                                timeout=self.settings.timeout_s, load_slots=LOAD_SLOTS,
                                name=f"vllm-{role.name.lower()}:{os.getpid()}",
                                shm_dir=self.settings.shm_dir).connect()
        self.sched = self.worker = self.alloc = self.geometry = self.kv_caches = None
        self.kv_scales, self._told_unattached, self.closed = "", False, False
        self.groups, self.geometries = kv_groups(vllm_config, kv_cache_config), []
        if len(self.groups) > 1 and KVConnectorTransferResults is None:
            raise ValueError("kvd: several KV cache groups need vLLM's per-request load failures "
                             "(vLLM 0.32); run vLLM with --disable-hybrid-kv-cache-manager")
        names = spec.all_target_layers(vllm_config, kv_cache_config)
        scaled = spec.needs_scales(vllm_config, kv_cache_config)
        blocks = spec.gpu_blocks(vllm_config, kv_cache_config, self.settings.gpu_block_format)
        if role == KVConnectorRole.SCHEDULER:
            cfg.kv_load_failure_policy = self.settings.load_failure_policy
            if not scaled and not blocks:
                self._attach()  # else once the workers' handshake brought scales and order
        else:
            self.kv_scales = layers.kv_scales(vllm_config, names) if scaled else ""
            self._geometries()
            fenced = frozenset(g for g, group in enumerate(self.groups)  # blocks vLLM rewrites
                               if group.window or group.state)
            self.worker = WorkerSide(self.client, self.geometries,
                                     [list(g.names) for g in self.groups], _tp_rank(),
                                     self.counters, fenced)
            self._log_namespace()

    def _geometries(self, interior: str = "") -> None:
        """Each group's namespace; ``geometry``: the first group's."""
        chunk = self._chunk_tokens() if any(g.state for g in self.groups) else 0
        self.geometries = [spec.geometry(self._vllm_config, self._kv_cache_config,
                                         self.settings.model_id, self.kv_scales,
                                         self.settings.gpu_block_format, interior, group, chunk)
                           for group in self.groups]
        self.geometry = self.geometries[0]

    def _chunk_tokens(self) -> int:
        """The daemon's chunk size (a state group's page), or its default while it is away:
        a state pool then registers only with a daemon of that chunk size (the log says)."""
        try:
            return self.client.chunk_tokens
        except KvdError as exc:
            log.warning("kvd: no daemon to ask its chunk_tokens (%s); state groups assume %d",
                        exc, DEFAULT_CHUNK_TOKENS)
            return DEFAULT_CHUNK_TOKENS

    def _attach(self, kv_scales: str = "", interior: str = "") -> None:
        vllm_config, cfg = self._vllm_config, self._kv_transfer_config
        self.kv_scales = kv_scales
        self._geometries(interior)
        regs = [self.client.attach(**g.attach_fields()) for g in self.geometries]
        stores = cfg.is_kv_producer and self.settings.store_policy != "off"
        self.sched = SchedulerSide(self.client, regs, self.settings, self.geometry.block_size,
                                   loads=cfg.is_kv_consumer, stores=stores, counters=self.counters,
                                   layerwise_min_compute=2 + _speculative_tokens(vllm_config),
                                   layerwise=not _prefills_in_full_graphs(vllm_config),
                                   groups=self.groups)
        self._log_namespace()

    def _log_namespace(self) -> None:
        for g in self.geometries:
            log.info("kvd connector (%s): namespace %s, runtime dir %s", self.role.name,
                     g.attach_fields(), self.client.runtime_dir)

    def get_handshake_metadata(self):
        """Worker: the fp8 scales' digest and the order inside whole GPU blocks, for the
        scheduler's namespace (None: neither applies)."""
        gpu = self._vllm_config.device_config.device_type != "cpu"
        interior = self.geometry.interior if gpu and self.geometry.attention == "opaque" else ""
        return KvdHandshake(self.kv_scales, interior) if self.kv_scales or interior else None

    def set_xfer_handshake_metadata(self, metadata) -> None:
        """Scheduler: every worker's handshake (vLLM's engine core, once, after the workers
        registered their KV caches): the namespace is attached now, with their facts."""
        facts = {(m.kv_scales, m.interior) for m in (metadata or {}).values()
                 if isinstance(m, KvdHandshake)}
        if self.sched is not None or not facts:
            return
        if len(facts) > 1:
            raise ValueError(f"kvd: the workers' fp8 KV scales or block layouts differ "
                             f"({', '.join(map(str, sorted(facts)))}); every TP rank must load "
                             "the same checkpoint scales and lay out its blocks alike")
        self._attach(*facts.pop())

    def _attached(self) -> bool:
        if self.sched is None and not self._told_unattached:
            self._told_unattached = True  # vLLM never sent the workers' handshake: kvd stays off
            log.error("kvd: the workers' handshake (fp8 KV scales, block layout) never came; "
                      "no lookups, loads or stores")
        return self.sched is not None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that never happened is a later miss

    # vLLM 0.34's hooks (kvd_client.vllm.access); supports_lookahead_block_hashes,
    # get_finished_count, supports_divergent_local_hybrid_hits: vLLM's defaults on purpose
    # (kvd hashes its own keys, every worker reports, state groups load whole)
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        return access.kv_cache_access(kv_transfer_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return True  # the KV memory is lent out through unregister / restore_kv_caches

    def may_load_async(self, request) -> bool:
        return access.may_load_async(self.settings, request, self._kv_transfer_config.is_kv_consumer)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        st = self.sched.reqs.get(request.request_id) if self.sched is not None else None
        split = access.hit_sources(st, num_external_tokens, self.sched.chunk if st else 1)
        return {CacheHitSource(name): n for name, n in split.items()}

    def unregister_kv_caches(self) -> None:  # the KV memory is lent out: drain, drop (chunks stay)
        if self.worker is not None and self.worker.regs:
            self.worker.release(self.settings.timeout_s)

    def restore_kv_caches(self) -> None:  # it is back (fresh pages, same addresses): register
        if self.worker is not None and not self.worker.regs and self.kv_caches is not None:
            self.register_kv_caches(self.kv_caches)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """False: layer-wise loads (stream waits per layer) only run in steps vLLM does not
        replay as full CUDA graphs (kvd_client.vllm.scheduler), so decode keeps its graphs."""
        return False

    # ==== worker side ==================================================================

    def get_mem_pool_context(self):
        if self._vllm_config.device_config.device_type != "cpu":
            return None  # CUDA: the default allocator's memory exports through CUDA IPC
        from .shm_alloc import ShmKVAllocation

        sizes = {t.size for t in self._kv_cache_config.kv_cache_tensors}
        if len(sizes) != 1:
            raise ValueError(f"kvd: vLLM announced KV allocations of sizes {sorted(sizes)}; "
                             "one backing allocation was expected")
        self.alloc = ShmKVAllocation(sizes.pop(), self.settings.shm_dir,
                                     shm.shared_group(self.client.runtime_dir))
        return self.alloc

    def register_kv_caches(self, kv_caches):
        """One kvd pool per KV cache group: the group's layers (with several groups their
        tensors share memory, each group's blocks being its own)."""
        self.kv_caches = kv_caches  # restore_kv_caches registers them again
        per_group = [[state_block(kv_caches[n]) if g.state else kv_caches[n] for n in g.names]
                     for g in self.groups]
        blocks = self._kv_cache_config.num_blocks
        if self._vllm_config.device_config.device_type == "cpu":
            if self.alloc is None or self.alloc.tensor is None:
                raise ValueError("kvd: on CPU, vLLM must allocate its KV cache inside the "
                                 "connector's get_mem_pool_context (vLLM 0.32 does)")
            pools = [host_pool(geo, tensors, str(self.alloc.path), self.alloc.base,
                               self.alloc.size, blocks)
                     for geo, tensors in zip(self.geometries, per_group)]
        else:
            self._follow_tensors(per_group[0][0])
            pools = [cuda_pool(geo, tensors, blocks)
                     for geo, tensors in zip(self.geometries, per_group)]
        self.worker.register(pools)

    def _follow_tensors(self, t) -> None:
        """Whole GPU blocks: the namespace names the order the tensors have (an attention
        backend may set it in this process only); the handshake tells the scheduler."""
        if self.geometry.attention != "opaque":
            return
        ref = TensorRef(0, 0, tuple(t.shape), tuple(t.stride()), 1)
        interior = spec.tensor_interior(ref) if len(ref.shape) == 4 else self.geometry.interior
        if interior != self.geometry.interior:
            self._geometries(interior)
            self.worker.geos = list(self.geometries)
            self._log_namespace()

    def handle_preemptions(self, kv_connector_metadata):
        self.worker.preempted(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.start(self._get_connector_metadata().plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """kvd stores every layer of a chunk in one request, after the forward
        (``wait_for_save``); on a GPU the store is ordered after the forward's
        kernels on the engine's stream, so nothing waits here."""

    def wait_for_save(self):
        self.worker.after_forward(self._get_connector_metadata().plan)

    def get_finished(self, finished_req_ids):
        return self.worker.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids):
        """vLLM 0.32: ``get_finished`` plus the requests whose async load failed (several
        KV cache groups: vLLM recomputes them whole; one group reports blocks instead)."""
        sending, recving = self.get_finished(finished_req_ids)  # what a subclass adds, too
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self):
        report = self.worker.report()
        return None if report is None else KvdWorkerMetadata(report)

    # ==== scheduler side ===============================================================

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.sched.matched(request, num_computed_tokens) if self._attached() else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._attached():
            self.sched.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        plan = self.sched.step(scheduler_output) if self._attached() else StepPlan()
        return KvdConnectorMetadata(plan)

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._attached():
            self.sched.update(connector_output.finished_recving,
                              meta.report if isinstance(meta, KvdWorkerMetadata) else None)

    def request_finished(self, request, block_ids):
        return (self._attached() and self.sched.finished(request, (list(block_ids),))), None

    def request_finished_all_groups(self, request, block_ids):
        """vLLM's hybrid manager: the request's block ids per KV cache group."""
        return (self._attached() and self.sched.finished(request, tuple(block_ids))), None

    # ==== both ========================================================================

    def get_kv_connector_stats(self):
        data = self.counters.totals(self.source)
        return KvdConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self.closed:
            return
        self.closed = True
        if self.alloc is not None:
            # the pool file's name first (the daemon's mapping and vLLM's outlive it): a process
            # killed later leaves no file, one killed sooner never said bye and the daemon,
            # losing it, removes its files (vLLM kills its processes at shutdown)
            self.alloc.close()
        if self.worker is not None:
            self.worker.close(self.settings.timeout_s)  # closes the client too
        else:
            if self.sched is not None:
                self.sched.close()
            self.client.close()


def _speculative_tokens(vllm_config) -> int:
    spec_cfg = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0) if spec_cfg is not None else 0


def _prefills_in_full_graphs(vllm_config) -> bool:
    """Whether vLLM replays mixed prefill batches as full CUDA graphs (``cudagraph_mode``
    FULL): a replay would skip per-layer waits, so every load then runs between steps."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    if mixed is None or getattr(mixed(), "name", "") != "FULL":
        return False
    log.info("kvd: cudagraph_mode %s runs prefills as full CUDA graphs; kvd loads run between "
             "steps", mode.name)
    return True


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
