"""Value buffers reused across remote puts.

A fresh multi-MiB buffer per put costs the kernel's zeroing and a page fault
every 4 KiB, on the CPU threads that pack values: about a fifth of a put's
throughput on a 2-core VM (docs/cluster.md). ``take(n)`` gives a bytearray
of exactly ``n`` bytes, reused when one of that size was given back;
``give(buf)`` returns one whose put is finished. A buffer whose put failed
or timed out must never be given back: the abandoned call may still be
reading it (a reused buffer would send other bytes under a valid header).
At most ``per_size`` free buffers are kept per size and ``sizes`` sizes
(the least recently used size goes first): chunks of one namespace share
one size. Runs on the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict


class ValueBuffers:
    def __init__(self, per_size: int, sizes: int = 4):
        self.per_size = per_size
        self.sizes = sizes
        self.free: OrderedDict[int, list] = OrderedDict()

    def take(self, n: int) -> bytearray:
        free = self.free.get(n)
        return free.pop() if free else bytearray(n)

    def give(self, buf: bytearray) -> None:
        free = self.free.setdefault(len(buf), [])
        self.free.move_to_end(len(buf))
        if len(free) < self.per_size:
            free.append(buf)
        while len(self.free) > self.sizes:
            self.free.popitem(last=False)
