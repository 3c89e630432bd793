"""Pipelined requests, the flag page and fences, on the host backend (no GPU needed).

A real daemon and real client processes. What the CUDA path does on the GPU
(stores ordered by the engine's stream, layer words, cancel in kernels) the
host backend does with the same flag page from the CPU, so the completion
model runs here: many transfers in flight; ``busy`` beyond ``max_inflight``;
a store waiting for the engine's stream (and ending at its deadline, at
reaping, at shutdown); cancelled loads writing nothing; a load that timed
out while the daemon was frozen never landing afterwards; a killed daemon
failing everything in flight at once and releasing the engine's waits; a
killed engine reaped at once while its store waited.
"""

from __future__ import annotations

import multiprocessing
import signal
import time

import msgpack
import numpy as np
import pytest
import workers_pipeline as WP
from daemons import wait_for
from rawwire import Raw, pages

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.flags import MARK_WORD
from kvd_protocol.runtime import engine_endpoint

NOTICE_S = 0.2  # a dead daemon is noticed within this (its lock is probed every 50 ms)
GEOMETRY = WP.GEOMETRY  # 2 layers, 64 pages of 4 tokens, 512 B per 16-token chunk shard...


def random_pool(seed: int, num_pages: int = 64) -> kvd_client.SharedKVPool:
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, num_pages, 4, 2, 8, "float16")
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def page_bytes(pool, page_range) -> list:
    return [t.view(np.uint8)[:, page_range].copy() for t in pool.tensors]


@pytest.fixture
def raw_engine(daemon, zctx):
    """A raw engine with a registered pool (zero-filled) and an 8-slot flag page."""
    pool = kvd_client.SharedKVPool(*GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 8)
    raw = Raw(engine_endpoint(daemon.runtime_dir), zctx)
    raw.hello()
    raw.reg = raw.register(pool, model="pipe")
    raw.pool = pool
    yield raw
    raw.close()
    pool.flags.close()
    pool.close()


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


# ---- loads: signals, cancel, fences ---------------------------------------------------

@pytest.fixture
def stored(daemon, raw_engine):
    """Two chunks (keys 0x11.., 0x12..) stored from random pages 0..7."""
    raw, pool = raw_engine, raw_engine.pool
    rng = np.random.default_rng(2)
    for t in pool.tensors:
        t.view(np.uint8)[:, 0:8] = rng.integers(0, 256, t.view(np.uint8)[:, 0:8].shape)
    keys = b"\x11" * 16 + b"\x12" * 16
    assert raw.ok("store", [keys, pages(*range(8))], reg=raw.reg)["stored"] == 2
    return keys


def test_layerwise_load_signals_every_layer_then_done(raw_engine, stored):
    raw, flags = raw_engine, raw_engine.pool.flags
    assert raw.ok("load", [stored, pages(*range(8, 16))], reg=raw.reg, slot=2, seq=41,
                  layerwise=True) == {"loaded": 2}
    layout = flags.layout
    assert [int(flags.words[layout.layer_word(2, i)]) for i in range(layout.num_layers)] == [41, 41]
    assert int(flags.words[layout.done_word(2)]) == 41
    assert all((t.view(np.uint8)[:, 8:16] == t.view(np.uint8)[:, 0:8]).all()
               for t in raw_engine.pool.tensors)


def test_cancelled_load_writes_nothing_and_says_so(raw_engine, stored):
    raw, flags = raw_engine, raw_engine.pool.flags
    for t in raw_engine.pool.tensors:
        t.view(np.uint8)[:, 8:16] = 0x3C
    flags.cancel(1, 77)
    assert "cancel" in raw.fails("cancelled", "load", [stored, pages(*range(8, 16))], reg=raw.reg,
                                 slot=1, seq=77, layerwise=True)
    assert all((t.view(np.uint8)[:, 8:16] == 0x3C).all() for t in raw_engine.pool.tensors)
    assert flags.done(1, 77) and flags.layer_landed(1, 1, 77)  # every wait was released


