"""kvd: a standalone KV-cache daemon for LLM inference engines.

Layers, each importing only those below it (tests/test_architecture.py
checks this; docs/architecture.md draws it):

    kvd.cli            the ``kvd`` command (and ``kvd top``)
    kvd.bench          benchmarks (never imported by the daemon)
    kvd.server         event loop, sockets, sessions, service ops, control, stats
    kvd.cuda           CUDA backend: IPC pools, kernels, staging, GDS
    kvd.copy           copy-engine interface and the host backend
    kvd.tiers          host arena and index, disk tier, tiering policy
    kvd.config         the typed knob table
    kvd_protocol       wire format, keys, layouts, errors, runtime dir (shared with clients)
"""

__version__ = "0.1.0"
