"""One error hierarchy for kvd, shared by the daemon and the client.

``TransportError`` means the daemon could not be reached or did not answer
in time: the request may or may not have run. ``ServerError`` means the
daemon answered with a typed error (``code`` is the wire code): the request
did not change anything unless the error says otherwise. ``ConfigError`` is
a bad configuration key or value.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""


class ConfigError(KvdError):
    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class TransportError(KvdError):
    """The daemon is unreachable, gone or too slow."""


class DaemonUnavailable(TransportError):
    pass


class Timeout(TransportError):
    pass


class ServerError(KvdError):
    """A typed error reply from the daemon."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequest(ServerError):
    code = "bad_request"


class VersionMismatch(ServerError):
    code = "bad_version"


class UnknownOp(ServerError):
    code = "unknown_op"


class NoSession(ServerError):
    code = "no_session"


class NotFound(ServerError):
    code = "not_found"


class Forbidden(ServerError):
    code = "forbidden"


class OutOfRange(ServerError):
    code = "out_of_range"


class NoSpace(ServerError):
    code = "no_space"


class OverQuota(NoSpace):
    """A store (or promotion) would pass its quota group's ``host_max`` even after evicting
    every evictable chunk of that group: nothing was stored or evicted. A ``NoSpace``, so
    code that treats a full tier as a miss treats this one alike."""

    code = "over_quota"


class TooLarge(ServerError):
    code = "too_large"


class ShuttingDown(ServerError):
    code = "shutting_down"


class CopyFailed(ServerError):
    code = "copy_failed"


class DeadlineExceeded(ServerError):
    code = "deadline_exceeded"


class Busy(ServerError):
    """The client has ``max_inflight`` requests in flight already: nothing was done."""

    code = "busy"


class Cancelled(ServerError):
    """The client cancelled the load (its cancel word), or the request was dropped
    because its session ended: nothing of it was kept."""

    code = "cancelled"


SERVER_ERRORS = {cls.code: cls for cls in (
    ServerError, BadRequest, VersionMismatch, UnknownOp, NoSession, NotFound, Forbidden,
    OutOfRange, NoSpace, OverQuota, TooLarge, ShuttingDown, CopyFailed, DeadlineExceeded, Busy, Cancelled)}


def server_error(code: str, message: str) -> ServerError:
    """The exception class for a wire error code (unknown codes stay ServerError)."""
    cls = SERVER_ERRORS.get(code, ServerError)
    return cls(message, code=code)
