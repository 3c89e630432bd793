"""kvd: a standalone KV-cache daemon for LLM inference engines.

Layers, each importing only those below it (tests/test_architecture.py checks;
docs/architecture.md draws the request flow through them):
``kvd.cli`` (the command) > ``kvd.bench`` (benchmarks, never imported by the daemon) >
``kvd.server`` (event loop, sockets, sessions, service ops) > ``kvd.cuda`` (CUDA backend) >
``kvd.copy`` (copy-engine interface, host backend) > ``kvd.tiers`` (host, disk, remote tiers) >
``kvd.config`` (typed knobs) > ``kvd_protocol`` (wire format, keys, layouts; shared with clients).
"""

__version__ = "0.1.0"
