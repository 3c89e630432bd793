"""Mooncake Store as a remote chunk store (``pip install 'kvd[mooncake]'``).

The backend interface of kvd/tiers/remote_store.py over
``mooncake.store.MooncakeDistributedStore`` with the TCP transport: a
``mooncake_master`` (``address``: its RPC host:port) keeps the object
metadata; the bytes live in the memory segments that clients lend to the
cluster (``segment_bytes``: what this daemon lends; 0 lends nothing and
uses the segments of other clients or of Mooncake's own store services).
``metadata`` is the transfer engine's metadata service: a URL
(``http://host:8080/metadata``, the master's own with
``--enable_http_metadata_server``), ``P2PHANDSHAKE`` or an etcd address;
empty means ``http://<master host>:8080/metadata``. ``local_host`` is the
address other nodes reach this one on (empty: the address this host uses
to reach the master).

Mooncake's ``setup`` holds the GIL and retries without end while the master
is down, which would freeze the whole daemon, so ``connect`` first checks
that the master (and an HTTP metadata server) accept a TCP connection
within the timeout and only then calls it; once set up, the client
reconnects to a restarted master by itself, and its data calls release
the GIL. ``get`` cannot tell "absent" from "failed" (both give no bytes):
either is a miss. The master's own objects are gone when it restarts
without high availability: the remote tier is a cache.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from kvd.tiers.remote_store import RemoteError

DEFAULT_METADATA_PORT = 8080


def _host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port or "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


class MooncakeStore:
    name = "mooncake"

    def __init__(self, address: str, timeout_s: float, metadata: str = "", local_host: str = "",
                 segment_bytes: int = 0, buffer_bytes: int = 256 << 20):
        self.master = _host_port(address)
        self.address = address
        self.metadata = metadata or f"http://{self.master[0]}:{DEFAULT_METADATA_PORT}/metadata"
        self.local_host = local_host
        self.timeout_s = timeout_s
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.store = None

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

    def delete(self, name: str) -> None:
        self.store.remove(name)

    def close(self) -> None:
        """Unmount and close, when the master is there: with it gone, Mooncake's close retries
        for many seconds holding the GIL, so it is skipped (the master forgets a client that
        stopped sending heartbeats after its ``client_ttl``)."""
        if self.store is None:
            return
        store, self.store = self.store, None
        self._reachable()
        store.close()
