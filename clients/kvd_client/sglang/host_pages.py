"""SGLang's host memory pool, seen one page at a time in one order.

``HostPages(pool)`` accepts ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost`` in
``layer_first``, ``page_first``, ``page_first_direct`` (and MHA ``page_head``) layouts and
gives every page as a strided view ``[layers, planes, page_size, heads, dim]`` of the pool's
own memory, addressed by the host slot of its first token; ``flat_view`` reads a flat page
of the generic interface. Anything else (``page_unified``, split K/V widths, decode context
parallelism) is a ``ValueError`` at start-up naming what is supported.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
          torch.int8: "int8", torch.uint8: "uint8"}

# page as get_data_page(i, flat=False) gives it -> [layers, planes, page, heads, dim]
TO_CANONICAL = {
    ("mha", "layer_first"): lambda t: t.permute(1, 0, 2, 3, 4),
    ("mha", "page_first"): lambda t: t.permute(2, 0, 1, 3, 4),
    ("mha", "page_first_direct"): lambda t: t[:, 0].permute(1, 0, 2, 3, 4),
    ("mha", "page_head"): lambda t: t[:, 0].permute(3, 0, 2, 1, 4),
    ("mla", "layer_first"): lambda t: t.unsqueeze(1),
    ("mla", "page_first"): lambda t: t.permute(1, 0, 2, 3).unsqueeze(1),
    ("mla", "page_first_direct"): lambda t: t[0].unsqueeze(1),
}
SUPPORTED = ", ".join(f"{kind.upper()} {layout}" for kind, layout in TO_CANONICAL)


class HostPages:
    def __init__(self, pool, kv_dtype: str = ""):
        self.pool = pool
        if isinstance(pool, MLATokenToKVPoolHost):
            self.attention, self.kv_heads, self.head_dim = "mla", 1, pool.kv_cache_dim
        elif isinstance(pool, MHATokenToKVPoolHost):
            v_dim = getattr(pool, "v_head_dim", pool.head_dim)  # 0.5.16: only on split pools
            if pool.head_dim != v_dim:
                raise ValueError(f"kvd: K and V of different widths ({pool.head_dim}, "
                                 f"{v_dim}) are not supported")
            self.attention, self.kv_heads, self.head_dim = "mha", pool.head_num, pool.head_dim
        else:
            raise ValueError(f"kvd: host pool {type(pool).__name__} is not supported; "
                             f"supported: {SUPPORTED}")
        self.layout = pool.layout
        if (self.attention, self.layout) not in TO_CANONICAL:
            raise ValueError(f"kvd: the {self.attention.upper()} host layout {self.layout!r} is "
                             f"not supported; supported: {SUPPORTED}")
        if getattr(pool, "dcp_size", 1) != 1:
            raise ValueError("kvd: decode context parallelism (dcp_size > 1) is not supported")
        if pool.dtype not in DTYPES:
            raise ValueError(f"kvd: host pool dtype {pool.dtype} is not supported")
        self.dtype = pool.dtype
        self.kv_dtype = kv_dtype or DTYPES[pool.dtype]
        if kv_dtype and pool.dtype.itemsize != 1:
            raise ValueError("kvd_kv_dtype names fp8 caches stored as uint8; this pool is "
                             f"{pool.dtype}")
        self.num_layers = pool.layer_num
        self.first_layer = pool.start_layer
        self.page_size = pool.page_size
        self.planes = 1 if self.attention == "mla" else 2
        self._convert = TO_CANONICAL[(self.attention, self.layout)]
        self._flat_shape = tuple(pool.get_data_page(0, flat=False).shape)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.planes, self.page_size, self.kv_heads, self.head_dim)

    def page(self, slot: int) -> torch.Tensor:
        """The page whose first token is host slot ``slot``, as a view of the pool."""
        return self._convert(self.pool.get_data_page(slot, flat=False))

    def flat_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page (``get_data_page(i, flat=True)`` order) as a view in page order."""
        return self._convert(flat.view(self._flat_shape))

    def page_slots(self, host_indices, pages: int) -> list[int]:
        """The first host slot of each of ``pages`` pages in ``host_indices`` (token slots)."""
        if host_indices is None or host_indices.numel() < pages * self.page_size:
            raise ValueError(f"{pages} pages need {pages * self.page_size} host indices")
        return host_indices[0:pages * self.page_size:self.page_size].tolist()
