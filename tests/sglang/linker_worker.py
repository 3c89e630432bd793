"""An SGLang-side process for the linker tests (SGLang ≥ 0.5.23, its venv; no GPU).

Reads one JSON command per line on stdin, answers one JSON line
(``{"ok": result}`` or ``{"error": "Type: message"}``), as sglang_worker.py.
SGLang's parts are real: its device pool (``MHATokenToKVPool`` /
``MLATokenToKVPool`` on ``device="cpu"``), its paged allocator (the slots a
load or offload gets), ``CacheInitParams``, ``PoolTransfer``, page hashes
from ``get_storage_hash_str``, and the linker is made by SGLang's own
``create_unified_cache_linker`` the ``dynamic`` way. A load is driven as
SGLang's ``UnifiedCacheLinkerWrapper`` drives it (lookup, load,
``start_layer_wise_loading``, the pool's ``register_layer_transfer_counter``,
``set_consumer``, every layer read through the pool's ``get_key_buffer``
(which calls the counter's ``wait_until``), ``finish_layer_wise_loading``).

The one part that differs from a GPU: the daemon cannot map CPU tensors
SGLang allocated, so ``ShmLinker`` (KvdLinker with another ``pool_factory``)
moves the device pool's per-layer tensors into a kvd ``SharedKVPool`` of
the same layout (``sglang_mha`` / ``sglang_mla``) and registers that; on a
GPU ``KvdLinker`` registers the same tensors by CUDA IPC
(tests/sglang/test_gpu_linker.py: ``device: "cuda"``, ``kvd_linker: true``).
``kvd_linker: true`` makes the plain ``KvdLinker`` (on the CPU: refused, with
the reason in its stats).
Pages travel as base64 of their bytes in page order ``[layers, planes,
page_size, heads, dim]`` (the HiCache backend's host page order).
"""

from __future__ import annotations

import base64
import time
import types
import warnings

warnings.filterwarnings("ignore")

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvd_client.sglang.linker import KvdLinker
from sglang_worker import serve  # this directory: the command loop the workers share
from shm_pool import shm_device_pool

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class ShmLinker(KvdLinker):
    pool_factory = staticmethod(shm_device_pool)

    def close(self) -> None:
        super().close()
        if self.reg is not None:
            self.reg.pool.close()  # its /dev/shm file goes


