"""LMCache's multiprocess server for the fleet's ``lmcache`` arm: one per arm, shared by every server.

``lmcache_start`` starts ``lmcache server`` (LMCache's MP mode: one process owns an L1 host cache
of ``--host-gib``, the same bytes as kvd's tier; each vLLM server's ``LMCacheMPConnector`` talks to
it over ZeroMQ at ``--lmcache-port``, its HTTP API one port above) and waits for its health check.
``connector_config`` is the ``--kv-transfer-config`` that points a server at it; ``lmcache_status``
reads the server's own report for the arm's figures. LMCache must be importable by ``--python``
(tools/gpu/stage_lmcache.sh stages 0.5.3, the newest that loads on torch 2.11).
"""

from __future__ import annotations

import json
import subprocess

from .procs import Procs, get, wait_http

QUIET = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def http_url(args) -> str:
    return f"http://127.0.0.1:{args.lmcache_port + 1}"


def lmcache_start(args, procs: Procs, servers: int) -> subprocess.Popen:
    cmd = [args.python, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
           "--port", str(args.lmcache_port), "--http-host", "127.0.0.1",
           "--http-port", str(args.lmcache_port + 1), "--l1-size-gb", f"{args.host_gib:g}",
           "--eviction-policy", "LRU", "--max-workers", str(servers)]
    p = procs.start("lmcache", cmd, QUIET)
    wait_http(http_url(args) + "/healthcheck", p, procs, 180)
    return p


def connector_config(args) -> str:
    return json.dumps({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                     "lmcache.mp.port": args.lmcache_port}})


def lmcache_status(args) -> dict:
    try:
        return json.loads(get(http_url(args) + "/status", 10.0))
    except (OSError, ValueError) as exc:
        return {"error": str(exc)[-300:]}
