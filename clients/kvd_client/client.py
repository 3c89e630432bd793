"""KvdClient: the engine-side stub. Hashes token chunks, names pages, asks kvd.

Blocking ``store``/``load``/``lookup`` and pipelined ``submit_*`` + ``poll()`` (fenced
``Transfer``s, kvd_client.transfer; ``Lookup``s, kvd_client.lookup). On CUDA pools stores
mark and layer-wise loads signal the engine's stream through the flag page
(kvd_client.flags), with no host round trip. Promises: nothing either side waits on depends
on the other being alive; unavailability degrades to a miss, contract errors raise. The
session (hello, calls, failures, the background thread that heartbeats, fences and
re-registers after a daemon restart) is kvd_client.session (``ClientSession``, which
``KvdClient`` extends).
"""

from __future__ import annotations

import logging
import time

from kvd_protocol import wire
from kvd_protocol.errors import (
    KvdError,
)
from kvd_protocol.keys import Namespace, chain_root, chunk_keys, namespace_digest

from . import shm
from .flags import ClientFlags
from .lookup import Lookup
from .registration import ChunkKeys, KVRegistration, engine_stream, next_seq, page_frame, part_pages
from .session import CONTRACT_ERRORS, ClientSession
from .transfer import Transfer

log = logging.getLogger("kvd_client")


