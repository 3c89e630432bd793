"""Mooncake Store as a remote chunk store (kvd-cache's ``mooncake`` extra).

kvd.tiers.remote.store's interface over ``MooncakeDistributedStore`` (TCP transport):
``address`` the master, ``segment_bytes`` what this daemon lends, ``metadata`` the transfer
engine's metadata service, ``local_host`` this node's address. ``connect`` checks the master
accepts TCP first (Mooncake's ``setup`` holds the GIL and retries forever). ``get`` cannot
tell absent from failed: either is a miss. Zero-copy: ``lend`` names the arena; ``put_from``/
``get_into`` move runs of values as head (via ``HEADS`` head slots) + payload straight from/
into the arena, same stored bytes as ``put``. Per value: head, None (absent), or the stored
size when it differs; a failed value gets its ``RemoteError``; a call whose every value
failed raises. A head slot is reused only after its call returned.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from urllib.parse import urlsplit

import numpy as np

from kvd.tiers.remote.errors import RemoteError, unless_all_failed

log = logging.getLogger("kvd")
DEFAULT_METADATA_PORT = 8080
HEADS, HEAD_SLOT = 256, 128  # value heads in flight at once, and the bytes of one (92 + 32 tag)
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
ZERO_COPY_CALLS = ("register_buffer", "unregister_buffer", "batch_put_from_multi_buffers",
                   "batch_get_into_multi_buffers")


class HeadSlots:
    """Registered memory for the heads of values in flight; any thread takes and gives."""

    def __init__(self):
        self.buf = np.zeros(HEADS * HEAD_SLOT, np.uint8)
        self.ptr = self.buf.ctypes.data
        self._free = list(range(HEADS))
        self._lock = threading.Lock()

    def take(self, n: int) -> list:
        with self._lock:
            if len(self._free) < n:
                raise RemoteError(f"{n} value head slots wanted, {len(self._free)} of {HEADS} "
                                  "free")
            taken, self._free[-n:] = self._free[-n:], []
            return taken

    def give(self, slots: list) -> None:
        with self._lock:
            self._free += slots


def _host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port or "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


class MooncakeStore:
    name = "mooncake"
    head_slots = HEADS  # value heads of the calls in flight at once, all together

    def __init__(self, address: str, timeout_s: float, metadata: str = "", local_host: str = "",
                 segment_bytes: int = 0, buffer_bytes: int = 256 << 20, zero_copy: bool = True):
        self.master = _host_port(address)
        self.address = address
        self.metadata = metadata or f"http://{self.master[0]}:{DEFAULT_METADATA_PORT}/metadata"
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.store = None
        self.want_zero_copy = zero_copy
        self.lent: tuple | None = None  # (pointer, bytes) of the host arena
        self.heads = HeadSlots()
        self.registered: list = []
        self.zero_copy_off = "not connected"

    @property
    def zero_copy(self) -> bool:
        return not self.zero_copy_off

    def lend(self, ptr: int, size: int) -> None:
        """The host arena, registered by ``connect`` for the zero-copy path."""
        self.lent = (ptr, size)

    def _reachable(self) -> None:
        """Raise unless the master (and an HTTP metadata server) accept TCP connections."""
        targets = [self.master]
        url = urlsplit(self.metadata)
        if url.scheme in ("http", "https"):
            targets.append(_host_port(url.netloc, 443 if url.scheme == "https" else 80))
        for host, port in targets:
            try:
                socket.create_connection((host, port), self.timeout_s).close()
            except OSError as exc:
                raise RemoteError(f"{host}:{port} does not accept connections: {exc}") from None

    def _local_host(self) -> str:
        if self.local_host:
            return self.local_host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # sends nothing
            s.connect(self.master)
            return s.getsockname()[0]

    def connect(self) -> None:
        self._reachable()
        if self.store is not None:  # set up once; it reconnects to a restarted master itself
            return
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines would flood kvd's log
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        rc = store.setup(self._local_host(), self.metadata, self.segment_bytes, self.buffer_bytes,
                         "tcp", "", self.address)
        if rc != 0:
            store.close()
            raise RemoteError(f"Mooncake setup failed with code {rc}")
        self.store = store
        self.zero_copy_off = self._register()
        if self.zero_copy_off:
            log.info("remote tier: Mooncake zero-copy path off (%s): values go through Python "
                     "bytes", self.zero_copy_off)
        else:
            log.info("remote tier: Mooncake zero-copy path on: the host arena (%d bytes) is "
                     "registered, chunks move straight between it and the store", self.lent[1])

    def _register(self) -> str:
        """Register the arena and the head slots: "" when done, else why not."""
        if not self.want_zero_copy:
            return "remote_mooncake_zero_copy = false"
        if self.lent is None:
            return "no host arena lent"
        missing = [c for c in ZERO_COPY_CALLS if not hasattr(self.store, c)]
        if missing:
            return f"this Mooncake client lacks {', '.join(missing)}"
        for ptr, size in (self.lent, (self.heads.ptr, self.heads.buf.nbytes)):
            try:
                rc = self.store.register_buffer(ptr, size)
            except Exception as exc:  # noqa: BLE001 - any refusal means: no zero-copy
                rc = f"{type(exc).__name__}: {exc}"
            if rc != 0:
                self._unregister(self.store)
                return f"register_buffer of {size} bytes at {ptr:#x} failed: {rc}"
            self.registered.append(ptr)
        return ""

    def _unregister(self, store) -> None:
        for ptr in self.registered:
            store.unregister_buffer(ptr)
        self.registered.clear()

    def ping(self) -> None:
        code = self.store.health_check()
        if code != 0:
            raise RemoteError(f"Mooncake health check: {code} (1: closed, 2: master unreachable)")

    def exists(self, names: list) -> list:
        codes = self.store.batch_is_exist(list(names))
        if any(c < 0 for c in codes):
            raise RemoteError(f"Mooncake exists failed: {min(codes)}")
        return [c == 1 for c in codes]

    def get(self, name: str):
        value = self.store.get(name)
        return value or None

    def put(self, name: str, value) -> None:
        rc = self.store.put(name, value)
        if rc != 0:
            raise RemoteError(f"Mooncake put failed with code {rc}")

    def put_from(self, names: list, heads: list, ptrs: list, sizes: list) -> list:
        """Store, for each ``names[i]``, ``heads[i]`` then the ``sizes[i]`` arena bytes at
        ``ptrs[i]`` as one value, all in one batch call: per value None (stored) or the
        ``RemoteError`` of its failure; raises when every value failed."""
        slots = self.heads.take(len(names))
        try:
            at = []
            for slot, head in zip(slots, heads):
                self.heads.buf[slot * HEAD_SLOT:slot * HEAD_SLOT + len(head)] = \
                    np.frombuffer(head, np.uint8)
                at.append(self.heads.ptr + slot * HEAD_SLOT)
            rc = self.store.batch_put_from_multi_buffers(
                list(names), [[a, p] for a, p in zip(at, ptrs)],
                [[len(h), n] for h, n in zip(heads, sizes)])
        finally:
            self.heads.give(slots)
        if not rc or len(rc) != len(names):
            raise RemoteError(f"Mooncake put_from of {len(names)} values answered {rc!r}")
        return unless_all_failed([None if c == 0 else
                                  RemoteError(f"Mooncake put_from failed with code {c}") for c in rc])

    def get_into(self, names: list, head_len: int, ptrs: list, size: int) -> list:
        """Fetch values of ``head_len + size`` bytes, all in one batch call: each one's head
        and its payload, into the arena at ``ptrs[i]``. Per value: its head (bytes), None
        when absent, the stored size when another (some of its bytes may be in the
        slot), or the ``RemoteError`` of its failure; raises when every value failed."""
        slots = self.heads.take(len(names))
        try:
            at = [self.heads.ptr + slot * HEAD_SLOT for slot in slots]
            rc = self.store.batch_get_into_multi_buffers(
                list(names), [[a, p] for a, p in zip(at, ptrs)], [[head_len, size]] * len(names))
            if not rc or len(rc) != len(names):
                raise RemoteError(f"Mooncake get_into of {len(names)} values answered {rc!r}")
            out = [self.heads.buf[slot * HEAD_SLOT:slot * HEAD_SLOT + head_len].tobytes()
                   if got == head_len + size else got for slot, got in zip(slots, rc)]
        finally:
            self.heads.give(slots)
        for i, got in enumerate(out):
            if isinstance(got, bytes):
                continue
            if got == NOT_FOUND:
                out[i] = None
                continue
            stored = self.store.get_size(names[i])  # its own size: a damaged or other value
            out[i] = stored if stored >= 0 and stored != head_len + size else \
                RemoteError(f"Mooncake get_into failed with code {got}")
        return unless_all_failed(out)

    def delete(self, name: str) -> None:
        """Remove at once (``force``: a lease another read took would keep it seconds)."""
        self.store.remove(name, True)

    def close(self) -> None:
        """Unmount and close, when the master is there: with it gone, Mooncake's close retries
        for many seconds holding the GIL, so it is skipped (the master forgets a client that
        stopped sending heartbeats after its ``client_ttl``)."""
        if self.store is None:
            return
        store, self.store = self.store, None
        self.zero_copy_off = "closed"
        self._reachable()
        self._unregister(store)
        store.close()
