"""Knobs of the daemon's sockets, sessions and request limits, and its host copy threads.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd.knobs.knob import Knob

KNOBS = (
    Knob("runtime_dir", "str", "", "Directory for sockets and the lock (mode 0700). Empty: "
         "$KVD_RUNTIME_DIR, $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/kvd, /run/kvd (root), /tmp/kvd-<uid>."),
    Knob("access_group", "str", "", "Group (name or gid) whose members may connect: runtime dir 0750 "
         "and sockets 0660 of that group; each connection's kernel credentials are checked. Empty: "
         "the daemon's user (and root) only."),
    Knob("host_capacity", "size", 2**30, "Bytes of the shared-memory host tier.", minimum=4096),
    Knob("chunk_tokens", "int", 256, "Tokens per cached chunk (at most 8192); engines' page "
         "sizes must divide it.", minimum=1),
    Knob("max_message_bytes", "size", 64 * 2**20, "Largest request a client may send; larger "
         "messages drop that peer.", minimum=2**16),
    Knob("max_keys_per_request", "int", 2048, "Most chunk keys in one lookup, store or load "
         "(their per-key work holds the event loop: docs/performance.md).", minimum=1),
    Knob("heartbeat_interval_s", "float", 5.0, "How often clients send a heartbeat.", minimum=0.05),
    Knob("client_timeout_s", "float", 30.0, "A client silent for this long is reaped.", minimum=0.2),
    Knob("lease_max_ms", "int", 60000, "Longest lease a lookup may take on its hits.", minimum=1),
    Knob("max_clients", "int", 1024, "Most sessions at once.", minimum=1),
    Knob("max_registrations", "int", 64, "Most KV pools one client may register.", minimum=1),
    Knob("max_inflight", "int", 64, "Most lookup/store/load requests one client may have in flight; "
         "one more gets a busy reply and does nothing.", minimum=1),
    Knob("max_queued_copies", "int", 1, "Most copies of one client queued in a backend at "
         "once; its other requests wait their turn in the daemon, so a client with many requests "
         "in flight cannot delay another client's copy by more than this many of its own.",
         minimum=1),
    Knob("max_queued_copies_alone", "int", 2, "Most copies of one client queued in one GPU "
         "direction (a GPU's stores, or its loads) while no other client has a copy queued or "
         "waiting there: its next copy is queued while one runs, so the copy engines do not idle "
         "while the daemon queues it. Host-backend copies keep max_queued_copies; below "
         "max_queued_copies it is max_queued_copies.", minimum=1),
    Knob("max_queued_bytes_alone", "size", 0, "While alone in a GPU direction, a client may also "
         "queue more than max_queued_copies_alone copies as long as its copies queued there, the "
         "next one included, total at most this many bytes (for small copies, e.g. 144 MB for 128 "
         "chunks of DeepSeek-MLA, whose next copy the daemon may queue too late behind two). A "
         "client arriving later then waits behind at most max_queued_copies_alone copies of any "
         "size, or this many bytes. 0 (default): by count only; 512MiB kept loads queued but did "
         "not raise throughput.", minimum=0),
    Knob("shutdown_grace_s", "float", 8.0, "On SIGTERM/SIGINT, how long requests in flight may take "
         "to finish (copies, disk writes) before the daemon exits anyway.", minimum=0.1),
    Knob("copy_threads", "int", 0, "Host copy threads (a large copy is split across them, at "
         "least 8 MiB a thread). 0 (default): one per CPU the daemon may run on, at most 16.",
         minimum=0),
)
