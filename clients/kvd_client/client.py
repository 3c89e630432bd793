"""KvdClient: the engine-side stub. Hashes token chunks, names pages, asks kvd.

Operations: ``connect``, ``register_kv``, ``lookup``, ``store``, ``load``,
``release``, ``close``. Every call has a timeout. By default a daemon that
is down or slow never raises into the engine: lookups and loads report 0
tokens and stores report 0 stored (``raise_errors=True`` raises the
``kvd_protocol.errors`` exception instead). A background thread sends heartbeats;
when the daemon restarts, the next call (or heartbeat) says hello again,
re-registers every pool and retries once. A load that timed out may still
land later: treat those pages as garbage, as for any miss. ``spin_s`` > 0
makes each call busy-poll that long for its reply before sleeping (saves
the 0.1-0.3 ms wake-up of a sleeping thread per call, for a busy core).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvd_protocol import wire
from kvd_protocol.errors import KvdError, NoSession, TransportError
from kvd_protocol.keys import Namespace, chain_root, chunk_keys, namespace_digest
from kvd_protocol.runtime import engine_endpoint, resolve_runtime_dir

from .transport import Channel

log = logging.getLogger("kvd_client")


@dataclass
class KVRegistration:
    """A registered pool; ``id`` changes when the daemon restarts."""

    namespace: Namespace
    tp_rank: int
    fields: dict
    pool: object = None
    id: int = 0
    pages_per_chunk: int = 0
    load_event_handles: list = field(default_factory=list)
    load_events: dict = field(default_factory=dict)  # slot -> opened torch events, per layer
    last_slot: int | None = None
    next_store_event: int = 0


class KvdClient:
    def __init__(self, runtime_dir: str | None = None, timeout: float = 5.0,
                 raise_errors: bool = False, name: str | None = None, heartbeat: bool = True,
                 spin_s: float = 0.0):
        self.endpoint = engine_endpoint(resolve_runtime_dir(runtime_dir))
        self.timeout = timeout
        self.raise_errors = raise_errors
        self.name = name or f"kvd_client:{os.getpid()}"
        self.channel = Channel(self.endpoint, timeout, spin_s)
        self.limits: dict = {}
        self.registrations: list[KVRegistration] = []
        self._lock = threading.RLock()
        self._last_ok = 0.0
        self._closed = threading.Event()
        self._heartbeat = heartbeat
        self._hb_thread = None

    # ---- session ----------------------------------------------------------------

    def connect(self) -> "KvdClient":
        """Say hello (raises if the daemon is unreachable) and start heartbeats."""
        self._hello()
        if self._heartbeat and self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._beat, name="kvd-heartbeat", daemon=True)
            self._hb_thread.start()
        return self

    @property
    def chunk_tokens(self) -> int:
        return self.limits["chunk_tokens"]

    def _hello(self) -> None:
        with self._lock:
            self.limits = self.channel.request(
                "hello", {"client": self.name, "pid": os.getpid(), "versions": [wire.VERSION]})
            for reg in self.registrations:
                self._register(reg)
            self._last_ok = time.monotonic()

    def _register(self, reg: KVRegistration) -> None:
        result = self.channel.request("register", reg.fields)
        reg.id, reg.pages_per_chunk = result["reg"], result["pages_per_chunk"]
        reg.load_event_handles, reg.load_events, reg.last_slot = result.get("load_events", []), {}, None

    def _call(self, op: str, fields: dict, frames=(), reg: KVRegistration | None = None):
        """One request; on a daemon restart (no session) re-hello and retry once."""
        with self._lock:
            try:
                result = self.channel.request(op, _with_reg(fields, reg), frames)
            except NoSession:
                self._hello()  # re-registers: ``reg.id`` is the new daemon's id
                result = self.channel.request(op, _with_reg(fields, reg), frames)
            self._last_ok = time.monotonic()
            return result

    def _beat(self) -> None:
        while not self._closed.wait(self._interval()):
            if time.monotonic() - self._last_ok < self._interval():
                continue
            try:
                self._call("heartbeat", {})
            except KvdError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _interval(self) -> float:
        return float(self.limits.get("heartbeat_interval_s", 5.0))

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            try:
                self.channel.request("bye", {}, timeout=min(self.timeout, 1.0))
            except KvdError:
                pass
            self.channel.close()

    def __enter__(self):
        return self.connect()

    def __exit__(self, *exc):
        self.close()

    # ---- registration -----------------------------------------------------------

    def register_kv(self, pool, model: str, tp_size: int = 1, tp_rank: int = 0,
                    first_layer: int = 0, fingerprint: str = "") -> KVRegistration:
        """Register a KV pool (anything with descriptor, buffers, kv_dtype, attention,
        num_layers, kv_heads, head_dim, such as ``SharedKVPool``). A pipeline stage passes
        the model-wide index of its first layer; ``fingerprint`` names the weights beyond
        ``model`` (checkpoint, revision, LoRA): pools that differ in either never share chunks."""
        ns = Namespace(model=model, kv_dtype=pool.kv_dtype, attention=pool.attention,
                       num_layers=pool.num_layers, kv_heads=pool.kv_heads, head_dim=pool.head_dim,
                       chunk_tokens=self.chunk_tokens, tp_size=tp_size, first_layer=first_layer,
                       fingerprint=fingerprint)
        fields = {"namespace": wire.namespace_to_wire(ns), "tp_rank": tp_rank,
                  "buffers": pool.buffers, "layout": wire.layout_to_wire(pool.descriptor)}
        if getattr(pool, "event_handles", None):
            fields["events"] = pool.event_handles
        reg = KVRegistration(ns, tp_rank, fields, pool)
        with self._lock:
            try:
                self._register(reg)
            except NoSession:
                self._hello()
                self._register(reg)
            self.registrations.append(reg)
        return reg

    def unregister(self, reg: KVRegistration) -> None:
        with self._lock:
            self.registrations.remove(reg)
            self._guard(lambda: self._call("unregister", {}, reg=reg), None)

    # ---- data -------------------------------------------------------------------

    def keys(self, tokens, salt: str | None = None, reg: KVRegistration | None = None) -> list[bytes]:
        reg = self._default(reg)
        return chunk_keys(chain_root(namespace_digest(reg.namespace), salt), tokens, self.chunk_tokens)

    def lookup(self, tokens, salt: str | None = None, reg: KVRegistration | None = None) -> int:
        """Tokens of the longest cached prefix of ``tokens`` (whole chunks)."""
        return self.lookup_lease(tokens, 0, salt, reg)[0]

    def lookup_lease(self, tokens, lease_ms: int, salt: str | None = None,
                     reg: KVRegistration | None = None) -> tuple[int, int | None]:
        """Like lookup, and pins the hits for ``lease_ms`` so a following load finds them."""
        reg = self._default(reg)
        keys = self.keys(tokens, salt, reg)
        if not keys:
            return 0, None
        res = self._guard(lambda: self._call(
            "lookup", {"lease_ms": lease_ms}, [wire.keys_frame(keys)], reg),
            {"hits": 0, "lease": None})
        return res["hits"] * self.chunk_tokens, res["lease"]

    def store(self, tokens, page_ids, salt: str | None = None, reg: KVRegistration | None = None) -> int:
        """Offload the whole chunks of ``tokens`` from ``page_ids``; returns tokens now cached."""
        reg = self._default(reg)
        keys, pages = self._keys_pages(tokens, page_ids, salt, reg)
        if not keys:
            return 0
        fields = self._record_store_event(reg)
        # CLOCK_MONOTONIC is one clock for every process of the host: the daemon
        # drops a store that completes after we stopped waiting for it
        fields["deadline_us"] = (time.monotonic_ns() // 1000) + int(self.timeout * 1e6)
        res = self._guard(lambda: self._call("store", fields, [wire.keys_frame(keys), pages], reg),
                          {"stored": 0, "deduped": 0})
        return (res["stored"] + res["deduped"]) * self.chunk_tokens

    def load(self, tokens, page_ids, salt: str | None = None, lease: int | None = None,
             reg: KVRegistration | None = None, layerwise: bool = False) -> int:
        """Copy the cached prefix of ``tokens`` into ``page_ids``; returns tokens loaded.

        ``layerwise`` (CUDA pools): return once the copies are queued; call
        ``wait_for_layer(i)`` before layer i's attention reads its KV."""
        reg = self._default(reg)
        keys, pages = self._keys_pages(tokens, page_ids, salt, reg)
        if not keys:
            return 0
        fields = {"layerwise": True} if layerwise else {}
        fields["deadline_us"] = (time.monotonic_ns() // 1000) + int(self.timeout * 1e6)
        if lease is not None:
            fields["lease"] = lease
        res = self._guard(lambda: self._call("load", fields, [wire.keys_frame(keys), pages], reg),
                          {"loaded": 0})
        reg.last_slot = res.get("slot")
        return res["loaded"] * self.chunk_tokens

    def wait_for_layer(self, layer: int, reg: KVRegistration | None = None) -> None:
        """Make the current CUDA stream wait until layer ``layer`` of the last
        layer-wise load has landed (no host round trip). No-op without one."""
        import torch
        reg = self._default(reg)
        if reg.last_slot is None:
            return
        events = reg.load_events.get(reg.last_slot)
        if events is None:
            handles = reg.load_event_handles[reg.last_slot]
            events = [torch.cuda.Event.from_ipc_handle(reg.pool.device, h) for h in handles]
            reg.load_events[reg.last_slot] = events
        torch.cuda.current_stream(reg.pool.device).wait_event(events[layer])

    def _record_store_event(self, reg: KVRegistration) -> dict:
        """CUDA pools: the daemon's copy waits for what this stream has queued so far."""
        events = getattr(reg.pool, "store_events", None)
        if not events:
            return {}
        import torch
        index = reg.next_store_event
        reg.next_store_event = (index + 1) % len(events)
        events[index].record(torch.cuda.current_stream(reg.pool.device))
        return {"event": index}

    def release(self, lease: int) -> None:
        self._guard(lambda: self._call("release", {"lease": lease}), None)

    def _keys_pages(self, tokens, page_ids, salt, reg):
        keys = self.keys(tokens, salt, reg)
        need = len(keys) * reg.pages_per_chunk
        pages = np.asarray(page_ids, dtype=np.int64)
        if pages.ndim != 1 or len(pages) < need:
            raise ValueError(f"{len(keys)} chunks need {need} page ids, got {pages.size}")
        return keys, wire.pages_frame(pages[:need])

    def _default(self, reg):
        if reg is not None:
            return reg
        if not self.registrations:
            raise ValueError("register a KV pool first (register_kv)")
        return self.registrations[0]

    def _guard(self, call, fallback):
        try:
            return call()
        except TransportError as exc:
            if self.raise_errors:
                raise
            log.warning("kvd unavailable, treating as a miss: %s", exc)
            return fallback
        except KvdError as exc:
            if self.raise_errors:
                raise
            log.warning("kvd refused the request: %s", exc)
            return fallback


def _with_reg(fields: dict, reg: KVRegistration | None) -> dict:
    return fields if reg is None else {**fields, "reg": reg.id}


def connect(runtime_dir: str | None = None, timeout: float = 5.0, raise_errors: bool = False,
            name: str | None = None) -> KvdClient:
    return KvdClient(runtime_dir, timeout, raise_errors, name).connect()
