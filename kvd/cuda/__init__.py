"""The CUDA copy backend: engine pools through CUDA IPC, SM kernels, staged DMA.

Owns the backend (``backend``: gather and scatter, over ``devices``: per-GPU
set-up, the pinned arena, opening and closing pools), the copy kernels' loader and launcher (``kernels``, over
kernels/kv_copy.cu), the copy-engine family (``dma/``: the staging ring,
copies by DMA alone), when a copy landed (``completion``), the GPU payload
digest (``digest``) and GPU Direct Storage loads (``gds``).

Imports: kvd.copy (the interface), kvd.tiers (gds reads chunk files),
kvd_protocol, and CuPy, which is imported lazily so that importing this
package never needs a GPU. Never imported by kvd.tiers or kvd.copy.
"""
