"""Knobs of the host tier beyond its size: quotas, where it lives, warm restarts, verification.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd import quota_rules
from kvd.knobs.knob import Knob

KNOBS = (
    Knob("quota", "quotas", (), "Caps and reservations per model and tenant, so one cannot evict "
         "everyone else's cache (docs/configure.md, Quotas): [[quota]] tables at the end of the "
         "file, in place of quota = [], of model (a registered model id), tenant (the label "
         "stores carry; empty: any), host_max, host_reserve, disk_max (sizes), users, groups (only "
         "they may use the label). Env and flags: TOML inline tables, " + quota_rules.EXAMPLE + "."),
    Knob("shm_dir", "str", "/dev/shm", "Where the host arena and client pools live (tmpfs)."),
    Knob("warm_restart", "bool", True, "Keep the host tier across daemon restarts: it stays in "
         "shm_dir when the daemon exits and the next daemon of this runtime dir adopts it "
         "(after a crash, verifying every chunk's checksum while it serves). false: the host "
         "tier is deleted at exit and made anew at start."),
    Knob("warm_record_delay_s", "float", 0.5, "With warm_restart: seconds a stored chunk waits "
         "before its record in the arena's index is written. A chunk evicted meanwhile costs no "
         "record at all, so a tier that turns over fast under a stream of stores costs the "
         "request loop nothing; a crash within this of a store loses that chunk for the next "
         "start (a miss, never wrong bytes). 0: record at every store.", minimum=0.0),
    Knob("cold_start", "bool", False, "Start with an empty host tier: delete the one a previous "
         "daemon left instead of adopting it (kvd serve --cold)."),
    Knob("verify_threads", "int", 2, "Threads computing the host tier's chunk checksums (for "
         "warm restarts) and verifying them after a crash or on load.", minimum=1),
    Knob("verify_loads", "str", "off", "on: check every host tier chunk a load reads against "
         "its warm_restart checksum first (off the loop; a mismatch is dropped and the load "
         "ends before it; docs/restart.md has the cost); off: trust the daemon's own memory.",
         choices=("off", "on")),
)
