"""A pool of daemon threads for calls that may hang (a remote store that stopped answering).

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the
interpreter exits, so one call stuck in a store client would keep a stopping
daemon alive forever. These threads are daemon threads: the process exits
whatever they wait on. ``submit(fn, *args)`` returns a
``concurrent.futures.Future``; ``busy`` counts calls submitted and not yet
finished (queued or running, abandoned ones included), so callers can refuse
work instead of queueing it behind hung calls. ``close()`` stops idle
threads; a thread still inside a call ends with the process.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DaemonThreads:
    def __init__(self, threads: int, name: str):
        self.size = threads
        self.name = name
        self.busy = 0  # changed under the lock: submit runs on the loop, the decrement on a worker
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn, *args) -> Future:
        if self._closed:
            raise RuntimeError(f"{self.name} threads are closed")
        fut: Future = Future()
        with self._lock:
            self.busy += 1
            if len(self._threads) < min(self.busy, self.size):  # start threads as work needs them
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            result, error = None, None
            running = fut.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    error = exc
            with self._lock:  # not busy any more before the waiter hears of it
                self.busy -= 1
            if running:
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)
                del result, error

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
