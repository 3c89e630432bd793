"""CPU engines: vLLM's KV cache allocated in a /dev/shm file that kvd maps.

``ShmKVAllocation`` is the context ``get_mem_pool_context()`` returns: a ``TorchFunctionMode``
answering exactly vLLM's one ``torch.zeros(size, int8)`` KV allocation with
``torch.from_file(..., shared=True)`` over a new kvd_client.shm file; every other call passes
through. ``close()`` unlinks the file (the mapping lives until vLLM drops the tensor).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from kvd_client import shm

PREFIX = "kvd-pool"  # kvd_client's pool files: same clean-up of dead processes' leftovers


class ShmKVAllocation(TorchFunctionMode):
    def __init__(self, size: int, shm_dir: str, group: int | None = None):
        super().__init__()
        self.size, self.shm_dir, self.group = size, shm_dir, group
        self.path: Path | None = None
        self.file: shm.ShmFile | None = None
        self.tensor = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tensor is None and func is torch.zeros and self._is_the_kv_cache(args, kwargs):
            self.file = shm.ShmFile.create(PREFIX, self.size, self.shm_dir, self.group)
            self.path = self.file.path  # flocked while we live: no cleaner takes it
            self.tensor = torch.from_file(str(self.path), shared=True, size=self.size,
                                          dtype=torch.int8)
            return self.tensor
        return func(*args, **kwargs)

    def _is_the_kv_cache(self, args, kwargs) -> bool:
        if kwargs.get("dtype") is not torch.int8 or torch.device(kwargs.get("device", "cpu")).type != "cpu":
            return False
        shape = args[0] if len(args) == 1 else args
        numel = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else shape
        return int(numel) == self.size

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()  # unlinks, then drops the lock
            self.file = self.path = None
