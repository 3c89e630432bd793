"""When a queued GPU copy landed, and what the debug log says of it.

``completion(...)`` records an event after a copy on ``stream`` (or takes ``done`` of a
copy another thread queues) and returns the poller's future, logging at debug level the
copy's direction, size, how it went and host times. ``gpu_start`` records a timing event
before a copy only with debug logging on (timing events cost the driver more).
``failed_after(landed, exc)``: a future that fails only once the part already queued
landed. Never fails a partly queued copy at once: the engine would reuse pages a queued
copy still writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("kvd")


def gpu_start(cp: Any, stream: Any) -> Any:
    if not log.isEnabledFor(logging.DEBUG):
        return None
    start = cp.cuda.Event(block=False, disable_timing=False)
    start.record(stream)
    return start


def completion(cp: Any, poller: Any, stream: Any, what: str, plan: Any, how: str, t0: float,
               start: Any = None, then: Any = None, done: Any = None) -> asyncio.Future:
    if done is None:
        done = cp.cuda.Event(block=False, disable_timing=start is None)
        done.record(stream)
    enqueued = time.perf_counter()
    future = poller.wait(done)
    if then is not None:
        future.add_done_callback(then)
    if log.isEnabledFor(logging.DEBUG):
        nbytes = len(plan.shard_offsets) * plan.layout.shard_bytes(plan.chunk_tokens)

        def landed(_) -> None:
            took = time.perf_counter() - t0
            on_gpu = "" if start is None else \
                f", on the GPU {cp.cuda.get_elapsed_time(start, done):.3f} ms"
            log.debug("%s of %d chunks, %.1f MB, %s: enqueued in %.3f ms, landed after %.3f ms "
                      "(%.1f GB/s), began %.6f%s", what, len(plan.shard_offsets), nbytes / 1e6,
                      how, (enqueued - t0) * 1e3, took * 1e3, nbytes / took / 1e9, t0, on_gpu)
        future.add_done_callback(landed)
    return future


def failed_after(landed: asyncio.Future, exc: BaseException | None) -> asyncio.Future:
    if exc is None:
        return landed

    async def fail() -> None:
        await asyncio.gather(landed, return_exceptions=True)
        raise exc
    return asyncio.ensure_future(fail())
