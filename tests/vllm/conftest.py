"""The ``engines`` fixture of the connector's part tests (tests/vllm/halves.py).

``engines`` starts a daemon with kvd chunks of ``halves.CHUNK`` tokens and
yields ``(daemon, make)``: ``make(name, **settings)`` builds an
``halves.Engine`` on it; every engine made is closed after the test (its
pool file removed from /dev/shm). At the end of the session the vLLM engine
server (tests/vllm/engine_forks.py), where an engine test started one, is
closed and its log removed.
"""

from __future__ import annotations

import engine_forks
import pytest
from halves import CHUNK, Engine


@pytest.fixture(scope="session", autouse=True)
def engine_server():
    yield
    engine_forks.close_shared()


@pytest.fixture
def engines(start_daemon):
    daemon = start_daemon(chunk_tokens=CHUNK)
    made = []

    def make(name="a", **settings):
        made.append(Engine(daemon.runtime_dir, name, **settings))
        return made[-1]

    yield daemon, make
    for e in made:
        e.close()
