"""Knobs of the disk tier: where it lives, its size and IO, what is demoted, GPU Direct Storage.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd.knobs.knob import Knob

KNOBS = (
    Knob("disk_dir", "str", "", "Directory of the disk tier (one file per chunk); created if "
         "missing, but not its parent. Empty: no disk tier."),
    Knob("disk_capacity", "size", 64 * 2**30, "Bytes the disk tier may use (headers included); "
         "at most the free space there plus kvd's chunk files.", minimum=8192),
    Knob("disk_io_threads", "int", 4, "Threads doing disk tier IO (reads and writes in flight).",
         minimum=1),
    Knob("disk_queue_chunks", "int", 256, "Demotions queued or in flight at most; more are "
         "dropped and counted, never waited for.", minimum=1),
    Knob("disk_high_watermark", "float", 0.9, "Host tier fill (fraction of host_capacity) above "
         "which the coldest chunks are copied to disk.", minimum=0.1),
    Knob("disk_min_hits", "int", 0, "Demote only chunks looked up at least this often (0: all); "
         "kvd ctl flush-disk writes every chunk whatever this says.", minimum=0),
    Knob("disk_gds", "bool", False, "Load disk-only chunks straight into GPU pages with GPU "
         "Direct Storage (KvikIO; its compatibility mode where the machine lacks GDS), verified on "
         "the GPU. Without KvikIO, a GPU or a disk tier: a log line, and the host tier path."),
    Knob("disk_gds_slot_bytes", "size", 128 * 2**20, "Bytes of each of the 2 GPU Direct Storage "
         "buffers per GPU (a load reads as many chunks as fit, then the next batch).",
         minimum=2**20),
)
