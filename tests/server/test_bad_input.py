"""Bad requests on the wire: a raw ZeroMQ DEALER against a real daemon.

Every test first has a well-behaved client (tests/good_engine.py) store
chunks, then sends bad requests through a bare DEALER socket (pyzmq +
msgpack, no kvd_client) and checks the typed error code of each reply; the
daemon must stay healthy, count exactly those errors, keep nothing of them,
and load the good client's chunks back bit-exact. Covered here: headers,
ops, fields and frame counts; keys and page-id frames (tail pages, partial
entries, a page named twice, too many keys); oversized messages and the
control socket. Sessions and register: tests/server/test_bad_register.py.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from good_engine import KEY, Good, engine
from rawwire import OMIT, Raw, namespace, pack, pages, register_fields

import kvd_client
from kvd_protocol.runtime import control_endpoint


# ---- headers --------------------------------------------------------------------

def test_malformed_headers(daemon, good, zctx):
    raw = engine(daemon, zctx)
    for garbage in [b"", b"\xc1", b"\x82\xa1v", b"\x01\x02", b"\xff" * 64,
                    np.random.default_rng(0).bytes(300),
                    pack({1: 2}), pack({"v": 2, "id": 1, "op": "hello", "x": [[[[[[0]]]]]] * 2})[:-3],
                    msgpack.packb(msgpack.ExtType(1, b"abc")),
                    pack({f"k{i}": i for i in range(100)}),  # more keys than any header has
                    b"\x91" * 100_000 + b"\xc0"]:  # nested 100k deep
        raw.fails_raw("bad_request", [garbage])
    for not_a_map in [[1, 2, 3], 7, "hello", None, True, b"bytes", 1.5]:
        raw.fails_raw("bad_request", [pack(not_a_map)])
    raw.fails_raw("too_large", [pack({"v": 2, "id": 5, "op": "hello", "client": "x" * 300_000})])
    # Wrong protocol versions; the id is still echoed where it can be read.
    for v in [0, 1, 3, -1, 2**64 - 1, "2", None, [2], 1.5, True, 2.0]:
        raw.fails_raw("bad_version", [pack({"v": v, "id": 11, "op": "heartbeat"})], req_id=11)
    raw.fails_raw("bad_version", [pack({"id": 12, "op": "heartbeat"})], req_id=12)
    message = raw.fails("bad_version", "hello", client="raw", pid=1, versions=[1])
    assert "speaks 2" in message  # a v1 client is told what to upgrade
    raw.fails("bad_version", "hello", client="raw", pid=1, versions=[3, 4])
    raw.fails("bad_version", "hello", client="raw", pid=1, versions=[])
    # Request ids that are not non-negative int64.
    for bad_id in [-1, True, 2**63, 2**64 - 1, "7", 1.0, None, [1]]:
        raw.fails_raw("bad_request", [pack({"v": 2, "id": bad_id, "op": "heartbeat"})])
    raw.fails_raw("bad_request", [pack({"v": 2, "op": "heartbeat"})])
    raw.close()
    good.assert_intact(raw.errors)


def test_fields_ops_and_frame_counts(daemon, good, zctx, raw_pool):
    raw = engine(daemon, zctx)
    raw.hello()
    reg = raw.register(raw_pool)
    for op in ["nope", "", "op_store", "__init__", "handle", "stats", "health", "clear", "HELLO"]:
        raw.fails("unknown_op", op)
    for op in [7, None, ["store"], {"x": 1}, True]:
        raw.fails_raw("unknown_op", [pack({"v": 2, "id": 21, "op": op})], req_id=21)
    raw.fails_raw("unknown_op", [pack({"v": 2, "id": 22})], req_id=22)
    keys = b"".join(good.keys)
    # Missing and unknown fields.
    raw.fails("bad_request", "lookup", [keys])
    raw.fails("bad_request", "store", [keys, pages(*range(16))])
    raw.fails("bad_request", "release")
    raw.fails("bad_request", "hello", client="raw", pid=1)
    raw.fails("bad_request", "register", namespace=namespace(raw_pool), tp_rank=0)
    raw.fails("bad_request", "lookup", [keys], reg=reg, extra=1)
    raw.fails("bad_request", "heartbeat", reg=reg)
    raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, lease_ms=5)
    # Wrong types: bool for int, negative, beyond int64, float, string, nil, containers.
    bad_ints = [True, False, -1, -2**63, 2**63, 2**64 - 1, 1.0, "1", None, [reg], {"reg": reg}]
    for value in bad_ints:
        raw.fails("bad_request", "lookup", [keys], reg=value)
        raw.fails("bad_request", "store", [keys, pages(*range(16))], reg=value)
        raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, lease=value)
        raw.fails("bad_request", "lookup", [keys], reg=reg, lease_ms=value)
        raw.fails("bad_request", "release", lease=value)
        raw.fails("bad_request", "unregister", reg=value)
        raw.fails("bad_request", "hello", client="raw", pid=value, versions=[2])
        raw.fails("bad_request", "register", **{**register_fields(raw_pool), "tp_rank": value})
    for value in [1, "yes", None]:
        raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, layerwise=value)
    for value in bad_ints + [2**32]:
        raw.fails("bad_request", "store", [keys, pages(*range(16))], reg=reg, after=value)
        raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, after=value)
        raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, seq=value)
        raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, slot=value)
    raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, slot=OMIT)
    raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg, seq=OMIT)
    for slot in (8, 9, 2**40):  # the pool's flag page has 8 load slots
        assert "slot" in raw.fails("bad_request", "load", [keys, pages(*range(16))], reg=reg,
                                   slot=slot)
    for value in [5, None, b"bytes", "s" * 5000, ["a"]]:
        raw.fails("bad_request", "lookup", [keys], reg=reg, salt=value)
        raw.fails("bad_request", "hello", client=value, pid=1, versions=[2])
    for value in ["1", 1, {"v": 1}, None]:
        raw.fails("bad_request", "hello", client="raw", pid=1, versions=value)
    # Wrong numbers of frames.
    raw.fails("bad_request", "lookup", (), reg=reg)
    raw.fails("bad_request", "lookup", [keys, keys], reg=reg)
    raw.fails("bad_request", "store", [keys], reg=reg)
    raw.fails("bad_request", "store", [keys, pages(*range(16)), b""], reg=reg)
    raw.fails("bad_request", "load", [keys], reg=reg)
    raw.fails("bad_request", "heartbeat", [b""])
    raw.fails("bad_request", "release", [b"x"], lease=1)
    raw.fails("bad_request", "register", [b"x"], **register_fields(raw_pool))
    raw.fails("bad_request", "hello", [b""], client="raw", pid=1, versions=[2])
    # The session survived all of it: hello was never replaced, the pool is still ours.
    assert raw.ok("lookup", [keys], reg=reg) == {"hits": 4, "lease": None}
    raw.ok("unregister", reg=reg)
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


# ---- bulk frames and page ids --------------------------------------------------

def test_keys_and_page_frames(daemon, good, zctx, raw_pool):
    raw = engine(daemon, zctx)
    raw.hello()
    reg = raw.register(raw_pool)  # same namespace as the good client: its keys hit
    keys = b"".join(good.keys)
    one = pages(0, 1, 2, 3)
    for bad in [b"x", KEY[:15], KEY + b"x", keys[:-1], keys + b"\0"]:
        raw.fails("bad_request", "lookup", [bad], reg=reg)
        raw.fails("bad_request", "store", [bad, one], reg=reg)
        raw.fails("bad_request", "load", [bad, one], reg=reg)
    for bad in [b"\0", one[:-1], one + b"\0", one[:7]]:
        raw.fails("bad_request", "store", [KEY, bad], reg=reg)
        raw.fails("bad_request", "load", [good.keys[0], bad], reg=reg)
    # Page counts that do not match the chunks (4 pages per chunk).
    for bad in [b"", pages(0, 1, 2), pages(*range(5)), pages(*range(8))]:
        raw.fails("bad_request", "store", [KEY, bad], reg=reg)
        raw.fails("bad_request", "load", [good.keys[0], bad], reg=reg)
    raw.fails("bad_request", "store", [KEY * 2, pages(*range(4))], reg=reg)
    raw.fails("bad_request", "load", [keys, pages(*range(15))], reg=reg)
    # Page ids outside [0, 64): every chunk checked, not only the first page.
    for bad in [(0, 1, 2, 64), (-1, 0, 1, 2), (64, 65, 66, 67), (0, 1, 2, 2**62), (0, 1, 2, -2**63),
                (0, 1, 2, 2**63 - 1)]:
        raw.fails("out_of_range", "store", [KEY, pages(*bad)], reg=reg)
        raw.fails("out_of_range", "load", [good.keys[0], pages(*bad)], reg=reg)
    raw.fails("out_of_range", "store", [KEY + b"\x08" * 16, pages(*range(4), 60, 61, 62, 64)], reg=reg)
    raw.fails("out_of_range", "load", [keys, pages(*range(15), 1000)], reg=reg)
    # None of the bad loads wrote into the pool, and no bad store stored anything.
    assert not raw_pool.raw.any()
    # A store of the good client's keys from other bytes under the same namespace is a
    # dedup: it never overwrites what is cached (the good client checks its bytes).
    assert raw.ok("store", [keys, pages(*range(16))], reg=reg) == {"stored": 0, "deduped": 4}
    # Under a different namespace the same keys are refused, not overwritten.
    other = raw.register(raw_pool, model="other")
    raw.fails("bad_request", "store", [KEY + good.keys[0], pages(*range(8))], reg=other)
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


def test_bad_tail_pages(daemon, good, zctx, raw_pool):
    """A load's ``tail_pages`` (its last chunk's first pages only) must cut a chunk: 1 to
    pages_per_chunk - 1 (4 pages a chunk here), of at least one key, with exactly that many
    page ids for the last chunk; a store takes no ``tail_pages``. Typed errors, nothing
    written; a valid partial load then writes exactly its pages."""
    raw = engine(daemon, zctx)
    raw.hello()
    reg = raw.register(raw_pool)
    keys = b"".join(good.keys[:2])
    for tail in (0, 4, 5, 2**40):
        assert "tail_pages" in raw.fails("bad_request", "load", [keys, pages(*range(4 + tail % 8))],
                                         reg=reg, tail_pages=tail)
    for tail in (-1, True, 1.5, "2", None):
        raw.fails("bad_request", "load", [keys, pages(*range(6))], reg=reg, tail_pages=tail)
    raw.fails("bad_request", "load", [b"", b""], reg=reg, tail_pages=1)
    for n in (4, 5, 7, 8):  # 2 keys, tail of 2 pages: exactly 6 page ids
        raw.fails("bad_request", "load", [keys, pages(*range(n))], reg=reg, tail_pages=2)
    raw.fails("out_of_range", "load", [keys, pages(*range(5), 64)], reg=reg, tail_pages=2)
    raw.fails("bad_request", "store", [keys, pages(*range(6))], reg=reg, tail_pages=2)
    assert not raw_pool.raw.any()
    assert raw.ok("load", [keys, pages(*range(10, 16))], reg=reg, tail_pages=2) == {"loaded": 2}
    for src, got in zip(good.pool.tensors, raw_pool.tensors):  # [k|v, page, ...] per layer
        src, got = src.view(np.uint8), got.view(np.uint8)
        assert (got[:, 10:16] == src[:, 0:6]).all()  # chunk 0's 4 pages, chunk 1's first 2
        got[:, 10:16] = 0
    assert not raw_pool.raw.any()  # nothing past the tail's 2 pages, nothing else
    raw.ok("bye")
    raw.close()
    good.assert_intact(raw.errors)


def test_bad_part_tokens(daemon, good, zctx, raw_pool):
    """A partial entry (protocol §8.5) has 1 to chunk_tokens - 1 tokens (16 here), a multiple
    of the page size (4), one key and exactly its pages; a lookup's ``part_tokens`` is a
    list of such counts, no longer than its keys. Typed errors, nothing stored; a valid
    partial store then stores one entry of its size, found only as that length."""
    raw = engine(daemon, zctx)
    raw.hello()
    reg = raw.register(raw_pool)
    for n in (0, 16, 17, 6, 2**40):
        for op in ("store", "load"):
            assert "part_tokens" in raw.fails("bad_request", op, [KEY, pages(0, 1)], reg=reg,
                                              part_tokens=n)
    for n in (-4, True, 8.0, "8", None, [8]):
        raw.fails("bad_request", "store", [KEY, pages(0, 1)], reg=reg, part_tokens=n)
    raw.fails("bad_request", "store", [KEY * 2, pages(0, 1, 2, 3)], reg=reg, part_tokens=8)
    raw.fails("bad_request", "load", [KEY, pages(0, 1)], reg=reg, part_tokens=8, tail_pages=2)
    for n in (1, 3, 4):  # 8 tokens: exactly 2 page ids
        raw.fails("bad_request", "store", [KEY, pages(*range(n))], reg=reg, part_tokens=8)
        raw.fails("bad_request", "load", [KEY, pages(*range(n))], reg=reg, part_tokens=8)
    raw.fails("out_of_range", "store", [KEY, pages(0, 64)], reg=reg, part_tokens=8)
    keys = b"".join(good.keys[:2]) + KEY
    for bad in ([], [8, 8, 8, 8], [0], [16], [6], [8.0], "8", 8, [[8]], [None]):
        raw.fails("bad_request", "lookup", [keys], reg=reg, part_tokens=bad)
    assert not raw_pool.raw.any()
    assert raw.ok("store", [KEY, pages(10, 11)], reg=reg, part_tokens=8) == {"stored": 1,
                                                                              "deduped": 0}
    raw.fails("bad_request", "store", [KEY, pages(10)], reg=reg, part_tokens=4)  # other size
    raw.fails("bad_request", "store", [KEY, pages(*range(4))], reg=reg)  # as a whole chunk
    assert raw.ok("lookup", [KEY], reg=reg) == {"hits": 0, "lease": None}
    assert raw.ok("lookup", [KEY], reg=reg, part_tokens=[8]) == {"hits": 0, "lease": None,
                                                                 "part": 8}
    assert raw.ok("lookup", [KEY * 2], reg=reg, part_tokens=[12, 4]) == {  # other lengths
        "hits": 0, "lease": None, "part": None}
    assert raw.ok("load", [KEY, pages(20, 21)], reg=reg, part_tokens=8) == {"loaded": 1}
    for t in raw_pool.tensors:
        t.view(np.uint8)[:, 20:22] = 0
    assert not raw_pool.raw.any()  # only the partial entry's 2 pages were written
    raw.ok("bye")
    raw.close()
    stats = daemon.stats()
    assert stats["tiers"]["host"]["entries"] == good.stats0["tiers"]["host"]["entries"] + 1
    good.stats0 = {**good.stats0, "tiers": stats["tiers"], "chunks_stored": stats["chunks_stored"]}
    good.assert_intact(raw.errors)


def test_a_page_id_named_twice_in_one_request(good):
    """Not bad input (kvd's vLLM connector points the pages of a load's first chunk that vLLM
    holds already at one scratch block), but defined (docs/protocol.md §5.6, §5.7): a store
    gathers each chunk from the pages it names; a load writes every page named once with its
    chunk's bytes, and no page it was not given."""
    c, raw = good.client, [t.view(np.uint8) for t in good.pool.tensors]
    tokens = np.arange(1000, 1016)
    assert c.store(tokens, [1, 1, 2, 2]) == 16
    for t in raw:
        t[:, 16:64] = 0
    assert c.load(tokens, [16, 17, 18, 19]) == 16
    for t in raw:
        assert (t[:, 16:18] == t[:, [1, 1]]).all() and (t[:, 18:20] == t[:, [2, 2]]).all()
    assert c.load(kvd_client.ChunkKeys(good.keys[:2]), [20] * 4 + [24, 25, 26, 27]) == 32
    for t in raw:
        assert (t[:, 24:28] == t[:, 4:8]).all()  # named once: chunk 1's bytes
        assert not t[:, 21:24].any() and not t[:, 28:64].any()  # not named: untouched


