"""Virtual-memory KV pools lent by file descriptor, end to end on the fake GPU (tests/fakecuda).

The engine (this process, or a spawned one) lays its KV out as vLLM 0.34's
extensible cache does, through kvd_protocol.cuda_vmm on the fake driver (one
reserved range, exportable allocations mapped side by side, a segment per
layer); kvd_client finds the allocations, exports them as file descriptors and
lends them over fds.sock; a real ``kvd serve --gpu on`` imports and maps them
and copies by DMA and by kernels. Checked: bytes exact (destination poisoned,
pages outside the load untouched), for one and for two allocations per layer
and both copy paths; the daemon keeps no descriptor of a pool once it is
registered nor any mapping once it is unregistered; a registration naming
file descriptors that are no GPU allocation is refused and the daemon serves
on; an engine SIGKILLed with its pool registered is reaped, its mapping
released, and a daemon killed and restarted is lent the descriptors again by
the same client.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from daemons import wait_reaped

import kvd_client
from kvd_protocol import fd_pass
from kvd_protocol.errors import BadRequest
from kvd_protocol.runtime import fd_socket_path

CHUNK = 16
LAYERS = 4
PATHS = {"dma": {"gpu_copy_path": "dma"},
         "kernels": {"gpu_copy_path": "kernels", "gpu_stage_slot_bytes": "1MiB"}}


def daemon_pid(d) -> int:
    return d.proc.proc.pid  # FakeGpuDaemon -> DaemonProc -> Popen


def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{daemon_pid(d)}/fd"))


def fd_names(d) -> list[str]:
    fd_dir = f"/proc/{daemon_pid(d)}/fd"
    names = []
    for f in os.listdir(fd_dir):
        try:
            names.append(os.readlink(f"{fd_dir}/{f}"))
        except OSError:
            pass
    return sorted(names)


def holds_no_vmm(d) -> bool:
    """Whether the daemon has no descriptor of, and no mapping of, a fake virtual-memory
    allocation (settling: the close follows the unregister reply)."""
    end = time.monotonic() + 10
    while True:
        with open(f"/proc/{daemon_pid(d)}/maps") as f:
            mapped = "fakecuda-vmm" in f.read()
        if not mapped and not [n for n in fd_names(d) if "fakecuda-vmm" in n]:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def settles_at(d, count: int) -> bool:
    end = time.monotonic() + 10
    while daemon_fds(d) != count and time.monotonic() < end:
        time.sleep(0.05)
    return daemon_fds(d) == count


def vmm_pool(chunks_per_layer: int = 1, seed: int = 0):
    from fakecuda import engine
    tensors, mapping = engine.vmm_kv_tensors("vllm_flash_attn", LAYERS, 64, 16, 8, 64,
                                             chunks_per_layer, seed)
    return tensors, engine.FakeCudaKVPool("vllm_flash_attn", tensors), mapping


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("chunks_per_layer", [1, 2])
def test_vmm_pool_stores_and_loads_exact(fake_engine, fake_daemon, path, chunks_per_layer):
    d = fake_daemon(chunk_tokens=CHUNK, host_capacity="256MiB", **PATHS[path])
    assert fd_socket_path(d.runtime_dir).exists(), d.log()
    tensors, pool, mapping = vmm_pool(chunks_per_layer, seed=58)
    assert pool.lends_fds and len(pool.buffers) == 1
    assert pool.buffers[0]["pieces"] == [mapping.size // (LAYERS * chunks_per_layer)] * \
        (LAYERS * chunks_per_layer)
    try:
        with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True,
                                  timeout=30) as c:
            c.connect()
            tokens = np.arange(4 * CHUNK) + 7
            warm = c.register_kv(pool, model="vmm")  # the daemon's GPU set-up and first copies
            assert c.store(tokens, range(4)) == 4 * CHUNK and c.load(tokens, range(8, 12))
            c.unregister(warm)
            reg = c.register_kv(pool, model="vmm")
            assert d.stats()["registrations"] == 1
            tokens = tokens + 1000
            want = [t[:, 0:4].copy() for t in tensors]
            assert c.store(tokens, range(4)) == 4 * CHUNK
            for t in tensors:
                t[:, 8:12] = 0xA5A5
            outside = [np.concatenate([t[:, 4:8], t[:, 12:]], 1).copy() for t in tensors]
            assert c.load(tokens, range(8, 12)) == 4 * CHUNK
            for t, w, o in zip(tensors, want, outside):
                assert np.array_equal(t[:, 8:12], w)
                assert np.array_equal(np.concatenate([t[:, 4:8], t[:, 12:]], 1), o)
            c.unregister(reg)
            assert holds_no_vmm(d), f"the daemon kept the pool's allocations: {fd_names(d)}"
    finally:
        mapping.close()
    assert "Traceback" not in d.log(), d.log()


def test_descriptors_that_are_no_gpu_memory_are_refused(fake_engine, fake_daemon):
    d = fake_daemon(chunk_tokens=CHUNK, host_capacity="256MiB")
    tensors, pool, mapping = vmm_pool()
    try:
        with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True,
                                  timeout=30) as c:
            c.connect()
            reg = c.register_kv(pool, model="vmm")
            fields = dict(reg.fields)
            base = daemon_fds(d)
            fake = os.memfd_create("not-gpu-memory")
            os.ftruncate(fake, pool.buffers[0]["size"])
            try:
                token = fd_pass.lend(fd_socket_path(d.runtime_dir), [fake] * LAYERS)
            finally:
                os.close(fake)
            assert settles_at(d, base + LAYERS)
            bad = {**fields, "buffers": [{**b, "token": token} for b in pool.buffers]}
            with pytest.raises(BadRequest, match="not a CUDA allocation"):
                c._call("register", bad)
            assert settles_at(d, base)
            with pytest.raises(BadRequest, match="no file descriptors were lent"):
                c._call("register", bad)  # the token was used up
            null = os.open("/dev/null", os.O_RDONLY)
            try:
                wrong = [{**b, "token": fd_pass.lend(fd_socket_path(d.runtime_dir), [null])}
                         for b in pool.buffers]
            finally:
                os.close(null)
            with pytest.raises(BadRequest, match="1 file descriptors lent for 4 pieces"):
                c._call("register", {**fields, "buffers": wrong})
            assert settles_at(d, base)
            tokens = np.arange(2 * CHUNK)
            assert c.store(tokens, range(2)) == 2 * CHUNK  # the real pool still serves
            c.unregister(reg)
    finally:
        mapping.close()


def _vmm_engine(runtime_dir: str, conn) -> None:
    from fakecuda import driver
    driver.install()
    _, pool, _ = vmm_pool(seed=3)
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=30).connect()
    client.register_kv(pool, model="vmm-dying")
    assert client.store(np.arange(4 * CHUNK), range(4)) == 4 * CHUNK
    conn.send(os.getpid())
    time.sleep(120)


def test_killed_engine_is_reaped_and_its_mapping_released(fake_engine, fake_daemon):
    import multiprocessing
    d = fake_daemon(chunk_tokens=CHUNK, host_capacity="256MiB", client_timeout_s=1.0,
                    heartbeat_interval_s=0.2)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_vmm_engine, args=(str(d.runtime_dir), child))
    proc.start()
    try:
        assert parent.poll(60), "the engine did not start"
        pid = parent.recv()
        os.kill(pid, signal.SIGKILL)
        proc.join(10)
        wait_reaped(d, 15)
        assert d.stats()["registrations"] == 0
        # the daemon holds no memfd of the dead engine's allocations any more
        assert holds_no_vmm(d), f"the dead engine's memory is still held: {fd_names(d)}"
    finally:
        if proc.is_alive():
            proc.kill()
    assert "Traceback" not in d.log(), d.log()


def test_restarted_daemon_is_lent_the_descriptors_again(fake_engine, fake_daemon):
    knobs = {"chunk_tokens": CHUNK, "host_capacity": "256MiB"}
    d = fake_daemon(**knobs)
    tensors, pool, mapping = vmm_pool(seed=9)
    try:
        c = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=10).connect()
        try:
            c.register_kv(pool, model="vmm-phoenix")
            tokens = np.arange(4 * CHUNK) + 1
            assert c.store(tokens, range(4)) == 4 * CHUNK
            d.kill()
            d2 = fake_daemon(runtime_dir=d.runtime_dir, **knobs)
            # new tokens: the first daemon's chunks come back unverified after its SIGKILL,
            # and a load may miss them until the new daemon checked them
            tokens = tokens + 10_000
            deadline = time.monotonic() + 20
            while c.store(tokens, range(4)) != 4 * CHUNK:
                assert time.monotonic() < deadline, "the client did not come back"
                time.sleep(0.1)
            want = [t[:, 0:4].copy() for t in tensors]
            for t in tensors:
                t[:, 20:24] = 0x5A5A
            assert c.load(tokens, range(20, 24)) == 4 * CHUNK
            assert all(np.array_equal(t[:, 20:24], w) for t, w in zip(tensors, want))
            assert d2.stats()["registrations"] == 1
        finally:
            c.close()
    finally:
        mapping.close()
