"""Loads on the flag page (signals, cancel, fences) and dead daemons, on the host backend (no GPU).

A real daemon and real client processes, as in tests/server/test_pipeline.py
(pipelining, stores): a layer-wise load signalling every layer, then done;
cancelled loads, whole or split across the host backend's copy threads,
writing nothing; a load that timed out while the daemon was frozen never
landing afterwards; a killed daemon failing everything in flight at once and
releasing the engine's waits; a probe reaping only the peer that left; a
process without KV attaching a namespace for lookups.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from daemons import wait_for
from rawwire import Raw, pages
from workers_pipeline import random_pool

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.runtime import engine_endpoint

NOTICE_S = 0.2  # a dead daemon is noticed within this (its lock is probed every 50 ms)


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


# ---- peers and attached registrations -------------------------------------------------

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
