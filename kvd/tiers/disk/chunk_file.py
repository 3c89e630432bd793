"""Disk chunk files: the on-disk format of one chunk, and its IO.

One file per chunk, ``<root>/<ns-hex[:2]>/<ns-hex>/<key-hex>.kvc``: a 4096-byte header
(magic, versions, namespace, key, lengths, payload digest of kvd.tiers.disk.digest, header
checksum; docs/protocol.md §11) then the padded canonical bytes. ``ChunkFiles.write`` never
leaves a partial file under a final name (temp, fsync, rename); failures raise ``OSError``
with errno kept. ``read_into`` returns only verified bytes, else ``ChunkCorrupt`` or
``FileNotFoundError``; ``read_header`` checks without the payload. O_DIRECT where the
filesystem takes it. Methods block: IO threads only, never the event loop. All payload IO
goes through ``write_parts``/``read_parts`` (tests override them to inject faults).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvd.tiers.disk.digest import payload_digest
from kvd_protocol.layout import CANONICAL_VERSION

MAGIC = b"KVDCHUNK"
FORMAT_VERSION = 2  # 2: segmented payload digest (kvd/tiers/disk/digest.py)
HEADER_BYTES = 4096
ALIGN = 4096
SUFFIX = ".kvc"
TMP_MARK = ".tmp-"
# magic, format version, canonical version, ns, key, payload length, shards, shard bytes, digest
_FIELDS = struct.Struct("<8sII16s16sQIQ16s")
HEADER = struct.Struct(_FIELDS.format + "Q")  # + xxh3-64 of the fields above


class ChunkCorrupt(Exception):
    """A chunk file whose header, length or checksum does not verify."""


@dataclass(frozen=True)
class ChunkHeader:
    ns: bytes
    key: bytes
    length: int
    shards: int
    shard_bytes: int
    digest: bytes


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def file_size(length: int) -> int:
    return HEADER_BYTES + padded(length)


def chunk_path(root: Path, ns: bytes, key: bytes) -> Path:
    h = ns.hex()
    return Path(root) / h[:2] / h / f"{key.hex()}{SUFFIX}"


def pack_header(ns: bytes, key: bytes, length: int, shards: int, shard_bytes: int,
                digest: bytes) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, CANONICAL_VERSION, ns, key, length, shards,
                          shard_bytes, digest)
    return fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))


def unpack_header(raw, size: int | None = None) -> ChunkHeader:
    """Parse and verify a header (``size``: the file's length, checked when given)."""
    if len(raw) < HEADER.size:
        raise ChunkCorrupt("short header")
    magic, version, canon, ns, key, length, shards, shard_bytes, digest, check = \
        HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ChunkCorrupt("bad magic")
    if version != FORMAT_VERSION or canon != CANONICAL_VERSION:
        raise ChunkCorrupt(f"foreign format version {version}/{canon}")
    if xxhash.xxh3_64_intdigest(bytes(raw[:_FIELDS.size])) != check:
        raise ChunkCorrupt("header checksum mismatch")
    if shards < 1 or shards * shard_bytes != length:
        raise ChunkCorrupt("inconsistent shard sizes")
    if size is not None and size != file_size(length):
        raise ChunkCorrupt(f"file is {size} bytes, header says {file_size(length)}")
    return ChunkHeader(ns, key, length, shards, shard_bytes, digest)


def parse_name(path: Path) -> tuple[bytes, bytes] | None:
    """(ns, key) from a final chunk file path, or None when it is not one."""
    try:
        if path.suffix != SUFFIX or len(path.stem) != 32 or len(path.parent.name) != 32:
            return None
        return bytes.fromhex(path.parent.name), bytes.fromhex(path.stem)
    except ValueError:
        return None


def read_header(path: Path) -> ChunkHeader:
    """Verify a file's header and length against its name; payload not read."""
    with open(path, "rb", buffering=0) as f:
        raw = f.read(HEADER.size)
        size = os.fstat(f.fileno()).st_size
    head = unpack_header(raw, size)
    if parse_name(Path(path)) != (head.ns, head.key):
        raise ChunkCorrupt("header does not match the file name")
    return head


def probe_direct(root: Path) -> bool:
    """True when files under ``root`` can be written and read with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(root) / f".probe{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


class ChunkFiles:
    """Chunk file IO under ``root``; thread-safe (one bounce buffer per thread)."""

    def __init__(self, root: Path, direct: bool | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.direct = probe_direct(self.root) if direct is None else direct
        self.temp_prefix = f"{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}-"  # this process's
        self._local = threading.local()

    @property
    def mode(self) -> str:
        return "O_DIRECT" if self.direct else "buffered (no O_DIRECT on this filesystem)"

    def _bounce(self, size: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = self._local.buf = mmap.mmap(-1, padded(size))  # page-aligned
        return buf

    def _flags(self) -> int:
        return os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)

    def _zero_copy(self, mv: memoryview) -> bool:
        """IO straight from/to ``mv``: always when buffered; O_DIRECT needs it 4096-aligned."""
        if not self.direct:
            return True
        return mv.nbytes % ALIGN == 0 and np.frombuffer(mv, np.uint8).ctypes.data % ALIGN == 0

    def write(self, ns: bytes, key: bytes, payload, shards: int, shard_bytes: int) -> Path:
        """Write one chunk file from ``payload`` (a buffer); returns the final path."""
        src = memoryview(payload).cast("B")
        length = src.nbytes
        total = file_size(length)
        direct_src = self._zero_copy(src)
        buf = self._bounce(HEADER_BYTES if direct_src else total)
        view = memoryview(buf)
        try:
            if direct_src:
                digest = payload_digest(src)
                pad = total - HEADER_BYTES - length
                parts = [view[:HEADER_BYTES], src] + ([bytes(pad)] if pad else [])
            else:  # O_DIRECT from an unaligned source: one aligned bounce buffer
                _copy(buf, HEADER_BYTES, src)  # numpy copies release the GIL
                view[HEADER_BYTES + length:total] = bytes(total - HEADER_BYTES - length)
                digest = payload_digest(view[HEADER_BYTES:HEADER_BYTES + length])
                parts = [view[:total]]
            head = pack_header(ns, key, length, shards, shard_bytes, digest)
            view[:HEADER_BYTES] = head + bytes(HEADER_BYTES - len(head))
            final = chunk_path(self.root, ns, key)
            new_dir = not final.parent.is_dir()
            if new_dir:
                final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f"{final.name}{self.temp_prefix}{secrets.token_hex(6)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(), 0o600)
            try:
                try:
                    self.write_parts(fd, parts)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if new_dir:  # make the new directory entries durable too
                _fsync_dir(final.parent)
                _fsync_dir(final.parent.parent)
            return final
        finally:
            view.release()

    def read_into(self, path: Path, ns: bytes, key: bytes, dest) -> ChunkHeader:
        """Read the file at ``path`` into ``dest`` (exactly the payload's size) and verify it.

        On ``ChunkCorrupt`` or ``OSError`` the contents of ``dest`` are unspecified: the
        caller must not use them (the disk tier reads into a slot nobody can see yet).
        """
        out = memoryview(dest).cast("B")
        fd = os.open(path, os.O_RDONLY | self._flags())
        try:
            size = os.fstat(fd).st_size
            if size != file_size(out.nbytes):
                raise ChunkCorrupt(f"file is {size} bytes, expected {file_size(out.nbytes)}")
            direct_dst = self._zero_copy(out)
            buf = self._bounce(size if not direct_dst else size - out.nbytes)
            view = memoryview(buf)
            try:
                if direct_dst:
                    pad = size - HEADER_BYTES - out.nbytes
                    parts = [view[:HEADER_BYTES], out] + ([view[HEADER_BYTES:HEADER_BYTES + pad]]
                                                           if pad else [])
                else:
                    parts = [view[:size]]
                if self.read_parts(fd, parts) < size:
                    raise ChunkCorrupt("file shorter than its header says")
                head = unpack_header(view[:HEADER.size], size)
                if head.ns != ns or head.key != key:
                    raise ChunkCorrupt("header names another chunk")
                if head.length != out.nbytes:
                    raise ChunkCorrupt(f"payload is {head.length} bytes, expected {out.nbytes}")
                payload = out if direct_dst else view[HEADER_BYTES:HEADER_BYTES + head.length]
                pad = view[HEADER_BYTES:size - out.nbytes] if direct_dst else \
                    view[HEADER_BYTES + head.length:size]
                if np.frombuffer(pad, np.uint8).any():  # the GPU path hashes the padding it reads: keep both paths alike
                    raise ChunkCorrupt("non-zero padding")
                if payload_digest(payload) != head.digest:
                    raise ChunkCorrupt("payload checksum mismatch")
                if not direct_dst:
                    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(payload, np.uint8))
                    payload.release()
                return head
            finally:
                view.release()
        finally:
            os.close(fd)


    def write_parts(self, fd: int, parts: list) -> int:
        """Write ``parts`` at offset 0 of ``fd``, all of them (raises ``OSError``)."""
        return _io_all(os.pwritev, fd, parts)

    def read_parts(self, fd: int, parts: list) -> int:
        """Fill ``parts`` from offset 0 of ``fd``; bytes read (fewer at end of file)."""
        return _io_all(os.preadv, fd, parts)


def _io_all(call, fd: int, parts: list) -> int:
    """``os.pwritev``/``os.preadv`` of ``parts`` from offset 0 until done or end of file."""
    parts = [memoryview(p).cast("B") for p in parts]
    total = sum(p.nbytes for p in parts)
    done = 0
    while parts:
        n = call(fd, parts, done)
        if n == 0:
            break
        done += n
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]
    return min(done, total)


def _copy(buf: mmap.mmap, offset: int, src: memoryview) -> None:
    dst = np.frombuffer(buf, np.uint8, src.nbytes, offset)
    np.copyto(dst, np.frombuffer(src, np.uint8))
    del dst


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