@pytest.fixture
def big_engine(start_daemon, zctx):
    """A raw engine whose chunks are 256 KiB (4 layers, 8 heads of 128, fp16): 96 of them, 24
    MiB, are a copy the host backend splits across its threads (kvd.copy.host)."""
    d = start_daemon(host_capacity="64MiB")
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 4, 2 * 96 + 2, 16, 8, 128, "float16")
    pool.flags = ClientFlags(pool.num_layers, 8)
    pool.raw[:] = np.random.default_rng(5).integers(0, 256, pool.raw.size, dtype=np.uint8)
    raw = Raw(engine_endpoint(d.runtime_dir), zctx)
    raw.hello()
    raw.reg, raw.pool = raw.register(pool, model="split"), pool
    yield raw
    raw.close()
    pool.flags.close()
    pool.close()


def test_a_copy_split_across_threads_lands_whole_and_signals_done_once(big_engine):
    raw, pool = big_engine, big_engine.pool
    keys = b"".join(i.to_bytes(4, "little") * 4 for i in range(1, 97))
    assert raw.ok("store", [keys, pages(*range(96))], reg=raw.reg)["stored"] == 96
    before = [t.view(np.uint8).copy() for t in pool.tensors]
    assert raw.ok("load", [keys, pages(*range(96, 192))], reg=raw.reg, slot=3, seq=9) == {"loaded": 96}
    assert pool.flags.done(3, 9)
    for t, old in zip(pool.tensors, before):
        now = t.view(np.uint8)
        assert (now[:, 96:192] == old[:, 0:96]).all()  # every part, in chunk order
        assert (now[:, :96] == old[:, :96]).all() and (now[:, 192:] == old[:, 192:]).all()


def test_a_cancelled_split_load_writes_nothing(big_engine):
    raw, pool = big_engine, big_engine.pool
    keys = b"".join(i.to_bytes(4, "little") * 4 for i in range(101, 197))
    assert raw.ok("store", [keys, pages(*range(96))], reg=raw.reg)["stored"] == 96
    before = [t.view(np.uint8).copy() for t in pool.tensors]
    pool.flags.cancel(4, 12)
    assert "cancel" in raw.fails("cancelled", "load", [keys, pages(*range(96, 192))], reg=raw.reg,
                                 slot=4, seq=12)
    assert all((t.view(np.uint8) == old).all() for t, old in zip(pool.tensors, before))
    assert pool.flags.done(4, 12)


def test_load_that_timed_out_never_lands_later(start_daemon):
    d = start_daemon()
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=0.5,
                                  fence_quiet_s=0.3).connect()
    pool = random_pool(4)
    try:
        client.register_kv(pool, model="frozen")
        tokens = np.arange(64)
        assert client.store(tokens, np.arange(16)) == 64
        for t in pool.tensors:
            t.view(np.uint8)[:, 16:32] = 0x77
        d.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        t0 = time.monotonic()
        transfer = client.submit_load(tokens, np.arange(16, 32), layerwise=True)
        transfer.wait(10)
        assert transfer.done and transfer.status == "failed"
        assert isinstance(transfer.error, kvd_client.Timeout)
        assert 0.5 + 0.3 <= time.monotonic() - t0 < 5  # the fence took the quiet period
        client.wait_for_layer(1, transfer)  # released: returns at once
        d.proc.send_signal(signal.SIGCONT)  # the daemon now reads the stale load
        time.sleep(1.0)
        assert all((t.view(np.uint8)[:, 16:32] == 0x77).all() for t in pool.tensors)
        assert client.load(tokens, np.arange(32, 48)) == 64  # and serves the next one
    finally:
        d.proc.send_signal(signal.SIGCONT)
        client.close()
        pool.close()