class KvdClient(ClientSession):
    # ---- registration -----------------------------------------------------------

    def register_kv(self, pool, model: str, tp_size: int = 1, tp_rank: int = 0,
                    first_layer: int = 0, fingerprint: str = "") -> KVRegistration:
        """Register a KV pool (``SharedKVPool`` or ``torch_pool.CudaKVPool``; without a daemon,
        and ``raise_errors`` off, it registers when the daemon appears). A pipeline stage passes
        the model-wide index of its first layer; ``fingerprint`` names the weights beyond
        ``model`` (checkpoint, revision, LoRA): pools that differ in either never share chunks."""
        ns = Namespace(model=model, kv_dtype=pool.kv_dtype, attention=pool.attention,
                       num_layers=pool.num_layers, kv_heads=pool.kv_heads, head_dim=pool.head_dim,
                       chunk_tokens=self._chunk_tokens_or_default(), tp_size=tp_size,
                       first_layer=first_layer, fingerprint=fingerprint)
        flags = ClientFlags(pool.num_layers, self.load_slots, self.shm_dir,
                            getattr(pool, "device_index", None), shm.shared_group(self.runtime_dir))
        fields = {"namespace": wire.namespace_to_wire(ns), "tp_rank": tp_rank,
                  "buffers": pool.buffers, "layout": wire.layout_to_wire(pool.descriptor),
                  "flags": flags.spec}
        return self._add(KVRegistration(ns, tp_rank, fields, pool, flags,
                                        owners=[None] * self.load_slots))

    def attach(self, model: str, kv_dtype: str, attention: str, num_layers: int, kv_heads: int,
               head_dim: int, tp_size: int = 1, tp_rank: int = 0, first_layer: int = 0,
               fingerprint: str = "") -> KVRegistration:
        """A registration of a namespace without a KV pool: for lookups in a process that
        holds no KV (vLLM's scheduler). Stores and loads need ``register_kv``."""
        ns = Namespace(model=model, kv_dtype=kv_dtype, attention=attention, num_layers=num_layers,
                       kv_heads=kv_heads, head_dim=head_dim,
                       chunk_tokens=self._chunk_tokens_or_default(), tp_size=tp_size,
                       first_layer=first_layer, fingerprint=fingerprint)
        fields = {"namespace": wire.namespace_to_wire(ns), "tp_rank": tp_rank}
        return self._add(KVRegistration(ns, tp_rank, fields, None, None))

    def _add(self, reg: KVRegistration) -> KVRegistration:
        with self._lock:
            self.registrations.append(reg)
        try:
            self._ensure_connected()
            if self.connected and reg.id == 0:
                self._register(reg)
        except KvdError as exc:
            if self.raise_errors or isinstance(exc, CONTRACT_ERRORS):
                with self._lock:
                    self.registrations.remove(reg)
                if reg.flags is not None:
                    reg.flags.close()
                raise
            log.warning("kvd unavailable; the pool registers when it is back: %s", exc)
        return reg

    def _chunk_tokens_or_default(self) -> int:
        try:
            return self.chunk_tokens
        except KvdError:
            if self.raise_errors:
                raise
            return 256  # the daemon's default; corrected keys follow the real value on hello

    def unregister(self, reg: KVRegistration) -> None:
        with self._lock:
            self.registrations.remove(reg)
        if self.connected and reg.id:
            self._guard(lambda: self._call("unregister", {"reg": reg.id}), None)
        if reg.flags is not None:
            reg.flags.close()

    def _default(self, reg):
        if reg is not None:
            return reg
        if not self.registrations:
            raise ValueError("register a KV pool first (register_kv)")
        return self.registrations[0]

    # ---- lookups ----------------------------------------------------------------

    def keys(self, tokens, salt: str | None = None, reg: KVRegistration | None = None) -> list[bytes]:
        """Chunk keys of ``tokens``; ``ChunkKeys`` (precomputed keys) pass through as they are."""
        if isinstance(tokens, ChunkKeys):
            return list(tokens)
        reg = self._default(reg)
        return chunk_keys(chain_root(namespace_digest(reg.namespace), salt), tokens,
                          reg.namespace.chunk_tokens)

    def lookup(self, tokens, salt: str | None = None, reg: KVRegistration | None = None) -> int:
        """Tokens of the longest cached prefix of ``tokens`` (whole chunks)."""
        return self.lookup_lease(tokens, 0, salt, reg)[0]

    def lookup_lease(self, tokens, lease_ms: int, salt: str | None = None,
                     reg: KVRegistration | None = None) -> tuple[int, int | None]:
        """Like lookup, and pins the hits for ``lease_ms`` so a following load finds them."""
        return self.submit_lookup(tokens, lease_ms, salt, reg).result()

    def submit_lookup(self, tokens, lease_ms: int, salt: str | None = None,
                      reg: KVRegistration | None = None, part_tokens=None) -> Lookup:
        """Send a lookup (hits pinned for ``lease_ms``) and return at once: a ``Lookup``
        (kvd_client.lookup, also for ``part_tokens``), done at once when it cannot be sent."""
        reg = self._default(reg)
        lookup = Lookup(self, reg, self.keys(tokens, salt, reg), lease_ms,
                        time.monotonic() + self.timeout, part_tokens)
        self._pump.start_lookup(lookup)
        return lookup

    def release(self, lease: int, wait: bool = True) -> None:
        """End a lease. ``wait=False`` sends the release and returns at once: a release
        that is lost (the daemon down, or an error answered) leaves the lease to expire."""
        if wait:
            self._guard(lambda: self._call("release", {"lease": lease}), None)
            return
        try:  # its reply, routed to no one, is dropped by the pump
            self.channel.send("release", {"lease": lease}, wait=0.0)
        except KvdError as exc:
            log.debug("lease %d left to expire: %s", lease, exc)

    # ---- transfers --------------------------------------------------------------

    def submit_store(self, tokens, page_ids, salt: str | None = None,
                     reg: KVRegistration | None = None, tenant: str | None = None, part_tokens=0) -> Transfer:
        """Offload the whole chunks of ``tokens`` (or ``ChunkKeys``) from ``page_ids``, asynchronously;
        ``tenant`` labels new chunks for quotas (``wire.tenant_label``); ``part_tokens``: a partial entry."""
        reg = self._default(reg)
        keys, pages = self._keys_pages(tokens, page_ids, salt, reg, 0, part_tokens)
        t = Transfer(self, "store", reg, keys, pages, time.monotonic() + self.timeout)
        t.collect, t.tenant, t.part_tokens = True, wire.checked_tenant(tenant), part_tokens
        self._pump.start(t)
        return t

    def submit_load(self, tokens, page_ids, salt: str | None = None, lease: int | None = None,
                    reg: KVRegistration | None = None, layerwise: bool = False,
                    tail_pages: int = 0, part_tokens: int = 0) -> Transfer:
        """Copy the cached prefix of ``tokens`` (or ``ChunkKeys``) into ``page_ids``, asynchronously. With
        ``layerwise``, ``wait_for_layer(i, transfer)`` orders the engine's work after layer i landed
        while later layers still copy; ``tail_pages``: the last chunk's first pages; ``part_tokens``."""
        reg = self._default(reg)
        keys, pages = self._keys_pages(tokens, page_ids, salt, reg, tail_pages, part_tokens)
        deadline = time.monotonic() + self.timeout
        slot = self._pump.free_slot(reg, deadline)
        reg.load_seq = next_seq(reg.load_seq)
        t = Transfer(self, "load", reg, keys, pages, deadline, slot, reg.load_seq, layerwise)
        t.collect, t.lease, t.tail_pages, t.part_tokens = True, lease, tail_pages, part_tokens
        with self._lock:
            reg.owners[slot] = t
            reg.last_load = t
        self._pump.start(t)
        return t

    def store(self, tokens, page_ids, salt: str | None = None, reg: KVRegistration | None = None,
              tenant: str | None = None) -> int:
        """Offload the whole chunks of ``tokens``; returns tokens now cached (0 on failure)."""
        return self._blocking(self.submit_store(tokens, page_ids, salt, reg, tenant))

    def load(self, tokens, page_ids, salt: str | None = None, lease: int | None = None,
             reg: KVRegistration | None = None) -> int:
        """Copy the cached prefix of ``tokens`` into ``page_ids``; returns tokens loaded (0 on failure:
        the pages hold undefined bytes, the daemon no longer writes them). Layer-wise: ``submit_load``."""
        return self._blocking(self.submit_load(tokens, page_ids, salt, lease, reg))

    def _blocking(self, t: Transfer) -> int:
        t.collect = False
        t.wait()
        if t.error is not None and (self.raise_errors or isinstance(t.error, CONTRACT_ERRORS)):
            raise t.error
        if t.error is not None:
            log.warning("kvd %s failed, treating as a miss: %s", t.op, t.error)
        return t.tokens

    def wait_for_layer(self, layer: int, transfer: Transfer | None = None,
                       reg: KVRegistration | None = None) -> None:
        """Order the engine's next work after layer ``layer`` of a layer-wise load (the
        last one of ``reg`` by default) landed or failed. CUDA pools: the current
        stream waits (no host round trip). Host pools: this thread waits."""
        t = transfer or self._default(reg).last_load
        if t is None or not t.layerwise:
            return
        stream = engine_stream(t.reg.pool)
        if stream is not None:
            t.reg.flags.wait_layer(stream, t.slot, layer, t.seq)
            return
        while not t.reg.flags.layer_landed(t.slot, layer, t.seq) and not t.done:
            self.progress(t, 0.001)

    def poll(self) -> list[Transfer]:
        """Submitted transfers that ended and are fenced since the last poll."""
        self.progress(None, 0.0)
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def _keys_pages(self, tokens, page_ids, salt, reg, tail_pages: int = 0, part_tokens: int = 0):
        if reg.pool is None:
            raise ValueError("this registration was attached for lookups: it has no KV pool")
        keys = self.keys(tokens, salt, reg)  # a partial entry's pages: page_frame's tail
        return keys, page_frame(reg, len(keys), page_ids, part_pages(reg, part_tokens) or tail_pages)


def connect(runtime_dir: str | None = None, timeout: float = 5.0, raise_errors: bool = False,
            name: str | None = None) -> KvdClient:
    return KvdClient(runtime_dir, timeout, raise_errors, name).connect()
