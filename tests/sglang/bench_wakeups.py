"""What thread wake-ups cost a HiCache hit while SGLang's scheduler thread spins (GIL switch interval).

Run in the SGLang venv against a running daemon (docs/sglang.md, "Where a
hit's time goes"):

    .venv/bin/kvd serve --runtime-dir /tmp/kvd-bench --chunk-tokens 64 --host-capacity 1GiB \\
        --warm-restart false &
    PYTHONPATH=clients TORCH_EXTENSIONS_DIR=.venv-sglang/torch_extensions \\
        .venv-sglang/bin/python tests/sglang/bench_wakeups.py --runtime-dir /tmp/kvd-bench

The real backend on SGLang's real host pool, driven the way HiCache drives it
(SGLang 0.5.16's threads, rebuilt here with its hand-offs, not SGLang's
code; SGLang 0.5.16 or 0.5.23): a "scheduler" thread queues a prefetch; a prefetch thread, woken by
its queue, calls ``batch_exists``; the scheduler thread picks the hit up
on a later pass of its loop and queues the load; an IO thread, woken by its
queue, calls ``batch_get_v1``; the scheduler thread sees it done. The pages
are few and small, so what is timed is the fixed cost: the hand-offs, the
two kvd round trips and the wake-ups. Each case: median and p90 over
``--rounds`` of the whole hit, and of the time inside the backend's calls:

- ``blocking``: the scheduler thread sleeps in a queue between passes;
- ``spinning``: it polls without waiting, as SGLang's does (its loop never
  blocks while a request waits on a prefetch), holding the GIL;
- ``spinning, switch X ms``: the same with Python's switch interval set to
  X (what the backend's ``kvd_gil_switch_ms`` does).
"""

from __future__ import annotations

import argparse
import hashlib
import queue
import statistics
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_worker import host_pool  # noqa: E402  (this directory)


def build(args):
    ps = args.page_size
    dev = MHATokenToKVPool(size=16 * ps, page_size=ps, dtype=torch.bfloat16, head_num=2, head_dim=64,
                           layer_num=4, device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=4)
    host = host_pool(MHATokenToKVPoolHost, dev, ps, "page_first", 4)  # 0.5.16's or 0.5.23's way
    extra = {"backend_name": "kvd", "module_path": "kvd_client.sglang.backend",
             "class_name": "KvdHiCacheStorage", "interface_v1": 1,
             "kvd_runtime_dir": args.runtime_dir, "kvd_key_mode": "hashes"}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                  is_page_first_layout=True, model_name="bench-wakeups",
                                  extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend, host


class Hicache:
    """The prefetch and IO threads, each woken by its queue, as SGLang's cache controller has them."""

    def __init__(self, backend):
        self.backend, self.prefetch_q, self.io_q = backend, queue.Queue(), queue.Queue()
        self.hits, self.done = queue.Queue(), queue.Queue()
        self.inside = 0.0
        for target in (self._prefetch, self._io):
            threading.Thread(target=target, daemon=True).start()

    def _prefetch(self):
        while (op := self.prefetch_q.get()) is not None:
            t0 = time.monotonic()
            op["hit"] = self.backend.batch_exists(op["keys"])
            self.inside += time.monotonic() - t0
            self.hits.put(op)

    def _io(self):
        while (op := self.io_q.get()) is not None:
            t0 = time.monotonic()
            op["got"] = self.backend.batch_get_v1(op["keys"][:op["hit"]], op["slots"])
            self.inside += time.monotonic() - t0
            self.done.put(op)

    def stop(self):
        self.prefetch_q.put(None)
        self.io_q.put(None)


def one_hit(h: Hicache, keys, slots, spin: bool) -> float:
    """The scheduler thread's side of one hit: seconds from queueing it to seeing it loaded."""
    def next_of(q):
        if not spin:
            return q.get()
        while True:  # SGLang's loop: a pass of Python work, a look at the queue, again
            try:
                return q.get_nowait()
            except queue.Empty:
                sum(range(50))

    t0 = time.monotonic()
    h.prefetch_q.put({"keys": keys, "slots": slots})
    op = next_of(h.hits)
    h.io_q.put(op)
    op = next_of(h.done)
    if not all(op["got"]):
        raise SystemExit("a load missed: is the daemon's chunk the page size?")
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--switch-ms", default="1,0.2", help="switch intervals to try while spinning")
    args = ap.parse_args()
    backend, host = build(args)
    keys = [hashlib.sha256(f"wakeups-{i}".encode()).hexdigest() for i in range(args.pages)]
    slots = host.alloc(args.pages * args.page_size)
    if not all(backend.batch_set_v1(keys, slots)):
        raise SystemExit(f"storing the pages failed ({backend.kvd_stats()}): is the daemon running, "
                         "its chunk the page size?")
    default = sys.getswitchinterval()
    cases = [("blocking", False, default), ("spinning", True, default)]
    cases += [(f"spinning, switch {ms} ms", True, float(ms) / 1e3) for ms in args.switch_ms.split(",")]
    print(f"{'case':<28}{'hit p50':>10}{'hit p90':>10}{'ours p50':>10}   (ms; {args.pages} pages "
          f"of {args.page_size} tokens, {args.rounds} rounds)")
    for name, spin, interval in cases:
        sys.setswitchinterval(interval)
        h = Hicache(backend)
        total, ours = [], []
        for _ in range(args.rounds):
            h.inside = 0.0
            total.append(one_hit(h, keys, slots, spin))
            ours.append(h.inside)
        h.stop()
        total.sort()
        print(f"{name:<28}{statistics.median(total) * 1e3:>10.2f}"
              f"{total[int(len(total) * 0.9)] * 1e3:>10.2f}{statistics.median(ours) * 1e3:>10.2f}")
    sys.setswitchinterval(default)
    backend.close()


if __name__ == "__main__":
    main()
