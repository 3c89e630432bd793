"""Knobs of the remote tier: the store (Valkey/Redis or Mooncake), its calls, breaker and checksums.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd.knobs.knob import Knob

KNOBS = (
    Knob("remote_backend", "str", "off", "Remote tier on an existing distributed store the "
         "cluster's nodes share (docs/cluster.md): off, redis (Valkey or Redis; needs kvd-cache[redis]) "
         "or mooncake (Mooncake Store over TCP; needs kvd-cache[mooncake]).",
         choices=("off", "redis", "mooncake")),
    Knob("remote_address", "str", "", "Where the store is: for redis a URL (redis://host:6379/0, "
         "rediss://..., unix:///path), for mooncake the master's RPC host:port."),
    Knob("remote_prefix", "str", "kvd", "Name of this cluster or tenant in the store: every key "
         "starts with it, so clusters sharing one store never read each other's chunks."),
    Knob("remote_timeout_s", "float", 0.1, "Longest wait for one store call (a value's transfer "
         "adds its size at 1 GB/s); past it the call counts as failed and the request goes on "
         "without it.", minimum=0.001),
    Knob("remote_threads", "int", 8, "Threads calling the store: at most half fetch chunks, a "
         "quarter put them, the rest answer lookups.", minimum=2),
    Knob("remote_queue_chunks", "int", 256, "Chunks queued for the store or being put at most; "
         "more are dropped and counted, never waited for.", minimum=1),
    Knob("remote_publish", "str", "store", "When a chunk goes to the store: store (once a store "
         "committed it, so other nodes hit it at once) or demote (when the disk tier's demoter "
         "takes it: cold chunks only; needs disk_dir).", choices=("store", "demote")),
    Knob("remote_secret", "str", "", "Cluster secret for the remote store's values (any string; "
         "a long random one): each value then carries a BLAKE2b tag keyed with it over header "
         "and payload, and a value without a valid tag (forged or altered by anyone who can write "
         "to the store) is refused and deleted. Nodes sharing chunks need the same secret; a "
         "node with another one (or none) uses other names and shares nothing with them. Empty: "
         "the store and everyone who can write to it are trusted (docs/cluster.md). Set it in "
         "the config file (mode 0600) or KVD_REMOTE_SECRET, not as a flag (ps shows those); "
         "kvd config and the log show it as <hidden>.", secret=True),
    Knob("remote_breaker_failures", "int", 3, "Consecutive failed or timed-out store calls that "
         "open the circuit breaker: kvd serves from its local tiers only.", minimum=1),
    Knob("remote_breaker_retry_s", "float", 2.0, "While the breaker is open, how often one probe "
         "checks whether the store is back.", minimum=0.05),
    Knob("remote_ttl_s", "int", 0, "Expiry of each value put in Valkey/Redis, in seconds (0: none; "
         "the server's maxmemory policy evicts).", minimum=0),
    Knob("remote_redis_zero_copy", "bool", True, "Send chunks to Valkey/Redis from the host arena "
         "and read GET replies straight into it (docs/cluster.md); false: through Python bytes."),
    Knob("remote_mooncake_metadata", "str", "", "Mooncake's transfer metadata service: a URL, "
         "P2PHANDSHAKE or an etcd address. Empty: http://<master host>:8080/metadata (the "
         "master's own, --enable_http_metadata_server)."),
    Knob("remote_mooncake_local_host", "str", "", "Address other nodes reach this one on for "
         "Mooncake transfers. Empty: the address this host uses to reach the master."),
    Knob("remote_mooncake_segment_bytes", "size", 2**30, "Memory this daemon lends to the Mooncake "
         "cluster's pool (0: none; values then live in other clients' segments).", minimum=0),
    Knob("remote_mooncake_buffer_bytes", "size", 256 * 2**20, "Mooncake client's transfer "
         "buffer: it must hold the chunks of remote_threads calls at once.", minimum=2**20),
    Knob("remote_mooncake_zero_copy", "bool", True, "Register the host arena with Mooncake, move "
         "chunks without a copy (docs/cluster.md); false or refused (logged): Python bytes."),
    Knob("remote_digest_processes", "int", -1, "Processes checking the zero-copy path's "
         "chunks outside the GIL (docs/cluster.md): -1 one per 4 cores, at most 8; 0 none.", minimum=-1),
)
