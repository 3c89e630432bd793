"""KvdHiCacheStorage: kvd as SGLang's HiCache storage tier (``HiCacheStorage``, 0.5.16 and 0.5.23).

One instance per scheduler process (TP/PP rank), configured by the ``kvd_*`` extra config
keys (kvd_client.sglang.options); registers the rank's staging pool (or, with ``host_pool``
'shared', SGLang's host pool itself: kvd_client.sglang.shared_host) once the daemon answers.
``batch_exists`` (one lookup), ``batch_get_v1``/``batch_set_v1`` (per-page prefix results,
pipelined copies) and the generic ``get``/``set`` family. Keys: from token ids
(``key_mode`` 'tokens', same as any kvd client) or SGLang's page hash ('hashes').
Promises: failures are misses, never errors into SGLang; the client reconnects by itself.
A configuration kvd cannot serve is a ``ValueError`` at attach (or one logged error, then
misses). Version differences: docs/sglang.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvd_protocol.errors import KvdError
from kvd_protocol.wire import tenant_label

from .. import shm
from ..client import KvdClient
from ..registration import ChunkKeys
from .host_pages import HostPages
from .keyring import Keyring
from .options import Options
from .shared_host import SharedHostPool
from .staging import StagingPool
from .timeline import Timeline

log = logging.getLogger("kvd_client.sglang")
RETRY_S = 1.0  # how often a backend without a daemon tries again


class KvdHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config, kwargs=None):
        self.config = storage_config
        self.options = opts = Options.from_extra_config(storage_config.extra_config)
        opts.apply_process_settings()
        self.model = opts.model_id or storage_config.model_name or ""
        if not self.model:
            raise ValueError("kvd: SGLang gave no model name; set kvd_model_id")
        if storage_config.attn_cp_size > 1 or getattr(storage_config, "dcp_size", 1) > 1:
            raise ValueError("kvd: context parallelism splits every page across ranks; "
                             "not supported")
        self.client = KvdClient(opts.runtime_dir or None, timeout=opts.timeout_s,
                                name=f"sglang:tp{storage_config.tp_rank}:{os.getpid()}").connect()
        self.keyring = Keyring(opts)
        self.timeline = Timeline.from_env("backend")
        self.pages: HostPages | None = None
        self.staging: StagingPool | None = None
        self.shared: SharedHostPool | None = None
        self.shared_refused: str | None = None
        if opts.host_pool == "shared" and not storage_config.extra_config.get("interface_v1"):
            self._stage_without_interface_v1(storage_config.extra_config)
        self.reg = None
        self._session_lock, self._load_lock, self._store_lock = (threading.Lock() for _ in range(3))
        self._retry_at = 0.0
        self._refused: str | None = None
        self._copier = ThreadPoolExecutor(opts.copy_threads, thread_name_prefix="kvd-sglang-copy")
        self.counters = {"lookups": 0, "hit_pages": 0, "loaded_pages": 0, "stored_pages": 0,
                         "unkeyed_pages": 0, "failed_loads": 0, "failed_stores": 0}

    # ---- set-up ----------------------------------------------------------------------

    def _stage_without_interface_v1(self, extra: dict) -> None:
        """SGLang copies pages itself outside its zero-copy interface: the shared pool is of no
        use there. Asked for by name, that is a configuration error; by default, stage."""
        reason = "kvd_host_pool 'shared' needs SGLang's zero-copy interface (\"interface_v1\": 1)"
        if "kvd_host_pool" in extra:
            raise ValueError(f"kvd: {reason}")
        self.options = replace(self.options, host_pool="staging")
        self.shared_refused = reason
        log.info("%s; SGLang's host pages go through a staging pool", reason)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pages = HostPages(mem_pool_host, self.options.kv_dtype)
        self._session()

    def _session(self):
        """The registration, once the host pool is known and the daemon answered."""
        if self.reg is not None or self.pages is None or self._refused:
            return self.reg
        with self._session_lock:
            now = time.monotonic()
            if self.reg is not None or now < self._retry_at:
                return self.reg
            self._retry_at = now + RETRY_S
            try:
                chunk = self.client.chunk_tokens
            except KvdError as exc:
                log.info("kvd not reachable (%s); storage ops are misses until it is", exc)
                return None
            try:
                pool = self._kvd_pool(chunk)
            except ValueError as exc:
                self._refused = str(exc)
                log.error("%s; kvd stays unused", exc)
                return None
            try:
                self.reg = self.client.register_kv(
                    pool, self.model, tp_size=self.config.tp_size, tp_rank=self.config.tp_rank,
                    first_layer=self.pages.first_layer, fingerprint=self.options.fingerprint)
            except (KvdError, ValueError) as exc:
                pool.close()
                self._refused = f"kvd refused the {self.host_pool} pool: {exc}"
                log.error("%s; kvd stays unused", self._refused)
                return None
            if isinstance(pool, SharedHostPool):
                self.shared = pool
            else:
                self.staging = pool
        return self.reg

    def _kvd_pool(self, chunk: int):
        """The pool kvd registers: SGLang's host pool in place (``host_pool`` 'shared', where it
        can be), else a staging pool."""
        group = shm.shared_group(self.client.runtime_dir)
        if self.options.host_pool == "shared":
            try:
                return SharedHostPool(self.pages, chunk, self.options.shm_dir, group)
            except (ValueError, OSError) as exc:  # the pool as it was: stage instead
                self.shared_refused = str(exc)
                log.warning("%s; SGLang's host pages go through a staging pool", exc)
        return StagingPool(self.pages, self.options.staging_pages, chunk, self.options.shm_dir, group)

    @property
    def host_pool(self) -> str:
        """'shared' or 'staging': how pages move now; 'staging' before the first registration."""
        return "shared" if self.shared is not None else "staging"

    def _page_keys(self, hashes, reg) -> list[tuple[bytes, ...]]:
        keyed = self.keyring.page_keys(hashes, reg.namespace, self.pages.page_size)
        if len(keyed) < len(hashes):
            self.counters["unkeyed_pages"] += len(hashes) - len(keyed)
        return keyed

    # ---- the zero-copy interface (interface_v1) ----------------------------------------

    def batch_exists(self, keys, extra_info=None) -> int:
        t0 = time.monotonic()
        reg = self._session()
        if reg is None or not keys:
            return 0
        keyed = self._page_keys(keys, reg)
        if not keyed:
            return 0
        self.counters["lookups"] += 1
        hits = self.client.lookup(ChunkKeys(k for page in keyed for k in page), reg=reg)
        pages = hits // self.pages.page_size
        self.counters["hit_pages"] += pages
        self.timeline.record("batch_exists", t0, pages=len(keys), hit_pages=pages)
        return pages

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        t0 = time.monotonic()
        if self._session() is None or not keys:
            return [False] * len(keys)
        slots = self.pages.page_slots(host_indices, len(keys))
        if self.shared is not None:
            done = self._in_place(keys, slots, self.client.load, "loaded_pages", "failed_loads",
                                  self._load_lock)
        else:
            done = self._load(keys, lambda i, src: self.pages.page(slots[i]).copy_(src))
        self.timeline.record("batch_get_v1", t0, pages=len(keys), done_pages=done)
        return [i < done for i in range(len(keys))]

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        t0 = time.monotonic()
        if self._session() is None or not keys:
            return [False] * len(keys)
        slots = self.pages.page_slots(host_indices, len(keys))
        if self.shared is not None:
            done = self._in_place(keys, slots, self._store_op, "stored_pages", "failed_stores",
                                  self._store_lock)
        else:
            done = self._store(keys, lambda i: self.pages.page(slots[i]))
        self.timeline.record("batch_set_v1", t0, pages=len(keys), done_pages=done)
        return [i < done for i in range(len(keys))]

    # ---- the generic interface (flat pages) ---------------------------------------------

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        if self._session() is None or self.staging is None or not keys or target_locations is None:
            return [None] * len(keys)
        done = self._load(keys, lambda i, src: self.pages.flat_view(target_locations[i]).copy_(src))
        return [target_locations[i] if i < done else None for i in range(len(keys))]

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        if self._session() is None or self.staging is None or not keys or values is None:
            return False
        return self._store(keys, lambda i: self.pages.flat_view(values[i].contiguous())) == len(keys)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # ---- transfers in place (host_pool 'shared') ---------------------------------------------

    def _in_place(self, keys, slots, op, moved: str, failed: str, lock) -> int:
        """Load or store (``op``) the leading pages of ``keys`` at host ``slots`` in place,
        a batch of ``staging_pages`` per kvd request; how many pages moved."""
        done = 0
        with lock:
            for start, keyed, asked in self._batches(keys):
                ids = [p for j in range(len(keyed)) for p in self.shared.kvd_pages(slots[start + j])]
                got = self._moved(op, keyed, ids)
                done = start + got
                self.counters[moved] += got
                self.counters[failed] += got < len(keyed)
                if got < asked:
                    break
        return done

    # ---- transfers through the staging pool -----------------------------------------------

    def _load(self, keys, deliver) -> int:
        """Load the leading pages of ``keys`` kvd holds; ``deliver(i, staged_page)`` puts
        page ``i`` where SGLang wants it. Returns how many pages were delivered."""
        done = 0
        with self._load_lock:
            for start, keyed, asked in self._batches(keys):
                got = self._load_batch(start, keyed, deliver)
                done = start + got
                self.counters["loaded_pages"] += got
                self.counters["failed_loads"] += got < len(keyed)
                if got < asked:
                    break
        return done

    def _load_batch(self, start: int, keyed: list, deliver) -> int:
        """Pages of one staging batch loaded and delivered (a prefix), ``load_pipeline_pages``
        per kvd request: the copy threads deliver a request's pages while kvd moves the
        next request's into other slots; all delivered before the batch's slots are reused."""
        step, got, copies = self.options.load_pipeline_pages, 0, []
        try:
            for first in range(0, len(keyed), step):
                part = keyed[first:first + step]
                n = self._moved(self.client.load, part, self._staged(first, len(part)))
                copies += [self._copier.submit(deliver, start + j, self.staging.slot(j))
                           for j in range(first, first + n)]
                got += n
                if n < len(part):
                    break
        finally:
            for c in copies:
                c.result()  # re-raises a failed copy, as a copy in this thread would
        return got

    def _store(self, keys, source) -> int:
        """Store the leading pages of ``keys``; ``source(i)`` is page ``i`` in page order.
        Returns how many pages kvd now holds."""
        per, done = self.options.staging_pages, 0
        with self._store_lock:
            for start, keyed, asked in self._batches(keys):
                list(self._copier.map(lambda j: self.staging.slot(per + j).copy_(source(start + j)),
                                      range(len(keyed))))
                got = self._moved(self._store_op, keyed, self._staged(per, len(keyed)))
                done = start + got
                self.counters["stored_pages"] += got
                self.counters["failed_stores"] += got < len(keyed)
                if got < asked:
                    break
        return done

    def _store_op(self, keys, page_ids, reg):
        """``client.store`` labelled for the daemon's quotas with the fixed salt."""
        return self.client.store(keys, page_ids, reg=reg, tenant=tenant_label(self.options.salt))

    def _batches(self, keys):
        """(first page, its pages' keys, pages asked) for each staging-pool batch of ``keys``,
        until a page that has no keys (a miss)."""
        per = self.options.staging_pages
        for start in range(0, len(keys), per):
            group = keys[start:start + per]
            keyed = self._page_keys(group, self.reg)
            if not keyed:
                return
            yield start, keyed, len(group)

    def _staged(self, first_slot: int, pages: int) -> list[int]:
        """kvd's page ids of ``pages`` staging slots from ``first_slot`` on."""
        return [p for j in range(pages) for p in self.staging.kvd_pages(first_slot + j)]

    def _moved(self, op, keyed, page_ids) -> int:
        """Pages kvd loaded or stored (``op``) for ``keyed`` at kvd's ``page_ids``."""
        t0 = time.monotonic()
        tokens = op(ChunkKeys(k for page in keyed for k in page), page_ids, reg=self.reg)
        self.timeline.record("kvd_load" if op == self.client.load else "kvd_store", t0,
                             pages=len(keyed), moved_pages=tokens // self.pages.page_size)
        return tokens // self.pages.page_size

    # ---- the rest of HiCacheStorage ---------------------------------------------------------

    def clear(self) -> bool:
        log.warning("kvd: an engine does not clear the shared cache; an operator can "
                    "(kvd ctl, docs/observe.md)")
        return False

    def kvd_stats(self) -> dict:
        """This backend's counters, why kvd stays unused (if it does), and the key map's
        size in key_mode 'tokens'."""
        out = {**self.counters, "refused": self._refused, "host_pool": self.host_pool,
               "shared_refused": self.shared_refused}
        out.update(self.keyring.stats())
        return out

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self.keyring.close()
        self.timeline.close()
        self.client.close()
        for pool in (self.staging, self.shared):
            if pool is not None:
                pool.close()
        self.staging = self.shared = None
