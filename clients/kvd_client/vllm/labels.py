"""What the scheduler labels a request's chunks with, and which keys it does not offer.

``salt(settings, request)``: text mixed into the chunk keys (configured ``salt``,
``cache_salt`` with ``salt_per_request``, LoRA with ``salt_lora``), or None.
``tenant(settings, request)``: the quota label of its stores. ``FailedKeys``: keys whose load
failed, not offered again until their time is up (bounded by ``MAX_FAILED_KEYS``).
Nothing here imports vLLM.
"""

from __future__ import annotations

import time

from kvd_protocol.wire import tenant_label

MAX_FAILED_KEYS = 1 << 16


def salt(s, request) -> str | None:
    parts = [s.salt] if s.salt else []
    if s.salt_per_request and getattr(request, "cache_salt", None):
        parts.append(f"request:{request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if s.salt_lora and lora is not None:
        parts.append(f"lora:{lora.lora_name}")
    return "\x1f".join(parts) or None


def tenant(s, request) -> str | None:
    cache_salt = getattr(request, "cache_salt", None) if s.salt_per_request else None
    return tenant_label(cache_salt or s.salt)


class FailedKeys:
    def __init__(self):
        self.until: dict[bytes, float] = {}   # key -> when it may be offered again

    def before(self, keys: list[bytes]) -> int:
        """How many of ``keys`` come before the first one not to offer yet."""
        now = time.monotonic()
        for i, key in enumerate(keys):
            until = self.until.get(key)
            if until is not None:
                if until > now:
                    return i
                del self.until[key]
        return len(keys)

    def add(self, keys, for_s: float) -> None:
        if len(self.until) + len(keys) > MAX_FAILED_KEYS:
            self.until.clear()
        self.until.update(dict.fromkeys(keys, time.monotonic() + for_s))
