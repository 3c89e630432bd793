"""The copy engine: moving chunk bytes between engines' KV pools and the host arena.

Owns the interface every backend implements (``plan``: ``CopyPlan`` and
the ``CopyEngine`` protocol: open/close a pool, gather, scatter) and the
host backend (``host``: pools in shared-memory files, copies in numpy on a
thread pool; ``host_ops``: the pure gather/scatter functions, also the
reference the GPU kernels are tested against). The CUDA backend
(kvd.cuda) implements the same interface.

Imports: kvd_protocol only.
"""
