"""An SGLang-side process for the HiCache backend tests: runs in the SGLang venv.

Reads one JSON command per line on stdin, answers one JSON line on stdout
(``{"ok": result}`` or ``{"error": "Type: message"}``). Everything SGLang is
real: the device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on
``device="cpu"``), the host pool (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``, unpinned: no GPU), ``StorageBackendFactory``
creating the backend the ``dynamic`` way from the extra config, and page
hashes from ``get_storage_hash_str`` (which the backend listens to in key
mode 'tokens'; ``hash_early``: through a reference to ``get_hash_str`` taken
before any backend existed, as SGLang 0.5.16's cache controller keeps one).
Runs on SGLang 0.5.23 and 0.5.16 (whose host pools are built from the device
pool, and whose page hashes have no namespace seed). Pages travel as base64 of their bytes in page order
``[layers, planes, page_size, heads, dim]`` (kvd_client.sglang.host_pages).
"""

from __future__ import annotations

import base64
import inspect
import json
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str as EARLY_HASH  # before any backend listens

try:
    from sglang.srt.mem_cache.utils import get_storage_hash_str
except ImportError:  # SGLang 0.5.16: storage chains start at no seed
    from sglang.srt.mem_cache.utils import get_hash_str as get_storage_hash_str

from kvd_client.sglang.host_pages import HostPages

# SGLang 0.5.16's host pools take the device pool itself, 0.5.23's its buffer info
POOLS_FROM_DEVICE = "device_pool" in inspect.signature(MHATokenToKVPoolHost.__init__).parameters
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BACKEND = {"backend_name": "kvd", "module_path": "kvd_client.sglang.backend",
           "class_name": "KvdHiCacheStorage", "interface_v1": 1}


class Engine:
    """One SGLang rank's host pool and its storage backend."""

    def __init__(self, layout="layer_first", mla=False, page_size=16, layers=3, heads=2, dim=8,
                 dtype="bfloat16", model="tiny", tp_size=1, tp_rank=0, extra=None, pages=64):
        dt, tokens = DTYPES[dtype], pages * page_size
        if mla:
            dev = MLATokenToKVPool(size=tokens, page_size=page_size, dtype=dt, kv_lora_rank=dim - 4,
                                   qk_rope_head_dim=4, layer_num=layers, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=layers)
            self.host = host_pool(MLATokenToKVPoolHost, dev, page_size, layout, layers,
                                  override_kv_cache_dim=dev.kv_cache_dim)
        else:
            dev = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dt, head_num=heads,
                                   head_dim=dim, layer_num=layers, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=layers)
            self.host = host_pool(MHATokenToKVPoolHost, dev, page_size, layout, layers)
        config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=mla, enable_storage_metrics=False,
            is_page_first_layout=layout == "page_first", model_name=model,
            extra_config={**BACKEND, **(extra or {})})
        self.backend = StorageBackendFactory.create_backend("dynamic", config, self.host)
        self.backend.register_mem_pool_host(self.host)
        self.view = HostPages(self.host)
        self.page_size = page_size

    def alloc(self, pages):
        idx = self.host.alloc(pages * self.page_size)
        if idx is None:
            raise MemoryError("host pool full")
        return idx

    def fill(self, pages, seed):
        """Fill ``pages`` fresh host pages with seeded random bytes: (indices, page bytes)."""
        idx = self.alloc(pages)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for slot in self.view.page_slots(idx, pages):
            page = self.view.page(slot)
            page.view(torch.uint8).copy_(torch.randint(0, 256, page.view(torch.uint8).shape,
                                                       dtype=torch.uint8, generator=gen))
            out.append(encode(page))
        return idx, out

    def read(self, idx, pages):
        return [encode(self.view.page(s)) for s in self.view.page_slots(idx, pages)]


def host_pool(cls, dev, page_size, layout, layers, **mla):
    """SGLang's host pool of ``cls`` for the device pool ``dev``, unpinned, on the CPU."""
    if POOLS_FROM_DEVICE:
        return cls(dev, 2.0, 0, page_size, layout, pin_memory=False, device="cpu", **mla)
    if mla:
        mla["target_layer_num"] = layers
    return cls(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
               pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
               end_layer=layers, **mla)


def radix_key(cmd):
    salts = {k: cmd[k] for k in ("extra_key", "cache_salt") if cmd.get(k) is not None}
    return RadixKey(cmd["tokens"], **salts)


def encode(page):
    return base64.b64encode(page.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def run(engines, cmd):
    op = cmd.pop("op")
    if op == "info":  # which SGLang, and whether its storage hashes carry request namespaces
        import sglang
        from sglang.srt.mem_cache import utils
        return {"version": sglang.__version__, "namespaced": hasattr(utils, "storage_namespace_seed")}
    if op == "engine":
        name = cmd.pop("name")
        engines[name] = Engine(**cmd)
        return True
    if op == "hash":  # how SGLang hashes a prefetch query (and Python radix-tree nodes)
        e = engines[cmd["name"]]
        return get_storage_hash_str(radix_key(cmd), cmd.get("prior"), page_size=e.page_size)
    if op == "hash_early":  # how SGLang 0.5.16's cache controller hashes a prefetch query
        e = engines[cmd["name"]]
        return EARLY_HASH(radix_key(cmd), cmd.get("prior"), page_size=e.page_size)
    e = engines[cmd["name"]]
    keys = cmd.get("keys", [])
    if op == "fill_set":  # fill pages, store them: (results, page bytes)
        idx, data = e.fill(len(keys), cmd.get("seed", 0))
        return {"results": e.backend.batch_set_v1(keys, idx), "pages": data}
    if op == "exists":
        return e.backend.batch_exists(keys)
    if op == "get":
        idx = e.alloc(len(keys))
        results = e.backend.batch_get_v1(keys, idx)
        return {"results": results, "pages": e.read(idx, sum(results))}
    if op == "fill_set_flat":  # the generic interface: SGLang's flat pages
        idx, data = e.fill(len(keys), cmd.get("seed", 0))
        flats = [e.host.get_data_page(s) for s in e.view.page_slots(idx, len(keys))]
        return {"ok": e.backend.batch_set(keys, flats), "pages": data}
    if op == "get_flat":
        targets = [e.host.get_dummy_flat_data_page() for _ in keys]
        got = e.backend.batch_get(keys, targets)
        return {"results": [g is not None for g in got],
                "pages": [encode(e.view.flat_view(g)) for g in got if g is not None]}
    if op == "stats":
        return e.backend.kvd_stats()
    if op == "close":
        e.backend.close()
        del engines[cmd["name"]]
        return True
    raise ValueError(f"unknown op {op!r}")


def serve(run, close) -> None:
    """Answer JSON commands on stdin with ``run(engines, cmd)`` until EOF, then ``close`` each
    engine left (also the linker worker's loop)."""
    engines = {}
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in sys.stdin:
        try:
            reply = {"ok": run(engines, json.loads(line))}
        except Exception as exc:  # the test asserts on it
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    for e in engines.values():
        close(e)


def main():
    serve(run, lambda e: e.backend.close())


if __name__ == "__main__":
    main()