class Engine:
    """One SGLang rank's device pool, allocator and kvd linker."""

    def __init__(self, extra, mla=False, page_size=16, layers=3, heads=2, dim=8, pages=64,
                 dtype="bfloat16", model="tiny", kvd_linker=False, components=("FULL",),
                 device="cpu"):
        dt, size = DTYPES[dtype], pages * page_size
        common = dict(size=size, page_size=page_size, dtype=dt, layer_num=layers, device=device,
                      enable_memory_saver=False, start_layer=0, end_layer=layers)
        self.dev = MLATokenToKVPool(kv_lora_rank=dim - 4, qk_rope_head_dim=4, **common) if mla \
            else MHATokenToKVPool(head_num=heads, head_dim=dim, **common)
        self.alloc = PagedTokenToKVPoolAllocator(size, page_size, dt, device, self.dev, False)
        params = CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=self.alloc, page_size=page_size)
        server_args = types.SimpleNamespace(model_path=model, served_model_name=model, tp_size=1)
        cls = "KvdLinker" if kvd_linker else "ShmLinker"
        module = "kvd_client.sglang.linker" if kvd_linker else "linker_worker"
        self.linker = create_unified_cache_linker(
            server_args, params, backend="dynamic",
            config={"linker": cls, "linker_module_path": module, "linker_extra_config": extra},
            components={ComponentType[c] for c in components})
        self.dev.register_layer_transfer_counter(self.linker.layer_done_counter)
        self.page_size, self.mla = page_size, mla

    def slots(self, pages: int) -> torch.Tensor:
        idx = self.alloc.alloc(pages * self.page_size)
        if idx is None:
            raise MemoryError("device pool full")
        return idx

    def layers(self, layer: int) -> list[torch.Tensor]:
        if self.mla:
            return [self.dev.kv_buffer[layer]]
        return [self.dev.k_buffer[layer], self.dev.v_buffer[layer]]

    def page_bytes(self, slots: torch.Tensor, pages: int) -> list[str]:
        """Each page's bytes in page order [layers, planes, page_size, heads, dim]."""
        out = []
        for p in range(pages):
            s = slots[p * self.page_size:(p + 1) * self.page_size]
            parts = [t[s].cpu().contiguous().view(torch.uint8).reshape(-1)
                     for layer in range(self.dev.layer_num) for t in self.layers(layer)]
            out.append(base64.b64encode(torch.cat(parts).numpy().tobytes()).decode())
        return out

    def fill(self, slots: torch.Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(self.dev.layer_num):
            for t in self.layers(layer):
                rows = t[slots].view(torch.uint8)
                t[slots] = torch.randint(0, 256, rows.shape, dtype=torch.uint8,
                                         generator=gen).view(t.dtype).to(t.device)

    def offload(self, keys, seed: int, timeout: float = 10.0) -> dict:
        slots = self.slots(len(keys))
        self.fill(slots, seed)
        queued = self.linker.offload([PoolTransfer(name=PoolName.KV, device_indices=slots,
                                                   keys=list(keys))])
        ok = None
        if queued:
            end = time.monotonic() + timeout
            while self.linker.num_completed_offloads() < 1 and time.monotonic() < end:
                time.sleep(0.005)
            ok = self.linker.pop_completed_offload() if self.linker.num_completed_offloads() else None
        return {"queued": queued, "ok": ok, "pages": self.page_bytes(slots, len(keys))}

    def load(self, keys, rid: str, shift_slots: int = 0, poison: bool = True) -> dict:
        if shift_slots:  # slots that do not start a page: the linker refuses them
            slots = self.slots(len(keys) + 1)[shift_slots:shift_slots + len(keys) * self.page_size]
        else:
            slots = self.slots(len(keys))
        if poison:
            self.fill(slots, 12345)
        queued = self.linker.load(rid, [PoolTransfer(name=PoolName.KV, device_indices=slots,
                                                     keys=list(keys))])
        if not queued:
            return {"queued": False}
        index = self.linker.start_layer_wise_loading()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.dev.layer_num):  # what attention does, layer by layer
            self.dev.get_key_buffer(layer)
        landed = self.linker.finish_layer_wise_loading(index)
        counter.set_consumer(-1)
        return {"queued": True, "index": index, "landed": landed,
                "pages": self.page_bytes(slots, len(keys))}


def run(engines, cmd):
    op = cmd.pop("op")
    if op == "engine":
        name = cmd.pop("name")
        engines[name] = Engine(**cmd)
        return True
    e = engines[cmd["name"]]
    if op == "hash":
        return get_storage_hash_str(RadixKey(cmd["tokens"]), None, page_size=e.page_size)
    if op == "lookup":
        return e.linker.lookup(cmd.get("rid", "r"), [PoolTransfer(name=PoolName.KV,
                                                                 keys=cmd["keys"])])
    if op == "offload":
        return e.offload(cmd["keys"], cmd.get("seed", 0))
    if op == "load":
        return e.load(cmd["keys"], cmd.get("rid", "r"), cmd.get("shift_slots", 0))
    if op == "queue_and_cancel":
        slots = e.slots(len(cmd["keys"]))
        queued = e.linker.load("c", [PoolTransfer(name=PoolName.KV, device_indices=slots,
                                                  keys=cmd["keys"])])
        return {"queued": queued, "cancelled": e.linker.cancel_queued_load("c"),
                "start": e.linker.start_layer_wise_loading()}
    if op == "stats":
        return e.linker.kvd_stats()
    if op == "close":
        e.linker.close()
        del engines[cmd["name"]]
        return True
    raise ValueError(f"unknown op {op!r}")


def main():
    serve(run, lambda e: e.linker.close())


if __name__ == "__main__":
    main()
