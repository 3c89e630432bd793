"""The daemon's log lines: text for people, or JSON objects for log shippers.

``setup(level, fmt)`` configures the ``kvd`` logger on stderr: ``text``
(``<time> kvd <LEVEL> <message>``) or ``json`` (one object a line). ``PeerLimiter`` bounds
what one peer can make the daemon log: ``burst`` lines per peer per interval, the count held
back appended to its next, and ``summary`` lines of what was held back, over at most
``max_peers`` peers. ``peer_key(peer, cred)`` keys a line by the kernel's (uid, pid), which a
peer cannot renew as it renews a routing id; ``peer_name`` names a client in a line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s kvd %(levelname)s %(message)s"
OTHERS = "other peers"  # the shared allowance once max_peers peers are remembered
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "message": record.getMessage()}
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def peer_name(peer: bytes, cred) -> str:
    """A client as a log line names it: its kernel credentials, else its ZeroMQ routing id."""
    if cred is not None:
        return f"pid {cred.pid} uid {cred.uid}"
    return f"routing id {peer[:8].hex()}"


def peer_key(peer: bytes, cred):
    """What a peer-triggered line is limited by: (uid, pid), else the routing id."""
    return (cred.uid, cred.pid) if cred is not None else peer


class PeerLimiter:
    def __init__(self, interval_s: float = 10.0, max_peers: int = 4096, clock=time.monotonic,
                 burst: int = 1):
        self.interval_s, self.max_peers, self.clock = interval_s, max_peers, clock
        self.burst = burst
        # peer -> [when its interval began, lines held back since its last line, lines written
        # this interval]; oldest interval first
        self._peers: dict = {}
        self.held: Counter = Counter()  # peer -> lines held back since the last summary
        self.summarized = clock()

    def allow(self, peer, burst: int | None = None) -> int | None:
        """None: hold this peer's line back; else write it, with this many held back before
        (``burst``: this kind of line's allowance per interval, if not the limiter's)."""
        now = self.clock()
        entry = self._peers.get(peer)
        if entry is not None and now - entry[0] < self.interval_s:
            if entry[2] < (self.burst if burst is None else burst):
                entry[2] += 1
                held, entry[1] = entry[1], 0
                return held
            entry[1] += 1
            if len(self.held) < self.max_peers or peer in self.held:
                self.held[peer] += 1
            else:
                self.held[OTHERS] += 1
            return None
        if entry is None and peer != OTHERS and not self._room(now):
            return self.allow(OTHERS)
        self._peers.pop(peer, None)  # re-inserted last: the dict stays ordered by time
        self._peers[peer] = [now, 0, 1]
        return 0 if entry is None else entry[1]

    def summary(self, logger: logging.Logger, level: int = logging.WARNING, most: int = 5) -> None:
        """One line of the lines held back since the last summary, if any."""
        now, held = self.clock(), self.held
        self.held = Counter()
        since, self.summarized = now - self.summarized, now
        if not held:
            return
        top = ", ".join(f"{_describe(peer)}: {n}" for peer, n in held.most_common(most))
        rest = f" and {len(held) - most} more peers" if len(held) > most else ""
        logger.log(level, "held back %d log lines about peers in the last %.0f s (%s%s)",
                   sum(held.values()), since, top, rest)

    def _room(self, now: float) -> bool:
        """Whether one more peer may be remembered: forgets the peers with the oldest lines
        whose interval has passed (their held-back counts are never reported)."""
        while len(self._peers) >= self.max_peers:
            oldest = next(iter(self._peers))
            if now - self._peers[oldest][0] < self.interval_s:
                return False
            del self._peers[oldest]
        return True

    def log(self, logger: logging.Logger, level: int, peer, msg: str, *args,
            burst: int | None = None, **kwargs) -> None:
        """``logger.log(level, msg, *args)`` unless ``peer`` had its lines this interval."""
        held = self.allow(peer, burst)
        if held is None:
            return
        if held:
            msg, args = msg + " (%d more like it held back)", (*args, held)
        logger.log(level, msg, *args, **kwargs)


def _describe(peer) -> str:
    if isinstance(peer, tuple) and len(peer) == 2 and all(isinstance(p, int) for p in peer):
        return f"uid {peer[0]} pid {peer[1]}"
    if isinstance(peer, tuple) and len(peer) == 2 and isinstance(peer[1], int):
        return f"{peer[0]} uid {peer[1]}"
    if isinstance(peer, bytes):
        return f"routing id {peer[:8].hex()}"
    return str(peer)
