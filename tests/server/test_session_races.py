"""Requests that race the end of their session or registration, pipelined on one routing id.

An engine may send its next request before the previous one is answered; a
hostile or confused one may send ``hello`` twice in a row. Whatever the
order in which the daemon serves them: one routing id has at most one live
session, a replaced session keeps no registrations (nothing stays mapped
after ``bye``), and a load that races ``unregister`` ends with its result
or a typed error, never ``internal``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rawwire import Raw, pages, register_fields

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.runtime import engine_endpoint

GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")  # layers, pages, page size, heads, dim
KEYS = bytes(range(16)) + bytes(range(16, 32))  # 2 chunks of 4 pages each


@pytest.fixture
def pool():
    """An engine pool with a flag page of 8 load slots, filled with random bytes."""
    p = kvd_client.SharedKVPool(*GEOMETRY)
    p.raw[:] = np.random.default_rng(5).integers(0, 256, p.raw.size, dtype=np.uint8)
    p.flags = ClientFlags(p.num_layers, 8)
    yield p
    p.flags.close()
    p.close()


def _mapped(daemon, pool) -> list[str]:
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text().splitlines()
    names = (Path(pool.path).name, Path(pool.flags.path).name)
    return [line for line in maps if any(name in line for name in names)]


def _code(reply) -> str:
    return "ok" if "result" in reply else reply["error"]["code"]


def test_hello_twice_while_reaping_leaves_no_session_behind(daemon, zctx, pool):
    """store (waiting on the engine's mark), hello, hello, register, sent at once: the
    first hello reaps the old session while the second hello and the register run."""
    raw = Raw(engine_endpoint(daemon.runtime_dir), zctx)
    for _ in range(3):
        raw.hello()
        reg = raw.register(pool)
        ids = [raw.post("store", [KEYS, pages(*range(8))], reg=reg, after=5),  # never reached
               raw.post("hello", client="raw", pid=1, versions=[2]),
               raw.post("hello", client="raw", pid=1, versions=[2]),
               raw.post("register", **register_fields(pool))]
        replies = raw.replies(len(ids))
        assert sorted(replies) == ids, replies
        assert _code(replies[ids[0]]) == "cancelled"
        assert [_code(replies[i]) for i in ids[1:]] == ["ok", "ok", "ok"], replies
        raw.ok("bye")
        stats = daemon.stats()
        assert (stats["clients"], stats["registrations"]) == (0, 0), stats["sessions"]
        assert not _mapped(daemon, pool)
    raw.close()


def test_load_racing_unregister_is_never_internal(daemon, zctx, pool):
    """2,000 loads, each followed at once by the unregister of its registration or by a
    new hello (which closes it too): every load ends loaded, cancelled or not_found."""
    raw = Raw(engine_endpoint(daemon.runtime_dir), zctx)
    raw.hello()
    reg = raw.register(pool)
    assert raw.ok("store", [KEYS, pages(*range(8))], reg=reg) == {"stored": 2, "deduped": 0}
    codes: dict[str, int] = {}
    for i in range(2000):
        reg = raw.register(pool)
        load = raw.post("load", [KEYS, pages(*range(8, 16))], reg=reg, slot=i % 8, seq=i + 1)
        if i % 2:
            raw.post("unregister", reg=reg)
        else:
            raw.post("hello", client="raw", pid=1, versions=[2])
        replies = raw.replies(2)
        assert len(replies) == 2, "a reply is missing"
        code = _code(replies[load])
        codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {"ok", "cancelled", "not_found"}, codes
    assert codes.get("ok", 0) > 0, codes
    raw.ok("bye")
    assert daemon.stats()["registrations"] == 0
    assert not _mapped(daemon, pool)
    raw.close()
