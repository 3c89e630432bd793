"""The real stores of the remote tier's tests: kvd/bench/stores.py (shared with ``kvd bench
--remote``). ``running(backend)`` is a store for a fixture (skipped, with the reason, where it
cannot run here); ``remote_knobs(store)`` the daemon knobs and environment of a node on it."""

import pytest

from kvd.bench.stores import (  # noqa: F401 - re-exported for the tests
    MooncakeMaster,
    RedisServer,
    Server,
    free_port,
    mooncake_env,
    mooncake_master_path,
    wait_port,
)

SERVERS = {"redis": RedisServer, "mooncake": MooncakeMaster}


def running(backend: str):
    """Generator for a fixture: the started store (``.backend`` names it), stopped after."""
    cls = SERVERS[backend]
    why = cls.missing()
    if why:
        pytest.skip(why)
    server = cls().start()
    server.backend = backend
    yield server
    server.stop()


def remote_knobs(store, segment: str = "32MiB", buffer: str = "16MiB", **knobs) -> tuple[dict, dict | None]:
    """(daemon knobs, environment) of a node whose remote tier is on ``store``; ``knobs`` add
    to or override them (``remote_prefix``, ``remote_timeout_s``, ...)."""
    if store.backend == "redis":
        return {"remote_backend": "redis", "remote_address": store.url, **knobs}, None
    return {"remote_backend": "mooncake", "remote_address": store.address,
            "remote_mooncake_metadata": store.metadata, "remote_mooncake_local_host": "127.0.0.1",
            "remote_mooncake_segment_bytes": segment, "remote_mooncake_buffer_bytes": buffer,
            **knobs}, mooncake_env()
