"""What ``kvd serve`` checks and builds before it serves, cheapest checks first.

``check(cfg, runtime_dir)`` runs before the host tier's allocation: runtime dir, ``shm_dir``
and ``disk_dir`` usable with room (only a missing last component of ``disk_dir`` is made),
optional libraries present, users and groups a ``quota`` rule binds exist. A bad knob value
raises ``ConfigError`` (one line, exit 2); anything else ``StartupError`` (one line, exit
1). ``raise_fd_limit`` lifts the open-files soft limit to the hard one (``fd_limit``,
``fds_open``: the connection caps' basis). ``make_remote``, ``open_disk``,
``make_cuda_engine`` and ``make_gds`` build the optional parts: only "not available here"
errors turn one off with a log line (``gpu = "on"``: any failure stops start-up).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import sys
from pathlib import Path

from kvd.server import metrics
from kvd.server.kept_tier import kept_bytes
from kvd.server.runtime_dir import prepare_runtime_dir
from kvd.server.tenants import TenantBindings
from kvd.tiers.host.arena import room_problem
from kvd_protocol.errors import ConfigError

log = logging.getLogger("kvd")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, NUL included


class StartupError(RuntimeError):
    """Start-up cannot go on; the message is one line for the log."""


class NoCudaDevice(RuntimeError):
    pass


def fd_limit() -> int:
    """The open files soft limit now (nr_open, or 1M, where it is unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        return soft
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def fds_open() -> int:
    """Descriptors this process has open now (64 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def raise_fd_limit() -> int:
    """The open files soft limit, raised to the hard one (capped by the kernel's nr_open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("open files limit stays %d (raising it to %d failed: %s)", soft, target, exc)
            return soft
        log.info("open files limit raised from %d to %d", soft, target)
        return target
    return soft


def check(cfg, runtime_dir: Path, group: int | None = None) -> None:
    longest = len(os.fsencode(runtime_dir / "control.sock"))
    if longest > MAX_SOCKET_PATH:
        raise ConfigError("runtime_dir", f"{runtime_dir} is too long for a Unix socket path "
                          f"({longest} bytes with /control.sock; at most {MAX_SOCKET_PATH})")
    TenantBindings(cfg.quota)  # a user or group a quota rule names must exist
    prepare_runtime_dir(runtime_dir, group)
    shm_dir = Path(cfg.shm_dir)
    _writable_dir("shm_dir", shm_dir, create=False)
    problem = room_problem(shm_dir, cfg.host_capacity, kept_bytes(shm_dir, runtime_dir))
    if problem:
        raise ConfigError("host_capacity", problem)
    if cfg.disk_dir:
        _writable_dir("disk_dir", Path(cfg.disk_dir), create=True)
        problem = disk_room_problem(Path(cfg.disk_dir), cfg.disk_capacity)
        if problem:
            raise ConfigError("disk_capacity", problem)
    if cfg.remote_backend != "off":
        _check_remote(cfg)
    problem = metrics.library_problem(cfg)
    if problem:
        raise StartupError(problem)
    if cfg.gpu == "on" and importlib.util.find_spec("cupy") is None:
        raise StartupError("gpu = on but CuPy is not installed (pip install cupy-cuda13x: kvd-cache's "
                           "gpu extra), or set gpu = auto or off")


def _writable_dir(key: str, path: Path, create: bool) -> None:
    if create and not os.path.lexists(path):
        try:
            path.mkdir(exist_ok=True)  # the last component only: see the module's docstring
        except FileNotFoundError:
            raise ConfigError(key, f"cannot create {path}: {path.parent} does not exist (kvd "
                              "creates only the last directory; check the path)") from None
        except OSError as exc:
            raise ConfigError(key, f"cannot create {path}: {exc.strerror}") from None
    if not path.exists():
        raise ConfigError(key, f"{path} does not exist")
    if not path.is_dir():
        raise ConfigError(key, f"{path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{path} is not writable by uid {os.geteuid()}")


def disk_room_problem(disk_dir: Path, capacity: int) -> str | None:
    """Why a disk tier of ``capacity`` bytes cannot fit in ``disk_dir``, or None. kvd's
    chunk files there count as room (the tier keeps or replaces them); they are only
    counted when the free space alone falls short, as a large tier has millions."""
    st = os.statvfs(disk_dir)
    free = st.f_bavail * st.f_frsize
    if free >= capacity:
        return None
    held = _chunk_file_bytes(disk_dir, capacity - free)
    if free + held >= capacity:
        return None
    files = f" and {held / 2**30:.2f} GiB in kvd's chunk files" if held else ""
    return (f"a disk tier of {capacity / 2**30:.2f} GiB does not fit: {disk_dir} has "
            f"{free / 2**30:.2f} GiB free{files} (lower disk_capacity or make room)")


def _chunk_file_bytes(root: Path, enough: int) -> int:
    """Bytes of the chunk files under ``root`` (their sizes, as the disk tier counts them
    against disk_capacity), counted until ``enough``."""
    from kvd.tiers.disk.chunk_file import SUFFIX
    total = 0
    for parent, _, names in os.walk(root):
        for name in names:
            if name.endswith(SUFFIX):
                try:
                    total += os.stat(os.path.join(parent, name)).st_size
                except OSError:
                    continue  # gone meanwhile
        if total >= enough:
            break
    return total


REMOTE_CLIENTS = {"redis": ("redis", "redis"),  # module, the package of its kvd-cache extra
                  "mooncake": ("mooncake", "mooncake-transfer-engine-non-cuda")}


def _check_remote(cfg) -> None:
    if not cfg.remote_address:
        raise ConfigError("remote_address", f"remote_backend = {cfg.remote_backend} needs the "
                          "store's address")
    module, package = REMOTE_CLIENTS[cfg.remote_backend]
    if importlib.util.find_spec(module) is None:
        raise StartupError(f"remote_backend = {cfg.remote_backend} but its client is not installed: "
                           f"pip install {package} (kvd-cache's {cfg.remote_backend} extra)")


def make_remote(cfg, host, view, arena_path):
    """The remote tier (kvd.tiers.remote.tiering) over ``cfg.remote_backend``; it connects in
    the background: a store that is down at start-up leaves kvd local-only until it answers.
    The zero-copy path (Mooncake, Redis) checks chunks in ``remote_digest_processes`` processes that
    map the arena at ``arena_path`` (kvd/tiers/remote/digest_pool.py)."""
    from kvd.tiers.remote.calls import CPU_THREADS
    from kvd.tiers.remote.digest_pool import DigestPool, auto_processes
    from kvd.tiers.remote.mooncake import MooncakeStore
    from kvd.tiers.remote.store import RedisStore
    from kvd.tiers.remote.tier import RemoteTier
    from kvd.tiers.remote.tiering import RemoteTiering
    from kvd.tiers.remote.value import Seal, store_prefix
    try:
        if cfg.remote_backend == "redis":
            store = RedisStore(cfg.remote_address, cfg.remote_timeout_s, cfg.remote_ttl_s,
                               cfg.remote_redis_zero_copy)
        else:
            store = MooncakeStore(cfg.remote_address, cfg.remote_timeout_s,
                                  cfg.remote_mooncake_metadata, cfg.remote_mooncake_local_host,
                                  cfg.remote_mooncake_segment_bytes,
                                  cfg.remote_mooncake_buffer_bytes,
                                  cfg.remote_mooncake_zero_copy)
    except ValueError as exc:
        raise ConfigError("remote_address", str(exc)) from None
    seal = Seal(cfg.remote_secret) if cfg.remote_secret else None
    processes = auto_processes(cfg.remote_digest_processes) if store.want_zero_copy else 0
    remote = RemoteTier(store, store_prefix(cfg.remote_prefix, seal), cfg.remote_timeout_s,
                        cfg.remote_threads, cfg.remote_breaker_failures, cfg.remote_breaker_retry_s,
                        max(CPU_THREADS, processes))
    digests = DigestPool(arena_path, view.nbytes, processes)
    return RemoteTiering(host, remote, view, cfg.remote_publish, cfg.remote_queue_chunks, seal,
                         digests)


def open_disk(cfg):
    from kvd.tiers.disk.tier import DiskTier
    try:
        return DiskTier(cfg.disk_dir, cfg.disk_capacity, cfg.disk_io_threads, cfg.disk_queue_chunks)
    except OSError as exc:
        raise StartupError(f"cannot use disk_dir {cfg.disk_dir}: {exc.strerror or exc}") from None


def cuda_unavailable_errors() -> tuple:
    """The exceptions that mean "no usable CUDA here", as opposed to a bug of ours."""
    errors = [ImportError, OSError, NoCudaDevice]
    cuda = getattr(sys.modules.get("cupy"), "cuda", None)
    for module, name in (("runtime", "CUDARuntimeError"), ("driver", "CUDADriverError")):
        cls = getattr(getattr(cuda, module, None), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errors.append(cls)
    return tuple(errors)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def open_fd_intake(service, cuda, runtime_dir: Path, group: int | None) -> None:
    """With the CUDA backend: fds.sock, where engines lend the file descriptors of
    virtual-memory KV pools (kvd.server.fd_intake), and ``cuda_vmm`` buffers served."""
    if cuda is None or not cuda.vmm_supported():
        return
    from kvd.server.connections import KEPT_FOR_KVD
    from kvd.server.fd_intake import FdIntake
    from kvd.server.peers import AccessPolicy
    from kvd.server.runtime_dir import share_socket
    from kvd_protocol.fd_pass import BATCH
    from kvd_protocol.runtime import fd_socket_path
    # an eighth of what kvd's own descriptors leave: connections.caps keeps a quarter free
    held = max(BATCH, (fd_limit() - fds_open() - KEPT_FOR_KVD) // 8)
    service.fd_intake = FdIntake(fd_socket_path(runtime_dir), AccessPolicy(group), held)
    service.fd_intake.open()
    share_socket(fd_socket_path(runtime_dir), group)
    service.engines["cuda_vmm"] = cuda


def make_cuda_engine(cfg, arena_view):
    """The CUDA backend, or None when it is off or unavailable (``gpu = "on"``: an error)."""
    if cfg.gpu == "off":
        return None
    try:
        from kvd.cuda.backend import CudaCopyEngine
        from kvd.cuda.dma.path import DmaSettings
        dma = DmaSettings(cfg.gpu_dma_streams, cfg.gpu_dma_min_piece, cfg.gpu_dma_load_window,
                          cfg.gpu_dma_stage_below, cfg.gpu_dma_spread_below,
                          cfg.gpu_dma_store_thread, cfg.gpu_dma_load_thread)
        engine = CudaCopyEngine(arena_view, cfg.gpu_max_blocks, cfg.gpu_stage_slots,
                                cfg.gpu_stage_slot_bytes, cfg.gpu_poll_interval_us,
                                cfg.gpu_copy_path, dma)
        if not engine.uuid_to_ordinal:
            raise NoCudaDevice("no CUDA device visible")
    except Exception as exc:  # noqa: BLE001 - sorted below: unavailable, or a bug of ours
        expected = isinstance(exc, cuda_unavailable_errors())
        if not expected:
            log.error("starting the CUDA backend failed unexpectedly (a bug in kvd, please "
                      "report it)", exc_info=exc)
        if cfg.gpu == "on":
            raise StartupError(f"gpu = on but the CUDA backend is unavailable: {_first_line(exc)}") \
                from None
        if expected:
            log.info("CUDA backend off: %s", _first_line(exc))
        else:
            log.error("CUDA backend off after that error; serving with the host backend only")
        return None
    log.info("CUDA backend on: %d GPU(s) visible", len(engine.uuid_to_ordinal))
    return engine


def make_gds(cfg, tiering, cuda):
    """The GPU Direct Storage loader, or None with the log line saying why not."""
    why = ("there is no disk tier (disk_dir)" if tiering is None else
           "the CUDA backend is off" if cuda is None else None)
    if why is None:
        try:
            from kvd.cuda.gds import GdsLoader, open_gds
            kvikio, mode = open_gds(cfg.disk_io_threads)
            if kvikio is not None:
                loader = GdsLoader(kvikio, mode, tiering.disk, cfg.disk_gds_slot_bytes)
                log.info("GPU Direct Storage on (%s)", mode)
                return loader
            why = mode
        except cuda_unavailable_errors() as exc:
            why = _first_line(exc)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: loud, but GDS is optional
            log.error("starting GPU Direct Storage failed unexpectedly (a bug in kvd, please "
                      "report it)", exc_info=exc)
            why = _first_line(exc)
    log.warning("disk_gds is on but GPU Direct Storage is unavailable: %s; disk chunks load "
                "through the host tier", why)
    return None
