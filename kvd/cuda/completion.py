"""When a queued GPU copy landed, and what the debug log says of it.

Contract:

- ``completion(cp, poller, stream, what, plan, how, t0, start=None,
  then=None)`` records an event on ``stream`` after a copy queued there and
  returns the poller's future for it (kvd.copy.poll: resolves once the event
  completed, fails on a CUDA error; ``then`` is called with it when it
  does). With debug logging on, the copy's landing is logged: its
  direction, chunks, MB, how it went, the host time from ``t0`` (a
  ``perf_counter`` before queuing) to the end of queuing and to the landing
  seen by the poller, and ``began`` (``t0``, monotonic as the request lines).
  ``done`` (an object with the poller's ``done``, ``stream`` None): what to
  wait for instead of an event recorded now, for a copy that another
  thread queues (``kvd.cuda.dma.hand.Handed``).
- ``gpu_start(cp, stream)``: with debug logging on, a timing event recorded
  on ``stream`` before a copy is queued there (else None). Passed as
  ``start``, the log line adds the copy's time on the GPU, from when
  ``stream`` reached it (past whatever was queued before) to its end: a copy
  slow there is the copy engines', a copy that only waited is the host's
  (``tools/daemon_timings.py --phases``). Without debug logging nothing is
  timed (timing events cost the driver more than plain ones).
- ``failed_after(landed, exc)``: for a copy that failed part-way through
  queuing (a driver call refused): a future that fails with ``exc`` only
  once ``landed`` (the part that was queued, and the load's done word after
  it) completed, or ``landed`` itself when ``exc`` is None. Failing at once
  instead would let the service release the load's waits from the host,
  and the engine reuse pages that a queued copy still writes.
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