def test_too_many_keys(start_daemon, zctx, raw_pool):
    daemon = start_daemon(max_keys_per_request=4)
    good = Good(daemon)
    try:
        raw = engine(daemon, zctx)
        raw.hello()
        reg = raw.register(raw_pool)
        assert raw.ok("lookup", [KEY * 4], reg=reg)["hits"] == 0
        for n in (5, 64, 4096):
            raw.fails("too_large", "lookup", [KEY * n], reg=reg)
            raw.fails("too_large", "store", [KEY * n, pages(*range(4 * n))], reg=reg)
            raw.fails("too_large", "load", [KEY * n, pages(*range(4 * n))], reg=reg)
        assert not raw_pool.raw.any()
        raw.ok("bye")
        raw.close()
        good.assert_intact(raw.errors)
        # The kvd_client gets the same typed error for a long prompt.
        with pytest.raises(kvd_client.ServerError) as err:
            good.client.lookup(np.arange(16 * 5))
        assert err.value.code == "too_large"
    finally:
        good.close()


# ---- message size and the control socket ---------------------------------------

def test_oversized_message_drops_the_peer(start_daemon, zctx, raw_pool):
    daemon = start_daemon(max_message_bytes=65536)
    good = Good(daemon)
    try:
        bystander = engine(daemon, zctx)
        bystander.hello()
        reg = bystander.register(raw_pool)
        big = engine(daemon, zctx)
        big.hello()
        # One frame over the limit: ZeroMQ drops the connection; no reply, nothing done.
        assert big.send([pack({"v": 2, "id": 1, "op": "lookup", "reg": reg}), KEY * 5000],
                        timeout=1.0) is None
        assert big.send([pack({"v": 2, "id": 2, "op": "heartbeat", "pad": "x" * 70_000})],
                        timeout=0.5) is None
        # The DEALER reconnected as a new peer (no fixed routing id): the old one was dropped.
        big.fails("no_session", "heartbeat")
        big.hello()
        assert big.ok("heartbeat") == {}
        # Frames each under the limit but together over it are refused just as well.
        other = engine(daemon, zctx)
        other.hello()
        other_reg = other.register(raw_pool)
        frames = [KEY * 2000, pages(*np.arange(8000) % 64)]
        assert max(map(len, frames)) < 65536 < sum(map(len, frames))
        other.fails("too_large", "store", frames, reg=other_reg)
        other.ok("bye")
        # The daemon kept serving everyone else.
        assert bystander.ok("lookup", [b"".join(good.keys)], reg=reg)["hits"] == 4
        bystander.ok("bye")
        big.ok("bye")
        assert not raw_pool.raw.any()
        good.assert_intact(big.errors + bystander.errors + other.errors)
        for r in (big, bystander, other):
            r.close()
    finally:
        good.close()


def test_control_socket_rejects_engine_ops(daemon, good, zctx):
    ctl = Raw(control_endpoint(daemon.runtime_dir), zctx)
    assert ctl.ok("health")["status"] == "ok"
    assert ctl.ok("stats")["tiers"]["host"]["chunks"] == 4
    for op in ["hello", "register", "lookup", "store", "load", "release", "unregister",
               "heartbeat", "bye", "nope"]:
        ctl.fails("unknown_op", op)
    ctl.fails("unknown_op", "hello", client="raw", pid=1, versions=[2])
    ctl.fails("unknown_op", "lookup", [KEY], reg=1)
    ctl.fails("bad_request", "stats", [b"x"])
    ctl.fails("bad_request", "health", extra=1)
    ctl.fails_raw("bad_request", [b"\xc1"])
    ctl.fails_raw("bad_version", [pack({"v": 9, "id": 3, "op": "stats"})], req_id=3)
    # An engine socket peer cannot reach control ops either.
    raw = engine(daemon, zctx)
    raw.hello()
    raw.fails("unknown_op", "clear")
    raw.fails("unknown_op", "stats")
    ctl.close()
    raw.close()
    good.assert_intact(ctl.errors + raw.errors)
