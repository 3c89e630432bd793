"""Host copy backend: engine KV pools in shared-memory files, copies in numpy.

Serves CPU inference engines and runs the whole protocol where there is no
GPU. A pool buffer is ``{kind: "shm", path, size}``: a regular file inside
the configured shm directory, owned by the registering process's uid (from
the kernel; the daemon's own user when that is unknown), so one tenant can
never make the daemon map another's pool; opened without following symlinks
and at least ``size`` bytes long; it is mapped read/write; the daemon's own
arena is refused. Copies run on a small thread pool (numpy releases the GIL for
the bulk of a copy) and complete through asyncio futures.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvd.copy import host_ops as host_copy
from kvd.copy.plan import CopyPlan
from kvd_protocol.errors import BadRequest
from kvd_protocol.layout import LayoutDescriptor


@dataclass
class HostPool:
    maps: list
    arrays: list


class HostCopyEngine:
    name = "host"

    def __init__(self, arena: np.ndarray, shm_dir: Path, threads: int = 2, arena_path: Path | None = None):
        self.arena = arena
        st = os.stat(arena_path) if arena_path else None
        self._arena_id = (st.st_dev, st.st_ino) if st else None
        self.shm_dir = Path(shm_dir).resolve()
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvd-copy")

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, events=(),
                  owner_uid: int | None = None) -> HostPool:
        if events:
            raise BadRequest("the host backend takes no CUDA events")
        maps = []
        try:
            for i, b in enumerate(buffers):
                if b["kind"] != "shm":
                    raise BadRequest(f"buffers[{i}]: the host backend takes only shm buffers")
                maps.append(self._map_file(b["path"], b["size"], i,
                                           os.geteuid() if owner_uid is None else owner_uid))
            try:
                layout.validate_extent([b["size"] for b in buffers])
            except ValueError as exc:
                raise BadRequest(f"layout does not fit its buffers: {exc}") from None
        except BaseException:
            for m in maps:
                m.close()
            raise
        return HostPool(maps, [np.frombuffer(m, dtype=np.uint8) for m in maps])

    def _map_file(self, path: str, size: int, i: int, owner_uid: int) -> mmap.mmap:
        p = Path(path)
        if not p.is_absolute() or p.parent.resolve() != self.shm_dir:
            raise BadRequest(f"buffers[{i}].path must be a file directly inside {self.shm_dir}")
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise BadRequest(f"buffers[{i}]: cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"buffers[{i}]: {path} is not a regular file")
            if st.st_uid != owner_uid:
                raise BadRequest(f"buffers[{i}]: {path} belongs to uid {st.st_uid}, not to the "
                                 f"registering process's uid {owner_uid}")
            if (st.st_dev, st.st_ino) == self._arena_id:
                raise BadRequest(f"buffers[{i}]: {path} is the daemon's own host tier")
            if size < 1 or st.st_size < size:
                raise BadRequest(f"buffers[{i}]: {path} holds {st.st_size} bytes, not {size}")
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def close_pool(self, pool: HostPool) -> None:
        pool.arrays.clear()
        for m in pool.maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still alive somewhere; unmapped when collected

    def _submit(self, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def gather(self, plan: CopyPlan) -> asyncio.Future:
        return self._submit(host_copy.gather, plan.pool.arrays, self.arena, plan.layout,
                            plan.chunk_tokens, plan.page_ids, plan.shard_offsets)

    def scatter(self, plan: CopyPlan) -> asyncio.Future:
        return self._submit(host_copy.scatter, plan.pool.arrays, self.arena, plan.layout,
                            plan.chunk_tokens, plan.page_ids, plan.shard_offsets, plan.layers)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
