"""Pipelined requests and stores waiting for the engine's stream, on the host backend (no GPU).

A real daemon and real client processes. What the CUDA path does on the GPU
(stores ordered by the engine's stream, layer words, cancel in kernels) the
host backend does with the same flag page from the CPU, so the completion
model runs here: many transfers in flight; ``busy`` beyond ``max_inflight``;
a store waiting for the engine's stream (and ending at its deadline, at
reaping, at shutdown); a killed engine reaped at once while its store
waited. Loads, cancel, fences and dead daemons: test_pipeline_loads.py.
"""

from __future__ import annotations

import multiprocessing
import signal
import time

import msgpack
import numpy as np
import workers_pipeline as WP
from daemons import wait_for
from rawwire import Raw, pages
from workers_pipeline import random_pool

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.flags import MARK_WORD
from kvd_protocol.runtime import engine_endpoint

GEOMETRY = WP.GEOMETRY  # 2 layers, 64 pages of 4 tokens, 512 B per 16-token chunk shard...


def page_bytes(pool, page_range) -> list:
    return [t.view(np.uint8)[:, page_range].copy() for t in pool.tensors]


def send(raw: Raw, op: str, frames, **fields) -> int:
    raw.next_id += 1
    raw.sock.send_multipart([msgpack.packb({"v": 2, "id": raw.next_id, "op": op, **fields}), *frames])
    return raw.next_id


def replies(raw: Raw, n: int, timeout: float = 10.0) -> dict:
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n and raw.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        reply = msgpack.unpackb(raw.sock.recv_multipart()[0])
        if reply["id"] != 0:
            out[reply["id"]] = reply
    return out


# ---- pipelining ---------------------------------------------------------------------

def test_many_transfers_in_flight_complete_bit_exact(daemon):
    client = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True).connect()
    pool = random_pool(5, num_pages=256)
    try:
        client.register_kv(pool, model="pipelined")
        prompts = [np.arange(32) + 1000 * i for i in range(16)]  # 2 chunks = 8 pages each
        stores = [client.submit_store(p, np.arange(8 * i, 8 * i + 8)) for i, p in enumerate(prompts)]
        assert all(isinstance(t, kvd_client.Transfer) for t in stores)
        done = wait_for_all(client, stores)
        assert all(t.ok and t.tokens == 32 for t in done), done
        for t in pool.tensors:
            t.view(np.uint8)[:, 128:256] = 0xA5
        loads = [client.submit_load(p, np.arange(128 + 8 * i, 136 + 8 * i), layerwise=i % 2 == 1)
                 for i, p in enumerate(prompts)]
        done = wait_for_all(client, loads)
        assert all(t.ok and t.tokens == 32 for t in done), done
        for t in pool.tensors:
            raw = t.view(np.uint8)
            assert (raw[:, 128:256] == raw[:, 0:128]).all()
        assert client.poll() == []  # each finished transfer is reported once
        assert daemon.stats()["busy"] == 0
    finally:
        client.close()
        pool.close()


def wait_for_all(client, transfers, timeout: float = 30.0) -> list:
    seen, deadline = [], time.monotonic() + timeout
    while len(seen) < len(transfers) and time.monotonic() < deadline:
        seen += client.poll()
        time.sleep(0.001)
    assert sorted(map(id, seen)) == sorted(map(id, transfers)), "not every transfer was reported"
    assert all(t.done for t in seen)
    return seen


def test_busy_beyond_max_inflight_and_other_clients_go_on(start_daemon, zctx):
    d = start_daemon(max_inflight=4)
    pool = kvd_client.SharedKVPool(*GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 8)
    raw = Raw(engine_endpoint(d.runtime_dir), zctx)
    good = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True).connect()
    good_pool = random_pool(9)
    try:
        raw.hello()
        reg = raw.register(pool, model="busy")
        # Four stores wait for the engine's stream (store word 0 < seq): all in flight.
        ids = [send(raw, "store", [bytes([i]) * 16, pages(0, 1, 2, 3)], reg=reg, after=i + 1)
               for i in range(4)]
        time.sleep(0.3)
        assert raw.fails("busy", "store", [b"\x09" * 16, pages(0, 1, 2, 3)], reg=reg, after=9)
        assert raw.fails("busy", "lookup", [b"\x09" * 16], reg=reg)
        assert raw.ok("heartbeat") == {}  # liveness is never refused
        # Another client is served meanwhile, and its bytes are right.
        good.register_kv(good_pool, model="busy-neighbour")
        assert good.store(np.arange(64), np.arange(16)) == 64
        assert good.load(np.arange(64), np.arange(16, 32)) == 64
        assert all((t.view(np.uint8)[:, 16:32] == t.view(np.uint8)[:, :16]).all()
                   for t in good_pool.tensors)
        pool.flags.words[MARK_WORD] = 4  # the engine's stream got past all four
        got = replies(raw, 4)
        assert sorted(got) == ids and all(r["result"] == {"stored": 1, "deduped": 0}
                                          for r in got.values())
        assert d.stats()["busy"] == 2
    finally:
        good.close()
        good_pool.close()
        raw.close()
        pool.flags.close()
        pool.close()


