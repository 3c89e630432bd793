"""SIGINT and SIGTERM that arrive before the daemon's event loop handles them.

``kvd serve`` calls ``record()`` first, before its heavy imports: from then
on the two signals only note themselves (``pending()``) instead of raising
KeyboardInterrupt mid-import or ending the process before it can clean up.
(CPython drops a KeyboardInterrupt raised inside some callbacks, such as an
import lock's weakref callback — "Exception ignored in ..." — which left a
daemon that had been told to stop starting up and serving anyway.) The
daemon installs its event-loop handlers, then acts on ``pending()``; after
the loop ends it calls ``record()`` again, so a signal during the final
clean-up cannot cut it short.
"""

from __future__ import annotations

import _signal  # built in and loaded already: ``signal`` takes a while to import (enums)

_received: list = []


def record() -> None:
    for sig in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(sig, _note)


def _note(signum, frame) -> None:
    _received.append(signum)


def pending():
    """The first signal noted since ``record()`` (a ``signal.Signals``), or None."""
    if not _received:
        return None
    import signal
    return signal.Signals(_received[0])
