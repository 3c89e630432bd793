"""Offloads: the linker's stores in SGLang's order, their GPU slot ids read without a device sync.

SGLang calls the linker's ``offload`` on its scheduler thread with the pages' slot ids in a GPU
tensor that the current stream may still be computing. Reading it there (``tolist``) would
wait for the GPU and take away the scheduler's overlap with the forward. ``add`` copies GPU ids
to pinned host memory on the current stream behind an event and returns; ``poll`` (SGLang asks
on every scheduler step) submits, in order, each store whose ids arrived, and counts finished
offloads from the front. Ids already in host memory are submitted at once. Ids that have not
arrived within ``timeout_s`` fail their offload. ``pop`` takes the oldest finished one: whether
every page was stored. Nothing here raises into SGLang: a store that cannot be sent fails.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvd_protocol.errors import KvdError


@dataclass
class Offload:
    keys: object           # the pages' chunk keys (ChunkKeys)
    pages: int             # SGLang pages asked
    tokens: int            # tokens asked
    ids: object = None     # slot ids not yet submitted: host tensor or list
    ready: object = None   # the event after which ``ids`` may be read (None: readable now)
    deadline: float = 0.0
    transfer: object = None
    failed: bool = False
    noop: bool = False     # nothing to store (an MLA rank other than 0): done, a success

    @property
    def done(self) -> bool:
        return self.noop or self.failed or (self.transfer is not None and self.transfer.done)

    @property
    def ok(self) -> bool:
        return self.noop or (not self.failed and self.transfer.ok and self.transfer.tokens >= self.tokens)


class Offloads:
    def __init__(self, submit, timeout_s: float):
        self.submit = submit  # (keys, host slot ids, pages) -> Transfer, or None when refused
        self.timeout_s = timeout_s
        self.queue: deque[Offload] = deque()

    def add_noop(self) -> None:
        self.queue.append(Offload(None, 0, 0, noop=True))

    def add(self, keys, device_indices, pages: int, tokens: int) -> None:
        entry = Offload(keys, pages, tokens, deadline=time.monotonic() + self.timeout_s)
        if getattr(device_indices, "is_cuda", False):
            import torch  # only here: the queue itself needs no torch

            entry.ids = torch.empty(device_indices.shape, dtype=device_indices.dtype, pin_memory=True)
            entry.ids.copy_(device_indices, non_blocking=True)
            entry.ready = torch.cuda.Event()
            entry.ready.record()
        else:
            entry.ids = device_indices
        self.queue.append(entry)
        self._submit_ready()

    def poll(self) -> int:
        """Submits the stores whose ids arrived; how many offloads at the front are done."""
        self._submit_ready()
        done = 0
        for entry in self.queue:
            if not entry.done:
                break
            done += 1
        return done

    def pop(self) -> Offload:
        return self.queue.popleft()

    def _submit_ready(self) -> None:
        now = time.monotonic()
        for entry in self.queue:
            if entry.ids is None:
                continue
            if entry.ready is not None and not entry.ready.query():
                if now < entry.deadline:
                    return  # later ids come later on the same stream
                entry.failed, entry.ids = True, None
                continue
            ids, entry.ids, entry.ready = entry.ids, None, None
            try:
                entry.transfer = self.submit(entry.keys, ids, entry.pages)
            except (KvdError, ValueError):  # a store that cannot be sent is a failed offload
                entry.transfer = None
            entry.failed = entry.transfer is None

    def wait_all(self) -> None:
        """Waits for the submitted stores; drops the ones never submitted."""
        for entry in self.queue:
            if entry.transfer is not None:
                entry.transfer.wait()
        self.queue.clear()
