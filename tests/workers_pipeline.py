"""Engine processes (spawned, so importable by name) and pools of tests/server/test_pipeline*.py."""

from __future__ import annotations

import os
import time

import numpy as np
import zmq
from rawwire import Raw, pages

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.runtime import engine_endpoint

GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")


def random_pool(seed: int, num_pages: int = 64) -> kvd_client.SharedKVPool:
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, num_pages, 4, 2, 8, "float16")
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def stuck_store(runtime_dir: str, key: bytes, report) -> None:
    """Register, send a store whose seq the (imaginary) engine stream never reaches,
    tell the test, and wait to be killed."""
    ctx = zmq.Context()
    raw = Raw(engine_endpoint(__import__("pathlib").Path(runtime_dir)), ctx)
    pool = kvd_client.SharedKVPool(*GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 4)
    raw.hello()
    reg = raw.register(pool, model="stuck")
    raw.next_id += 1
    raw.sock.send_multipart([__import__("msgpack").packb(
        {"v": 2, "id": raw.next_id, "op": "store", "reg": reg, "after": 7}), key, pages(0, 1, 2, 3)])
    report.send({"pid": os.getpid(), "pool": str(pool.path), "flags": str(pool.flags.path)})
    time.sleep(120)


def flood(runtime_dir: str, seconds: float, report) -> None:
    """Store 8 chunks, then send loads of them as fast as possible without waiting for
    replies (at most 4096 unanswered); count the replies by code."""
    import msgpack
    ctx = zmq.Context()
    raw = Raw(engine_endpoint(__import__("pathlib").Path(runtime_dir)), ctx)
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 4, 64, 16, 8, 64, "float16")  # 64 KiB chunks
    pool.flags = ClientFlags(pool.num_layers, 4)
    keys = b"".join(bytes([i]) * 16 for i in range(8))
    counts = {"ok": 0}
    try:
        raw.hello()
        reg = raw.register(pool, model="flood")
        assert raw.ok("store", [keys, pages(*range(8))], reg=reg)["stored"] == 8
        frames = [keys, pages(*range(8, 16))]
        end, sent, received = time.monotonic() + seconds, 0, 0
        while time.monotonic() < end or received < sent:
            while sent - received < 4096 and time.monotonic() < end:
                sent += 1
                raw.sock.send_multipart([msgpack.packb({"v": 2, "id": sent, "op": "load", "reg": reg,
                                                        "slot": 0, "seq": sent}), *frames])
            if raw.sock.poll(1000):
                reply = msgpack.unpackb(raw.sock.recv_multipart()[0])
                if reply.get("id") == 0:
                    continue  # the daemon's liveness probe
                received += 1
                code = reply["error"]["code"] if "error" in reply else "ok"
                counts[code] = counts.get(code, 0) + 1
            elif time.monotonic() > end + 10:
                break
        raw.next_id = sent
        raw.call("bye")  # (reaped already if the daemon ever dropped replies: then no_session)
    except Exception as exc:  # noqa: BLE001 - the test reads what went wrong
        counts["worker_error"] = repr(exc)
    finally:
        raw.close()
        pool.flags.close()
        pool.close()
        ctx.destroy(linger=0)
    report.send(counts)
