"""Mapping a client's shared-memory file, after checking it may be mapped.

``map_shm_file(path, size, shm_dir, what, forbid, owner_uid)`` opens ``path`` without
following symlinks and maps ``size`` bytes read/write. Promises: the file is a regular file
directly in ``shm_dir``, owned by ``owner_uid``, at least ``size`` bytes, and neither the
daemon's own arena (``forbid``) nor any ``kvd-arena-*`` file; anything else is a
``BadRequest`` naming ``what``. Never lets one tenant make the daemon map another's file.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

from kvd_protocol.errors import BadRequest
from kvd_protocol.wire import describe


def map_shm_file(path: str, size: int, shm_dir: Path, what: str,
                 forbid: tuple[int, int] | None = None, owner_uid: int | None = None) -> mmap.mmap:
    owner_uid = os.geteuid() if owner_uid is None else owner_uid
    p, shown = Path(path), describe(path)  # a peer's string: shown bounded and escaped
    if not p.is_absolute() or p.parent.resolve() != shm_dir:
        raise BadRequest(f"{what}.path must be a file directly inside {shm_dir}")
    if p.name.startswith("kvd-arena-"):
        raise BadRequest(f"{what}: {shown} is a kvd host tier file, not a pool")
    try:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadRequest(f"{what}: cannot open {shown}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"{what}: {shown} is not a regular file")
        if st.st_uid != owner_uid:
            raise BadRequest(f"{what}: {shown} belongs to uid {st.st_uid}, not to the registering "
                             f"process's uid {owner_uid}")
        if forbid is not None and (st.st_dev, st.st_ino) == forbid:
            raise BadRequest(f"{what}: {shown} is the daemon's own host tier")
        if size < 1 or st.st_size < size:
            raise BadRequest(f"{what}: {shown} holds {st.st_size} bytes, not {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
