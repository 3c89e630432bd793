"""Bad sessions and registrations on the wire: a raw ZeroMQ DEALER against a real daemon.

As in tests/server/test_bad_input.py (bad requests), a well-behaved client
(tests/good_engine.py) stores chunks first and must find the daemon healthy
and its chunks intact afterwards. Covered here: ops before ``hello``, other
clients' registrations and leases, ids nobody holds; ``register``'s buffers
(paths, sizes, kinds), layouts and namespaces, and counts beyond the caps
of kvd_protocol.limits.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from good_engine import KEY, TOKENS, engine
from rawwire import layout, namespace, pages, register_fields
from shm_files import arena_files

import kvd_client


# ---- sessions and ownership ------------------------------------------------------

def test_sessions_and_ownership(daemon, good, zctx, raw_pool):
    keys = b"".join(good.keys)
    hits, lease = good.client.lookup_lease(TOKENS, 60_000)
    assert hits == 64 and lease is not None
    # Before hello, every op is refused, even well-formed ones naming real ids.
    stranger = engine(daemon, zctx)
    stranger.fails("no_session", "heartbeat")
    stranger.fails("no_session", "bye")
    stranger.fails("no_session", "lookup", [keys], reg=good.reg.id)
    stranger.fails("no_session", "store", [keys, pages(*range(16))], reg=good.reg.id)
    stranger.fails("no_session", "load", [keys, pages(*range(16))], reg=good.reg.id, lease=lease)
    stranger.fails("no_session", "release", lease=lease)
    stranger.fails("no_session", "unregister", reg=good.reg.id)
    stranger.fails("no_session", "register", **register_fields(raw_pool))
    # After hello: another client's registration and lease are forbidden.
    raw = engine(daemon, zctx)
    raw.hello()
    mine = raw.register(raw_pool)
    raw.fails("forbidden", "lookup", [keys], reg=good.reg.id, lease_ms=60_000)
    raw.fails("forbidden", "store", [KEY, pages(0, 1, 2, 3)], reg=good.reg.id)
    raw.fails("forbidden", "load", [keys, pages(*range(16, 32))], reg=good.reg.id)
    raw.fails("forbidden", "unregister", reg=good.reg.id)
    raw.fails("forbidden", "release", lease=lease)
    raw.fails("forbidden", "load", [keys, pages(*range(16))], reg=mine, lease=lease)
    assert not raw_pool.raw.any()  # the forbidden load copied nothing
    # Ids nobody holds.
    for unknown in (0, 999_999, 2**63 - 1):
        raw.fails("not_found", "lookup", [keys], reg=unknown)
        raw.fails("not_found", "store", [KEY, pages(0, 1, 2, 3)], reg=unknown)
        raw.fails("not_found", "load", [keys, pages(*range(16))], reg=unknown)
        raw.fails("not_found", "unregister", reg=unknown)
        raw.fails("not_found", "release", lease=unknown)
        raw.fails("not_found", "load", [keys, pages(*range(16))], reg=mine, lease=unknown)
    assert not raw_pool.raw.any()
    # A registration is gone after unregister; a session is gone after bye.
    raw.ok("unregister", reg=mine)
    raw.fails("not_found", "lookup", [keys], reg=mine)
    raw.ok("bye")
    raw.fails("no_session", "heartbeat")
    # The good client's lease survived every attempt on it and still works, once.
    assert daemon.stats()["leases"] == 1
    assert good.client.load(TOKENS, np.arange(16, 32), lease=lease) == 64
    with pytest.raises(kvd_client.ServerError) as err:
        good.client.release(lease)  # consumed by the load
    assert err.value.code == "not_found"
    stranger.close()
    raw.close()
    good.assert_intact(stranger.errors + raw.errors + 1)


# ---- register: buffers, layouts, namespaces -------------------------------------

@pytest.fixture
def shm_junk():
    """Paths under /dev/shm for bad buffers; all removed afterwards."""
    made = []

    def path(name: str) -> Path:
        p = Path("/dev/shm") / f"kvd-test-{os.getpid()}-{name}"
        made.append(p)
        return p

    yield path
    for p in made:
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)


def test_register_rejects_bad_buffers(daemon, good, zctx, raw_pool, shm_junk, tmp_path):
    raw = engine(daemon, zctx)
    raw.hello()
    size = raw_pool.size

    def bad_buffer(code, **buf):
        fields = register_fields(raw_pool)
        fields["buffers"] = [{**fields["buffers"][0], **buf}]
        return raw.fails(code, "register", **fields)

    outside = tmp_path / "pool"
    outside.write_bytes(bytes(size))
    bad_buffer("bad_request", path=str(outside))                                # not in /dev/shm
    bad_buffer("bad_request", path=raw_pool.path.name)                          # relative
    bad_buffer("bad_request", path=f"/dev/shm/../..{outside}")                  # escapes by ..
    link = shm_junk("link")
    link.symlink_to(raw_pool.path)
    bad_buffer("bad_request", path=str(link))                                   # symlink
    linkdir = shm_junk("linkdir")
    linkdir.symlink_to(tmp_path)
    bad_buffer("bad_request", path=str(linkdir / "pool"))                       # via a dir link
    bad_buffer("bad_request", path=str(shm_junk("missing")))                    # nonexistent
    subdir = shm_junk("dir")
    subdir.mkdir()
    bad_buffer("bad_request", path=str(subdir))                                 # a directory
    fifo = shm_junk("fifo")
    os.mkfifo(fifo, 0o600)
    bad_buffer("bad_request", path=str(fifo))                                   # not a file
    small = shm_junk("small")
    small.write_bytes(bytes(4096))
    bad_buffer("bad_request", path=str(small))                                  # file too small
    arena, index = arena_files(daemon.runtime_dir)
    bad_buffer("bad_request", path=str(arena))                                  # the daemon's own tier
    bad_buffer("bad_request", path=str(index))                                  # its index
    alias = shm_junk("alias")
    os.link(arena, alias)
    bad_buffer("bad_request", path=str(alias))                                  # the tier, renamed
    bad_buffer("bad_request", size=size + 1)                                    # size > file
    bad_buffer("bad_request", size=0)
    bad_buffer("bad_request", size=2**62)
    bad_buffer("bad_request", size=-1)
    bad_buffer("bad_request", size=True)
    bad_buffer("bad_request", kind="nfs")
    bad_buffer("bad_request", kind="cuda_ipc")                                  # wrong keys
    bad_buffer("bad_request", extra=1)
    fields = register_fields(raw_pool)
    cuda = {"kind": "cuda_ipc", "handle": bytes(64), "offset": 0, "size": size, "device_uuid": "x"}
    raw.fails("bad_request", "register", **{**fields, "buffers": [cuda]})        # host backend
    for buffers in [[], fields["buffers"] * 7, "x", [None], [[1, 2]], {"kind": "shm"}]:
        raw.fails("bad_request", "register", **{**fields, "buffers": buffers})
    # The layout must fit its buffers (a file that is large enough does not help).
    raw.fails("bad_request", "register", **{**fields, "buffers": [{**fields["buffers"][0],
                                                                   "size": size - 256}]})
    raw.fails("bad_request", "register", **{**fields, "buffers": [{**fields["buffers"][0],
                                                                   "path": str(small), "size": 4096}]})
    assert not _mapped(daemon, "kvd-test-") and not _mapped(daemon, raw_pool.path.name)
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


def test_register_rejects_bad_layouts_and_namespaces(daemon, good, zctx, raw_pool):
    raw = engine(daemon, zctx)
    raw.hello()
    d = raw_pool.descriptor
    fields = register_fields(raw_pool)

    def bad_layout(**over):
        raw.fails("bad_request", "register", **{**fields, "layout": layout(raw_pool, **over)})

    def bad_ns(**over):
        raw.fails("bad_request", "register", **{**fields, "namespace": namespace(raw_pool, **over)})

    # Layouts that reach past the buffer.
    bad_layout(num_pages=d.num_pages + 1)
    bad_layout(page_stride=d.page_stride * 2)
    bad_layout(token_stride=d.page_stride)
    bad_layout(page_stride=2**62)
    bad_layout(bases=[[0, off + raw_pool.size] for _, off in d.bases])
    bad_layout(bases=[[0, 0]] * (len(d.bases) - 1) + [[0, raw_pool.size - 1]])
    bad_layout(bases=[[1, off] for _, off in d.bases])          # a buffer not registered
    # Malformed layouts.
    bad_layout(bases=[list(b) for b in d.bases][:-1])
    bad_layout(bases=[[0, -1]] * len(d.bases))
    bad_layout(bases=[[0]] * len(d.bases))
    bad_layout(bases=[[0, 0, 0]] * len(d.bases))
    bad_layout(bases="0")
    bad_layout(planes=3)
    bad_layout(num_layers=0)
    bad_layout(num_pages=0)
    bad_layout(row_bytes=0)
    bad_layout(page_size=True)
    bad_layout(num_layers=10**6)
    raw.fails("bad_request", "register", **{**fields, "layout": {**layout(raw_pool), "x": 1}})
    raw.fails("bad_request", "register", **{**fields, "layout": [1, 2]})
    # Head-strided rows (32-byte rows of 2 heads) that are malformed or reach past the buffer.
    bad_layout(heads=0)
    bad_layout(heads=True)
    bad_layout(heads="2", head_stride=16)
    bad_layout(heads=3, head_stride=8)                           # 32 bytes in 3 pieces
    bad_layout(heads=257, row_bytes=257 * 32)                    # beyond MAX_KV_HEADS
    bad_layout(heads=2, head_stride=-16)
    bad_layout(heads=2, head_stride=2**60)
    bad_layout(heads=2, head_stride=d.page_stride * d.num_pages)  # the last piece: past the end
    bad_layout(heads=4, head_stride=8)                           # pieces of half a head
    # Layouts that fit the buffer but not the namespace.
    bad_layout(row_bytes=d.row_bytes // 2)                       # rows: heads x dim x dtype
    bad_ns(head_dim=16)
    bad_ns(kv_dtype="float32")
    bad_ns(num_layers=1)                                         # layers
    bad_layout(num_layers=1, bases=[list(b) for b in d.bases][:2])
    bad_ns(attention="mla", kv_heads=1)                           # 1 plane expected
    bad_layout(page_size=3, token_stride=d.token_stride, num_pages=d.num_pages)  # 16 % 3
    bad_layout(page_size=32)                                     # larger than a chunk
    raw.fails("bad_request", "register", **{**fields, "tp_rank": 1})              # tp_rank >= tp_size
    raw.fails("bad_request", "register", **{**fields, "tp_rank": 4,
                                              "namespace": namespace(raw_pool, tp_size=4)})
    # Bad namespaces.
    bad_ns(model="")
    bad_ns(model="m" * 600)
    bad_ns(kv_dtype="float64")
    bad_ns(attention="gqa")
    bad_ns(attention="mla")                                      # MLA with 2 kv heads
    bad_ns(tp_size=0)
    bad_ns(num_layers=2**40)
    bad_ns(head_dim=-8)
    bad_ns(kv_heads="2")
    raw.fails("bad_request", "register", **{**fields, "namespace": {**namespace(raw_pool), "salt": "x"}})
    ns = namespace(raw_pool)
    del ns["tp_size"]
    raw.fails("bad_request", "register", **{**fields, "namespace": ns})
    raw.fails("bad_request", "register", **{**fields, "namespace": "good"})
    # The well-formed registration still works afterwards and is the only one added.
    reg = raw.register(raw_pool)
    assert raw.ok("lookup", [b"".join(good.keys)], reg=reg)["hits"] == 4
    assert daemon.stats()["registrations"] == 2
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


def test_register_refuses_counts_beyond_the_caps(daemon, good, zctx, raw_pool):
    """Namespaces and layouts that fit their buffer and agree with each other, but name
    counts no engine has (kvd_protocol.limits): refused before the daemon builds anything
    from them (a TP bitmask of 2**31 bits, loops over billions of pages)."""
    raw = engine(daemon, zctx)
    raw.hello()
    fields = register_fields(raw_pool)

    def refused(ns: dict, lay: dict, tp_rank: int = 0) -> str:
        return raw.fails("bad_request", "register", **{**fields, "tp_rank": tp_rank,
                                                       "namespace": namespace(raw_pool, **ns),
                                                       "layout": layout(raw_pool, **lay)})

    assert "tp_size" in refused({"tp_size": 65}, {}, tp_rank=64)
    assert "tp_size" in refused({"tp_size": 2**31 - 1}, {}, tp_rank=2**31 - 2)
    one_row = {"num_pages": 1, "page_stride": 0, "token_stride": 0}  # every token: one row
    assert "kv_heads" in refused({"kv_heads": 512, "head_dim": 8}, {**one_row, "row_bytes": 8192})
    assert "head_dim" in refused({"kv_heads": 1, "head_dim": 4096}, {**one_row, "row_bytes": 8192})
    assert "num_pages" in refused({}, {"num_pages": 2**33, "page_stride": 0})
    assert "page_stride" in refused({}, {"num_pages": 1, "page_stride": 2**60})
    assert "token_stride" in refused({}, {"num_pages": 1, "page_size": 1, "token_stride": 2**62})
    reg = raw.register(raw_pool)  # the well-formed registration is the only one added
    assert raw.ok("lookup", [b"".join(good.keys)], reg=reg)["hits"] == 4
    assert daemon.stats()["registrations"] == 2
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


def _mapped(daemon, needle: str) -> list[str]:
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    return [line for line in maps.splitlines() if needle in line]
