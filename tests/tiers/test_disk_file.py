"""Unit tests of kvd.tiers.disk.chunk_file (the chunk file format) and kvd.tiers.disk.tier (index, IO, recovery).

No daemon: the disk tier runs on a private event loop here. Covered: round
trip in both IO modes, every kind of corruption (magic, version, header
field, payload byte, length, name), the O_DIRECT probe and its fallback,
temp-file hygiene on a failed write, capacity and LRU, the bounded queue,
one file per key, and the recovery scan.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from disk_faults import FaultyChunkFiles

from kvd.tiers.disk import chunk_file as F
from kvd.tiers.disk.tier import DiskTier

NS = bytes(range(16))
KEY = bytes(range(16, 32))


def payload(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def files(request, tmp_path):
    direct = request.param and F.probe_direct(tmp_path)
    if request.param and not direct:
        pytest.skip("no O_DIRECT on this filesystem")
    return F.ChunkFiles(tmp_path / "disk", direct=direct)


@pytest.mark.parametrize("n", [1, 4095, 4096, 3 * 4096 + 17])
def test_round_trip(files, n):
    data = payload(n)
    path = files.write(NS, KEY, data, 1, n)
    assert path == F.chunk_path(files.root, NS, KEY)
    assert path.stat().st_size == 4096 + -(-n // 4096) * 4096
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    out = np.zeros(n, np.uint8)
    head = files.read_into(path, NS, KEY, out)
    assert (out == data).all() and head.length == n and head.shards == 1
    assert F.read_header(path).digest == head.digest


@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip_from_and_to_page_aligned_buffers(files, aligned):
    """Aligned buffers (host slots) go without a bounce copy; unaligned ones through it."""
    n = 3 * 4096
    src_map, dst_map = mmap.mmap(-1, n + 4096), mmap.mmap(-1, n + 4096)
    off = 0 if aligned else 256
    src = np.frombuffer(src_map, np.uint8)[off:off + n]
    dst = np.frombuffer(dst_map, np.uint8)[off:off + n]
    src[:] = payload(n, 7)
    assert files._zero_copy(memoryview(src)) == (aligned or not files.direct)
    path = files.write(NS, KEY, src, 3, 4096)
    files.read_into(path, NS, KEY, dst)
    assert (dst == src).all()
    corrupt(path, 4096 + 100)
    with pytest.raises(F.ChunkCorrupt):
        files.read_into(path, NS, KEY, dst)
    del src, dst


def test_header_layout_is_documented(files):
    path = files.write(NS, KEY, payload(100), 2, 50)
    raw = path.read_bytes()
    assert raw[:8] == b"KVDCHUNK"
    assert int.from_bytes(raw[8:12], "little") == F.FORMAT_VERSION == 2
    assert raw[16:32] == NS and raw[32:48] == KEY
    assert int.from_bytes(raw[48:56], "little") == 100
    assert raw[F.HEADER.size:4096] == bytes(4096 - F.HEADER.size)


def corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("offset", [0, 8, 12, 20, 40, 50, 60, 4096, 4096 + 999, 4096 + 4999])
def test_any_flipped_byte_is_detected(files, offset):
    data = payload(5000)
    path = files.write(NS, KEY, data, 1, 5000)
    corrupt(path, offset)
    out = np.zeros(5000, np.uint8)
    with pytest.raises(F.ChunkCorrupt):
        files.read_into(path, NS, KEY, out)


def test_flip_in_padding_is_detected(files):
    """The padding is part of what the GPU Direct Storage path hashes; the CPU path agrees."""
    data = payload(5000)
    path = files.write(NS, KEY, data, 1, 5000)
    corrupt(path, 4096 + 6000)  # zero padding after the payload
    out = np.zeros(5000, np.uint8)
    with pytest.raises(F.ChunkCorrupt, match="padding"):
        files.read_into(path, NS, KEY, out)


def test_wrong_length_and_wrong_name(files):
    path = files.write(NS, KEY, payload(5000), 1, 5000)
    with pytest.raises(F.ChunkCorrupt):
        files.read_into(path, NS, KEY, np.zeros(4999, np.uint8))
    other = F.chunk_path(files.root, NS, bytes(16))
    other.write_bytes(path.read_bytes())
    with pytest.raises(F.ChunkCorrupt):
        F.read_header(other)
    with pytest.raises(F.ChunkCorrupt):
        files.read_into(other, NS, bytes(16), np.zeros(5000, np.uint8))
    os.truncate(path, 4096 + 4096)
    with pytest.raises(F.ChunkCorrupt):
        F.read_header(path)


def test_direct_probe_fallback(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):  # a filesystem that rejects O_DIRECT (tmpfs on old kernels)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(F.os, "open", no_direct)
    assert F.probe_direct(tmp_path) is False
    assert not list(tmp_path.glob(".probe*"))
    files = F.ChunkFiles(tmp_path)  # probes, falls back to buffered IO, and works
    assert not files.direct and "buffered" in files.mode
    data = payload(10000)
    path = files.write(NS, KEY, data, 1, 10000)
    out = np.zeros(10000, np.uint8)
    files.read_into(path, NS, KEY, out)
    assert (out == data).all()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_failed_write_leaves_no_file(tmp_path, direct):
    if direct and not F.probe_direct(tmp_path):
        pytest.skip("no O_DIRECT on this filesystem")
    files = FaultyChunkFiles(tmp_path / "disk", {"enospc"}, direct=direct)
    with pytest.raises(OSError) as info:
        files.write(NS, KEY, payload(100), 1, 100)
    assert info.value.errno == errno.ENOSPC
    assert [p for p in (tmp_path / "disk").rglob("*") if p.is_file()] == []


def test_a_failed_read_raises_and_the_tier_counts_it(tmp_path):
    good = F.ChunkFiles(tmp_path / "disk", direct=False)
    path = good.write(NS, KEY, payload(100), 1, 100)
    with pytest.raises(OSError) as info:
        FaultyChunkFiles(tmp_path / "disk", {"eio_read"}, direct=False).read_into(
            path, NS, KEY, np.zeros(100, np.uint8))
    assert info.value.errno == errno.EIO

    async def main():
        tier = DiskTier(tmp_path / "disk", 2**20, threads=1, direct=False,
                        files=FaultyChunkFiles(tmp_path / "disk", {"eio_read"}, direct=False))
        fut = tier.submit_write(NS, KEY, payload(100), 1, 100)
        assert fut is not None and await fut  # writes work
        entry = tier.get(KEY)
        assert not await tier.read_into(entry, np.zeros(100, np.uint8))
        assert tier.counters["read_errors"] == 1 and tier.get(KEY) is entry  # kept: IO error
        await tier.close()
    run(main())


# ---- the disk tier's index, on a private loop ------------------------------------------

def run(coro):
    return asyncio.run(coro)


def test_tier_capacity_lru_queue_and_one_file_per_key(tmp_path):
    async def main():
        tier = DiskTier(tmp_path, capacity=3 * 8192, threads=4, queue_chunks=2)
        data = [payload(4096, i) for i in range(5)]
        keys = [bytes([i]) * 16 for i in range(5)]
        f1 = tier.submit_write(NS, keys[0], data[0], 1, 4096)
        assert tier.submit_write(NS, keys[0], data[0], 1, 4096) is None  # one write per key
        f2 = tier.submit_write(NS, keys[1], data[1], 1, 4096)
        assert tier.submit_write(NS, keys[2], data[2], 1, 4096) is None  # queue of 2 is full
        assert tier.counters["demotions_dropped"] == 1
        assert await f1 and await f2
        assert await tier.submit_write(NS, keys[2], data[2], 1, 4096)  # full now
        tier.get(keys[0])  # keys[1], then keys[2] are now the least recently used
        for i in (3, 4):
            assert await tier.submit_write(NS, keys[i], data[i], 1, 4096)
        await tier.flush()
        assert set(tier.entries) == {keys[0], keys[3], keys[4]}
        assert tier.used == 3 * 8192 and tier.counters["evictions"] == 2
        files = sorted(p.name for p in tmp_path.rglob("*.kvc*"))
        assert files == sorted(f"{k.hex()}.kvc" for k in (keys[0], keys[3], keys[4]))
        out = np.zeros(4096, np.uint8)
        assert await tier.read_into(tier.get(keys[4]), out) and (out == data[4]).all()
        corrupt(tier.get(keys[3]).path, 4096 + 7)
        assert not await tier.read_into(tier.get(keys[3]), out)
        assert tier.counters["checksum_failures"] == 1 and keys[3] not in tier.entries
        os.unlink(tier.get(keys[0]).path)
        assert not await tier.read_into(tier.get(keys[0]), out)
        assert tier.counters["vanished"] == 1
        await tier.close()
        assert sorted(p.name for p in tmp_path.rglob("*.kvc*")) == [f"{keys[4].hex()}.kvc"]
    run(main())


def test_recovery_scan(tmp_path):
    async def main():
        tier = DiskTier(tmp_path, capacity=2**20)
        keys = [bytes([i]) * 16 for i in range(6)]
        for i, k in enumerate(keys):
            assert await tier.submit_write(NS, k, payload(3000, i), 1, 3000)
        await tier.close()
        paths = [F.chunk_path(tmp_path, NS, k) for k in keys]
        corrupt(paths[0], 0)                                  # bad magic
        raw = bytearray(paths[1].read_bytes())
        raw[8] = 9                                            # foreign format version
        paths[1].write_bytes(bytes(raw))
        os.truncate(paths[2], 4096)                           # wrong length
        corrupt(paths[3], 4096 + 5)                           # payload: found on read, not scan
        tmp = paths[4].with_name(paths[4].name + ".tmp-1-dead-beef")
        tmp.write_bytes(b"partial")
        (paths[4].parent / "notes.txt").write_text("not ours")

        tier = DiskTier(tmp_path, capacity=2**20)
        tier.start()
        await tier._scan
        rec = tier.recovery
        assert rec["state"] == "done" and rec["chunks"] == 3 and rec["removed"] == 3
        assert rec["temp_removed"] == 1 and not tmp.exists()
        assert (paths[4].parent / "notes.txt").exists()
        assert set(tier.entries) == {keys[3], keys[4], keys[5]}
        out = np.zeros(3000, np.uint8)
        assert await tier.read_into(tier.get(keys[5]), out) and (out == payload(3000, 5)).all()
        assert not await tier.read_into(tier.get(keys[3]), out)
        await tier.close()
    run(main())
