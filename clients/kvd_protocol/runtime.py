"""Where a daemon's sockets live: the runtime-directory rules every side shares.

The runtime directory is resolved the same way by ``kvd serve``, every
other ``kvd`` command and the client library: an explicit value, else
$KVD_RUNTIME_DIR, $RUNTIME_DIRECTORY (systemd), $XDG_RUNTIME_DIR/kvd,
/run/kvd for root, /tmp/kvd-<uid>. It holds ``kvd.sock`` (engines),
``control.sock`` (operators), ``fds.sock`` (file descriptors of virtual-memory
KV pools, kvd_protocol.fd_pass; only where the daemon serves them) and
``kvd.lock`` (the daemon's instance lock; kvd.server.runtime_dir creates and
guards the directory).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def resolve_runtime_dir(explicit: str | None = None, env=None) -> Path:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    for var in ("KVD_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if env.get(var):
            # systemd may list several directories separated by ':'
            return Path(env[var].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvd"
    if os.geteuid() == 0:
        return Path("/run/kvd")
    return Path(f"/tmp/kvd-{os.geteuid()}")


def engine_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / 'kvd.sock'}"


def control_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / 'control.sock'}"


def fd_socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / "fds.sock"


def instance_tag(runtime_dir: Path) -> str:
    """Short stable name of a runtime dir, used to name its shared memory."""
    return hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
