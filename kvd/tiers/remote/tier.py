"""Remote tier IO: calls to a distributed store that never make a request slow.

Every store call runs on one of ``threads`` daemon threads and is awaited at most
``timeout_s`` (plus payload size at ``FLOOR_BYTES_S``); late calls are abandoned and counted.
A circuit breaker (kvd.tiers.remote.breaker) opens after ``breaker_failures`` failures, refusing
calls at once, and a probe closes it; it starts open, so start-up never waits on the store.
All threads taken: refused at once (``busy``). Payload work runs on separate CPU threads and
is always waited for (it touches the arena). Never raises to requests: ``exists_prefix`` 0,
``get``/``put`` None. ``known`` and ``bad`` remember names present and dropped as corrupt.
Zero-copy ``put_from``/``get_into``: ``on_done`` says when the thread left the call.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.tiers.remote.calls import RemoteUnavailable, StoreCalls
from kvd.tiers.remote.value import store_name

log = logging.getLogger("kvd")
KNOWN_NAMES = 1 << 16
BAD_HOLD_S = 10.0  # a value dropped as corrupt is no hit here for this long (its delete may lag)


class RemoteTier(StoreCalls):
    def name(self, ns: bytes, key: bytes) -> str:
        return store_name(self.prefix, ns, key)

    # ---- operations --------------------------------------------------------------------

    async def exists_prefix(self, ns: bytes, keys: list) -> int:
        """How many of ``keys``, in order, the store holds (0 when it cannot say now)."""
        names = [self.name(ns, k) for k in keys]
        try:
            found = await self.call(self.store.exists, names)
        except RemoteUnavailable:
            return 0
        now = time.monotonic()
        n = next((i for i, (there, name) in enumerate(zip(found, names))
                  if not there or self.bad.get(name, 0) > now), len(found))
        for name in names[:n]:
            self.remember(name)
        self.counters["exists_calls"] += 1
        return n

    async def get(self, ns: bytes, key: bytes, nbytes: int = 0):
        """The stored value (unverified bytes), or None (absent, or the store failed)."""
        name = self.name(ns, key)
        try:
            value = await self.call(self.store.get, name, nbytes=nbytes)
        except RemoteUnavailable:
            return None
        self._got(name, value)
        return value

    async def present(self, names: list):
        """Which of ``names`` the store holds (one round trip); None when it cannot say."""
        try:
            return await self.call(self.store.exists, names)
        except RemoteUnavailable:
            return None

    def there(self, name: str) -> None:
        """A put found ``name`` in the store already (another node sent it)."""
        self.remember(name)
        self.counters["puts_present"] += 1

    async def get_many(self, ns: bytes, keys: list, nbytes: int = 0) -> list:
        """The stored values of ``keys`` (each unverified bytes or None), one round trip
        (the store's ``get_many``); all None when the store failed."""
        try:
            values = await self.call(self.store.get_many, [self.name(ns, k) for k in keys],
                                     nbytes=nbytes)
        except RemoteUnavailable:
            return [None] * len(keys)
        for key, value in zip(keys, values):
            self._got(self.name(ns, key), value)
        return values

    def _got(self, name: str, value) -> None:
        if value is None:
            self.counters["gets_missing"] += 1
            self.forget(name)
        else:
            self.counters["gets"] += 1
            self.counters["get_bytes"] += value if isinstance(value, int) else len(value)

    async def put(self, ns: bytes, key: bytes, value, checked: bool = False):
        """Store ``value`` unless the store has the chunk already (``checked``: the caller
        asked, ``present``): True when it was sent, False when it was there, None when
        the call failed (a call abandoned at its timeout may still read ``value``)."""
        name = self.name(ns, key)
        size = memoryview(value).nbytes
        try:
            sent = await self.call(self._put, name, value, checked, nbytes=size)
        except RemoteUnavailable:
            sent = None
        return self._put_result(name, sent, size)

    async def put_from(self, names: list, heads: list, ptrs: list, sizes: list,
                       checked: bool, on_done) -> list:
        """``put`` of values whose payloads are ``sizes[i]`` bytes of registered memory at
        ``ptrs[i]`` (the store's ``put_from``: one call for all, and one exists round trip
        first unless ``checked``), sent without a copy: per value True sent, False the store
        had it, None failed. ``on_done`` as ``call``'s: the payloads must stay as they are
        until then."""
        try:
            sent = await self.call(self._put_from, names, heads, ptrs, sizes, checked,
                                   nbytes=sum(sizes), on_done=on_done)
        except RemoteUnavailable:
            sent = [None] * len(names)
        out = []
        for name, head, size, one in zip(names, heads, sizes, sent):
            if isinstance(one, Exception):  # this value failed, others of the call did not
                self.counters["errors"] += 1
                self._note(one, "put_from")
                one = None
            self.counters["zero_copy_puts"] += one is True
            out.append(self._put_result(name, one, len(head) + size))
        return out

    def _put_result(self, name: str, sent: bool | None, nbytes: int) -> bool | None:
        """Count a put's outcome: None failed, False the store had it, True sent."""
        if sent is None:
            self.counters["puts_failed"] += 1
            return None
        if not sent:
            self.there(name)
            return False
        self.remember(name)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += nbytes
        return True

    def _put_from(self, names: list, heads: list, ptrs: list, sizes: list,
                  checked: bool) -> list:
        there = [False] * len(names) if checked else self.store.exists(names)
        todo = [i for i, t in enumerate(there) if not t]
        out: list = [False] * len(names)
        if todo:
            for i, one in zip(todo, self.store.put_from(*([x[i] for i in todo] for x in
                                                          (names, heads, ptrs, sizes)))):
                out[i] = True if one is None else one
        return out

    async def get_into(self, ns: bytes, keys: list, head_len: int, ptrs: list, size: int,
                       on_done) -> list:
        """Values of ``keys``, one store call (the store's ``get_into``): per value its head,
        its payload fetched into registered memory at ``ptrs[i]``; None when absent or
        failed, an int (the stored size) when the value has another size. ``on_done`` as
        ``call``'s: the memory may be written until then."""
        names = [self.name(ns, k) for k in keys]
        try:
            heads = await self.call(self.store.get_into, names, head_len, ptrs, size,
                                    nbytes=size * len(names), on_done=on_done)
        except RemoteUnavailable:
            return [None] * len(names)
        out = []
        for name, head in zip(names, heads):
            if isinstance(head, Exception):  # this value failed, others of the call did not
                self.counters["errors"] += 1
                self._note(head, "get_into")
                head = None
            elif isinstance(head, bytes):
                self.counters["zero_copy_gets"] += 1
                self._got(name, len(head) + size)
            elif head is None:
                self._got(name, None)
            out.append(head)
        return out

    def _put(self, name: str, value, checked: bool) -> bool:
        if not checked and self.store.exists([name])[0]:  # another node put it: save the upload
            return False
        self.store.put(name, value)
        return True

    def dropped_corrupt(self, ns: bytes, key: bytes, why: str = "") -> None:
        """A value that failed verification: counted, forgotten, deleted from the store, and
        no hit of a lookup for ``BAD_HOLD_S`` (not fetched and counted again meanwhile)."""
        name = self.name(ns, key)
        self.counters["corrupt"] += 1
        self.forget(name)
        self.bad[name] = time.monotonic() + BAD_HOLD_S
        self.bad.move_to_end(name)
        if len(self.bad) > KNOWN_NAMES:
            self.bad.popitem(last=False)
        log.warning("remote chunk %s failed verification (%s): dropped", name, why or "corrupt")
        if self.breaker.allow():
            asyncio.ensure_future(self._delete(name))

    async def _delete(self, name: str) -> None:
        try:
            await self.call(self.store.delete, name)
        except RemoteUnavailable:
            pass

    def remember(self, name: str) -> None:
        self.known[name] = None
        self.known.move_to_end(name)
        if len(self.known) > KNOWN_NAMES:
            self.known.popitem(last=False)

    def forget(self, name: str) -> None:
        self.known.pop(name, None)

    def stats(self) -> dict:
        c = self.counters
        out = {"backend": self.store.name, "address": self.store.address, "prefix": self.prefix,
               "breaker": self.breaker.state, "breaker_opened": self.breaker.opened,
               "last_error": self.last_error, "threads_busy": self.net.busy,
               "zero_copy": getattr(self.store, "zero_copy", False)}
        return {**out, **{name: c[name] for name in (
            "exists_calls", "gets", "get_bytes", "gets_missing", "puts", "put_bytes",
            "puts_present", "puts_failed", "corrupt", "errors", "timeouts", "skipped", "busy",
            "probes", "probe_failures", "zero_copy_puts", "zero_copy_gets")}}