def test_flooding_client_gets_busy_and_a_neighbour_is_served(start_daemon):
    d = start_daemon(max_inflight=16)
    ctx = multiprocessing.get_context("spawn")
    report, child = ctx.Pipe(duplex=False)
    flooder = ctx.Process(target=WP.flood, args=(str(d.runtime_dir), 3.0, child))
    flooder.start()
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True).connect()
    pool = random_pool(3)
    try:
        client.register_kv(pool, model="neighbour")
        wait_for(lambda: d.stats()["busy"] > 0, 30, "the flooder to be turned away")
        for i in range(20):  # every call of the well-behaved client succeeds meanwhile
            tokens = np.arange(64) + i * 100
            assert client.store(tokens, np.arange(16)) == 64
            assert client.lookup(tokens) == 64
            assert client.load(tokens, np.arange(16, 32)) == 64
        assert report.poll(90), "the flooder did not report"
        counts = report.recv()
        assert counts["ok"] > 0 and counts.get("busy", 0) > 0, counts
        assert set(counts) <= {"ok", "busy"}, counts  # no other error, no worker error
    finally:
        flooder.join(30)
        client.close()
        pool.close()


# ---- stores wait for the engine's stream ----------------------------------------------

def test_store_copies_what_the_engine_wrote_once_its_stream_got_there(daemon, raw_engine):
    raw, pool = raw_engine, raw_engine.pool
    req = send(raw, "store", [b"\x05" * 16, pages(0, 1, 2, 3)], reg=raw.reg, after=3)
    time.sleep(0.2)
    assert replies(raw, 1, timeout=0.2) == {}  # still waiting for the engine
    pool.raw[:] = np.random.default_rng(1).integers(0, 256, pool.raw.size, dtype=np.uint8)
    want = page_bytes(pool, slice(0, 4))  # what the "forward pass" wrote before seq 3
    pool.flags.words[MARK_WORD] = 3
    assert replies(raw, 1)[req]["result"] == {"stored": 1, "deduped": 0}
    pool.raw[:] = 0
    r = raw.ok("load", [b"\x05" * 16, pages(8, 9, 10, 11)], reg=raw.reg, slot=0, seq=1)
    assert r == {"loaded": 1}
    assert all((t.view(np.uint8)[:, 8:12] == w).all() for t, w in zip(pool.tensors, want))


def test_store_whose_engine_never_gets_there_ends_at_its_deadline(daemon, raw_engine):
    raw = raw_engine
    before = daemon.stats()["tiers"]["host"]["entries"]
    deadline_us = time.monotonic_ns() // 1000 + 300_000
    t0 = time.monotonic()
    raw.fails("deadline_exceeded", "store", [b"\x06" * 16, pages(0, 1, 2, 3)], reg=raw.reg, after=5,
              deadline_us=deadline_us)
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert daemon.stats()["tiers"]["host"]["entries"] == before
    assert raw.ok("lookup", [b"\x06" * 16], reg=raw.reg)["hits"] == 0


def test_engine_killed_while_its_store_waits_is_reaped_at_once(daemon, procs):
    ctx = multiprocessing.get_context("spawn")
    report, child = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=WP.stuck_store, args=(str(daemon.runtime_dir), b"\x0a" * 16, child))
    engine.start()
    try:
        assert report.poll(60)
        info = report.recv()
        wait_for(lambda: daemon.stats()["tiers"]["host"]["entries"] == 1, 10, "the reservation")
        engine.kill()
        engine.join(10)
        killed = time.monotonic()
        wait_for(lambda: daemon.stats()["clients"] == 0, daemon.knobs["client_timeout_s"] + 5,
                 "the killed engine to be reaped")
        assert time.monotonic() - killed < daemon.knobs["client_timeout_s"]
        stats = daemon.stats()
        assert stats["tiers"]["host"]["entries"] == 0  # its reservation was undone
        assert stats["registrations"] == 0
        assert procs.apply(__import__("workers_failures").roundtrip, (str(daemon.runtime_dir), 3))
    finally:
        if engine.is_alive():
            engine.kill()
        for name in ("pool", "flags"):
            __import__("pathlib").Path(info[name]).unlink(missing_ok=True)


def test_sigterm_ends_promptly_while_a_store_waits(start_daemon, zctx):
    d = start_daemon(shutdown_grace_s=2.0)
    pool = kvd_client.SharedKVPool(*GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 8)
    raw = Raw(engine_endpoint(d.runtime_dir), zctx)
    try:
        raw.hello()
        reg = raw.register(pool)
        req = send(raw, "store", [b"\x0b" * 16, pages(0, 1, 2, 3)], reg=reg, after=1)
        time.sleep(0.2)
        t0 = time.monotonic()
        assert d.stop(signal.SIGTERM, timeout=10) == 0
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert replies(raw, 1, timeout=1)[req]["error"]["code"] == "shutting_down"
    finally:
        raw.close()
        pool.flags.close()
        pool.close()
