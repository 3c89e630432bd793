"""The staging pool: SGLang pages on their way to and from kvd, in a file kvd can map.

SGLang's host pool has no path the daemon could open, so each page crosses one extra copy
through this pool: a ``shm_dir`` file (kvd_client.shm) registered like any
``SharedKVPool``, holding ``pages`` SGLang pages for loads and ``pages`` for stores (prefetch
and backup threads never share a slot). ``kvd_pages(slot)`` names a page's kvd pages;
``slot(i)`` is its ``[layers, planes, P, heads, dim]`` view, as ``HostPages`` gives.
"""

from __future__ import annotations

import atexit

import torch

from kvd_protocol.keys import DTYPE_SIZES
from kvd_protocol.layout import LayoutDescriptor

from .. import shm

ALIGN = 4096


class StagingPool:
    def __init__(self, pages, slots_per_direction: int, chunk_tokens: int, shm_dir: str = "/dev/shm",
                 group: int | None = None):
        """``pages``: a ``HostPages`` (geometry and dtype); ``chunk_tokens`` must divide its
        page size."""
        if pages.page_size % chunk_tokens:
            raise ValueError(f"kvd: the daemon's chunk_tokens ({chunk_tokens}) must divide "
                             f"SGLang's page size ({pages.page_size})")
        self.kv_dtype, self.attention = pages.kv_dtype, pages.attention
        self.num_layers, self.kv_heads, self.head_dim = pages.num_layers, pages.kv_heads, pages.head_dim
        self.page_size, self.chunk_tokens = pages.page_size, chunk_tokens
        self.slots = 2 * slots_per_direction
        self.chunks_per_page = pages.page_size // chunk_tokens
        planes, tokens = pages.planes, self.slots * pages.page_size
        row = self.kv_heads * self.head_dim * DTYPE_SIZES[self.kv_dtype]
        size = -(-pages.num_layers * planes * tokens * row // ALIGN) * ALIGN
        self._file = shm.ShmFile.create("kvd-sglang", size, shm_dir, group)
        atexit.register(self.close)
        self.path, self.size = self._file.path, size
        raw = torch.frombuffer(self._file.map, dtype=torch.uint8)
        self.tensor = raw[:pages.num_layers * planes * tokens * row].view(pages.dtype).view(
            pages.num_layers, planes, tokens, self.kv_heads, self.head_dim)
        plane_bytes = tokens * row
        bases = tuple((0, (layer * planes + p) * plane_bytes)
                      for layer in range(pages.num_layers) for p in range(planes))
        self.descriptor = LayoutDescriptor(pages.num_layers, planes, tokens // chunk_tokens,
                                           chunk_tokens, row, chunk_tokens * row, row, bases)
        self.buffers = [{"kind": "shm", "path": str(self.path), "size": size}]

    def slot(self, index: int) -> torch.Tensor:
        start = index * self.page_size
        return self.tensor[:, :, start:start + self.page_size]

    def kvd_pages(self, index: int) -> range:
        first = index * self.chunks_per_page
        return range(first, first + self.chunks_per_page)

    def close(self) -> None:
        if getattr(self, "_file", None) is None:
            return
        self.tensor = None
        self._file.close()
        self._file = None