def test_killed_daemon_fails_transfers_at_once_and_the_client_comes_back(start_daemon):
    d = start_daemon()
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=30.0,
                                  fence_quiet_s=0.2).connect()
    pool = random_pool(6)
    try:
        client.register_kv(pool, model="phoenix")
        tokens = np.arange(64)
        assert client.store(tokens, np.arange(16)) == 64
        d.proc.send_signal(signal.SIGSTOP)
        transfers = [client.submit_load(tokens, np.arange(16, 32), layerwise=True),
                     client.submit_store(tokens + 1, np.arange(32, 48))]
        time.sleep(0.2)
        assert not any(t.done for t in transfers)
        d.kill()  # returns once the process is gone
        t0 = time.monotonic()
        # nobody drives the client: its background thread probes the daemon's lock
        while not all(t.status == "failed" for t in transfers):
            assert time.monotonic() - t0 < NOTICE_S, f"the dead daemon was noticed late: {transfers}"
            time.sleep(0.001)
        load = transfers[0]  # its layer words were released with the failure, before its fence
        assert all(load.reg.flags.layer_landed(load.slot, i, load.seq) for i in range(2)), load
        for t in transfers:
            t.wait(10)  # the load: fenced once fence_quiet_s passed
        assert all(t.done and t.status == "failed" for t in transfers)
        assert all(isinstance(t.error, kvd_client.DaemonUnavailable) for t in transfers)
        t1 = time.monotonic()
        assert client.lookup(tokens) == 0  # no daemon: a miss, no exception
        assert time.monotonic() - t1 < 2.0, "a lookup without a daemon waited for its timeout"
        d2 = start_daemon(runtime_dir=d.runtime_dir)
        wait_for(lambda: client.store(tokens, np.arange(16)) == 64, 10, "re-registration")
        assert client.load(tokens, np.arange(16, 32)) == 64
        assert d2.stats()["registrations"] == 1
    finally:
        client.close()
        pool.close()


def test_a_probe_reaps_only_the_peer_that_left(daemon, zctx, raw_engine):
    """A silent raw engine (no heartbeats) survives another client's disconnect."""
    other = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir)).connect()
    wait_for(lambda: daemon.stats()["clients"] == 2, 5, "two clients")
    other.channel.close()  # gone without bye
    wait_for(lambda: daemon.stats()["clients"] == 1, 5, "the leaver to be reaped")
    assert raw_engine.ok("heartbeat") == {}
    assert "removed: connection closed" in daemon.log()


def test_a_process_without_kv_attaches_for_lookups(daemon):
    """vLLM's scheduler holds no KV: it attaches a namespace and looks up; an engine stores."""
    engine = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True).connect()
    scheduler = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True).connect()
    pool = random_pool(8)
    try:
        engine.register_kv(pool, model="attached")
        reg = scheduler.attach("attached", pool.kv_dtype, pool.attention, pool.num_layers,
                               pool.kv_heads, pool.head_dim)
        tokens = np.arange(64) + 555
        assert scheduler.lookup(tokens, reg=reg) == 0
        assert engine.store(tokens, np.arange(16)) == 64
        assert scheduler.lookup(tokens, reg=reg) == 64
        assert scheduler.keys(tokens, reg=reg) == engine.keys(tokens)
        with pytest.raises(ValueError, match="no KV pool"):
            scheduler.submit_load(tokens, np.arange(16), reg=reg)
        assert daemon.stats()["registrations"] == 2
    finally:
        scheduler.close()
        engine.close()
        pool.close()


def test_attached_registration_refuses_copies_on_the_wire(daemon, zctx, raw_engine):
    ns = {"model": "pipe", "kv_dtype": "float16", "attention": "mha", "num_layers": 2,
          "kv_heads": 2, "head_dim": 8, "tp_size": 1, "first_layer": 0, "fingerprint": ""}
    reg = raw_engine.ok("attach", namespace=ns, tp_rank=0)["reg"]
    assert "no KV pool" in raw_engine.fails("bad_request", "store", [b"\x01" * 16, pages(0, 1, 2, 3)],
                                            reg=reg)
    assert "no KV pool" in raw_engine.fails("bad_request", "load", [b"\x01" * 16, pages(0, 1, 2, 3)],
                                            reg=reg, slot=0, seq=1)
    raw_engine.fails("bad_request", "attach", namespace=ns, tp_rank=1)
    assert raw_engine.ok("lookup", [b"\x01" * 16], reg=reg) == {"hits": 0, "lease": None}
    raw_engine.ok("unregister", reg=reg)
