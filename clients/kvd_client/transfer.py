"""A store or load in flight: how it ended, and when its pages are the engine's again.

``Transfer`` (from ``submit_store``/``submit_load``): ``status`` pending -> ok | failed
(``error``: a kvd_protocol.errors exception), ``tokens`` what landed. ``done`` is true once
it ended and is fenced: the daemon will never again read (store) or write (load) its pages.
A store and a successful load are fenced by their reply; a failed load once the daemon
wrote the done word, died, or ``fence_quiet_s`` passed after the cancel word. Before the
fence every stream wait on a failed load is released, so it never stalls the engine; its
pages hold undefined bytes. ``wait(timeout)`` drives the client until done.
"""

from __future__ import annotations

import threading
import time


class Transfer:
    def __init__(self, client, op: str, reg, keys: list, pages: bytes, deadline: float,
                 slot: int | None = None, seq: int | None = None, layerwise: bool = False):
        self._client = client
        self.op = op
        self.reg = reg
        self.keys = keys
        self.pages = pages
        self.deadline = deadline  # CLOCK_MONOTONIC seconds
        self.slot, self.seq, self.layerwise = slot, seq, layerwise
        self.tail_pages = 0  # a load of only the first pages of its last chunk
        self.part_tokens = 0  # a store or load of one partial entry of this many tokens
        self.status = "pending"
        self.tokens = 0
        self.error: Exception | None = None
        self.req_id: int | None = None
        self.sent_under = 0  # the client's hello count when it was sent (KvdClient.session_lost)
        self.attempts = 0
        self.fence_at: float | None = None  # failed load: fenced by this time at the latest
        self._done = threading.Event()

    @property
    def chunks(self) -> int:
        return len(self.keys)

    def tokens_of(self, chunks: int) -> int:
        """Tokens in the first ``chunks`` chunks of the transfer (a partial load's last chunk:
        its ``tail_pages`` pages)."""
        if self.part_tokens:
            return self.part_tokens * chunks
        tokens = chunks * self.reg.namespace.chunk_tokens
        tail = self.tail_pages
        if tail and chunks == len(self.keys):
            ps = self.reg.pool.descriptor.page_size
            tokens -= self.reg.namespace.chunk_tokens - tail * ps
        return tokens

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def done(self) -> bool:
        """Ended and fenced: the pages are the engine's again."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Drive the client until this transfer is done (or ``timeout`` passed)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._client.progress(self, left)
        return self

    # ---- state changes (the client's lock is held) -----------------------------------

    def succeed(self, tokens: int) -> None:
        self.status, self.tokens = "ok", tokens
        self._done.set()

    def fail(self, error: Exception) -> None:
        if self.status != "pending":
            return
        self.status, self.error = "failed", error
        if self.op == "store" or self.seq is None:
            self._done.set()  # the daemon never touches a store's pages after it ended

    def fence(self) -> None:
        self._done.set()

    def __repr__(self) -> str:
        state = self.status + ("" if self.done else ", fencing" if self.status == "failed" else "")
        return (f"<Transfer {self.op} {self.chunks} chunks {state} tokens={self.tokens}"
                f"{'' if self.error is None else f' error={self.error!r}'}>")
