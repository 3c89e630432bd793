"""The daemon's one typed configuration object.

Owns ``KNOBS``: every knob a ``Knob`` with a type, default and help text. ``load_config``
merges, lowest precedence first, defaults, a TOML file, ``KVD_<KEY>`` variables and
``--<key>`` flags into a frozen ``Config`` that records each value's source.
Promises: a bad key or value raises ``ConfigError`` naming the key; TOML values must have
the knob's type; sizes take KiB.. or KB.. units, never a bare K/M/G/T (kvd/sizes.py).
``defaults_toml``/``resolved_toml`` render ``kvd config``; configs/kvd.toml and
docs/config.md list the same knobs (a test checks).
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, make_dataclass
from types import MappingProxyType

from kvd import config_checks, quota_rules
from kvd.sizes import parse_size, size_text
from kvd_protocol.errors import ConfigError
from kvd_protocol.limits import MAX_TENANT_CHARS

SOURCES = ("default", "file", "env", "flag")


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "size", "int", "float", "str", "bool", "quotas" (kvd/quota_rules.py)
    default: object
    help: str
    minimum: float | None = None
    choices: tuple = ()
    secret: bool = False  # never printed or logged (kvd config, start-up log): "<hidden>"


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
    Knob("copy_threads", "int", 4, "Host copy threads (a large copy is split across them).", minimum=1),
    Knob("gpu", "str", "auto", "CUDA backend: auto (on when cupy and a GPU are present), on "
         "(fail start-up without them), off.", choices=("auto", "on", "off")),
    Knob("gpu_max_blocks", "int", 32, "Cap on thread blocks of one copy kernel, so copies leave "
         "the engines their SMs.", minimum=1),
    Knob("gpu_stage_slots", "int", 2, "Staging buffers per GPU and direction (copies go pool -> "
         "GPU buffer by kernel, buffer -> host tier by DMA); 0 copies straight to host memory.",
         minimum=0),
    Knob("gpu_stage_slot_bytes", "size", 64 * 2**20, "Bytes of one staging buffer; each GPU that "
         "registers a pool holds 2 x slots x this (256 MiB by default). Staged DMA moves whole "
         "chunks per slot: slots of several chunks cost less host time per byte (DeepSeek-MLA "
         "chunks of 18 MB, one way: 0.72-0.87 of a memcpy with 32 MiB slots, 0.92-0.95 with "
         "64 MiB).", minimum=2**20),
    Knob("gpu_copy_path", "str", "auto", "How GPU copies move pages: dma (the copy engines only, no "
         "kernel of the daemon's; where each page of a layer is one byte range), kernels (SM "
         "copy kernels; fastest on an idle GPU, but without CUDA MPS every kernel of the daemon's "
         "costs the engines their GPU time slices), auto (dma where one copy moves at least "
         "gpu_dma_min_piece bytes, kernels below).", choices=("auto", "dma", "kernels")),
    Knob("gpu_dma_streams", "int", 8, "Streams (and so copy engines) one DMA copy of small "
         "pieces (see gpu_dma_spread_below) is spread over, per GPU and direction.", minimum=1),
    Knob("gpu_dma_spread_below", "size", 64 * 2**10, "DMA copies whose pieces (a page's byte "
         "range, or a pitched op of a page's planes) average under this many bytes are spread "
         "over gpu_dma_streams streams (32 KiB pieces: 0.67-0.75 of a memcpy on 8 streams, "
         "0.38-0.44 on one); larger ones go on one stream, which keeps up with PCIe alone and "
         "costs the event loop one driver call: DeepSeek-MLA pages of 1.1 MB moved at 0.94 / "
         "0.99 / 0.79 of a memcpy (offload / load / both, H100 medians) instead of 0.81 / 0.92 "
         "/ 0.66 spread, and per-layer pages of 72 KiB loaded at 0.92-0.94 instead of 0.86-0.89. "
         "0 = never spread.", minimum=0),
    Knob("gpu_dma_store_thread", "bool", True, "DMA stores are queued with the driver by a "
         "thread of each GPU, not the event loop: per-layer pools (SGLang's) cost ~2,000 rows a "
         "request, 1-2 ms of the loop (MLA pages of 64 stored at 0.95 of a memcpy, not 0.88). Sets "
         "the switch interval to 0.2 ms while it runs. Ignored when gpu_dma_stage_below > 0."),
    Knob("gpu_dma_load_thread", "bool", True, "DMA loads are queued by a thread of each GPU "
         "(beside the stores'), which checks each step's cancel word and the load window and "
         "writes the layer and done words; the loop only plans them (per-layer MLA pages of 64 "
         "at scattered ids: loads 0.97 of a memcpy instead of 0.91, both ways 0.72 instead of "
         "0.61; other pools unchanged). Ignored when gpu_dma_stage_below > 0."),
    Knob("gpu_dma_min_piece", "size", 64 * 2**10, "With gpu_copy_path = auto: the fewest bytes "
         "one DMA copy must move for a pool to go by DMA: a page (one layer and K or V), or, "
         "when a pool's layers share one allocation, a page's rows of all its planes in one "
         "pitched copy (pages of 16 KiB or more, 16 planes or more). Smaller copies are slow "
         "on the copy engines and go through kernels.", minimum=1),
    Knob("gpu_dma_load_window", "size", 256 * 2**20, "Bytes of one GPU's loads queued on its copy "
         "engines at most: a load is queued in steps (a staging slot's chunks; else runs of "
         "pages over all layers, about a quarter of this each; a layer-wise load layer by "
         "layer), each after a check of its cancel word, so after a cancel at most this much "
         "more lands (always before the done word; 256 MiB is about 5 ms of PCIe). Smaller "
         "windows let the copy engines run dry between steps (64 MiB: loads 0.86 of a memcpy "
         "instead of 0.91).", minimum=1),
    Knob("gpu_dma_stage_below", "size", 0, "DMA copies of pages under this many bytes (in "
         "pitched ops of all layers) go through the staging slots: gathered into a slot inside "
         "the GPU, then one DMA moves whole chunks across PCIe (one way 0.97-0.99 of a memcpy "
         "instead of 0.92 at Llama pages of 16). Costly for the engines: the driver runs the "
         "fills inside the GPU like kernels of the daemon's, so without CUDA MPS the engines "
         "lose about a fifth of their GPU time while such copies run (+19-23% per step, +4-10% "
         "under MPS; straight pitched DMA +1-4%). Only once the other direction has been idle "
         "for 50 ms. Needs gpu_stage_slots > 0 and a chunk that fits gpu_stage_slot_bytes; "
         "0 = never (the default).", minimum=0),
    Knob("gpu_poll_interval_us", "float", 0.0, "How the daemon notices copies that landed: 0 "
         "re-checks every event-loop pass (lowest latency, one busy core while copies run); "
         "> 0 sleeps that many microseconds between checks that found nothing.", minimum=0.0),
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
    Knob("quota", "quotas", (), "Caps and reservations per model and tenant, so one cannot evict "
         "everyone else's cache (docs/operations.md, Quotas): [[quota]] tables at the end of the "
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
         "ends before it; docs/operations.md has the cost); off: trust the daemon's own memory.",
         choices=("off", "on")),
    Knob("log_level", "str", "info", "Logging level.", choices=("debug", "info", "warning", "error")),
    Knob("metrics_port", "int", 0, "TCP port of the Prometheus /metrics endpoint (needs kvd-cache[metrics]); "
         "0: off.", minimum=0),
    Knob("metrics_address", "str", "127.0.0.1", "Address the /metrics endpoint binds (0.0.0.0: every "
         "interface)."),
    Knob("metrics_socket", "str", "", "Unix socket that also serves /metrics (curl --unix-socket "
         "PATH http://kvd/metrics), open like the engine socket to the daemon's user, root and "
         "access_group only (unlike the TCP port, which any local user reaches); relative to "
         "runtime_dir. Empty: none."),
    Knob("metrics_max_connections", "int", 64, "Connections the /metrics endpoint serves at once, "
         "on the port and on metrics_socket each (lowered to a quarter of the open files limit "
         "in all); one more is closed as soon as it is accepted.", minimum=1),
    Knob("metrics_timeout_s", "float", 5.0, "Seconds a /metrics connection has to send its request "
         "and read the reply; then it is closed.", minimum=0.1),
    Knob("log_format", "str", "text", "Log line format: text, or json (one object per line with "
         "time, level, message and the line's fields) for log shippers.", choices=("text", "json")),
)
KNOB_BY_NAME = {k.name: k for k in KNOBS}


HIDDEN = "<hidden>"
_PY_TYPES = {"size": int, "int": int, "float": float, "str": str, "bool": bool, "quotas": tuple}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _from_text(knob: Knob, text: str):
    """An environment or flag value (always text) as the knob's type."""
    text = text.strip()
    if knob.kind == "int":
        if not re.fullmatch(r"[+-]?\d+", text):
            raise ValueError(f"expected an integer, got {text!r}")
        return int(text)
    if knob.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if knob.kind == "bool":
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in _TRUE
    return parse_size(text) if knob.kind == "size" else text


def _typed(knob: Knob, value):
    """A TOML (or Python) value, which must already have the knob's type."""
    if knob.kind == "size":
        return parse_size(value)
    wanted = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}[knob.kind]
    if isinstance(value, bool) != (knob.kind == "bool") or not isinstance(value, wanted):
        noun = {"int": "an integer", "float": "a number", "bool": "true or false",
                "str": "a string"}[knob.kind]
        hint = " (write it without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"expected {noun}, got {value!r}{hint}")
    return float(value) if knob.kind == "float" else value


def _coerce(knob: Knob, value, text: bool):
    if knob.kind == "quotas":
        return quota_rules.parse(value, text and isinstance(value, str), MAX_TENANT_CHARS)
    out = _from_text(knob, value) if text and isinstance(value, str) else _typed(knob, value)
    if knob.kind == "float" and not math.isfinite(out):
        raise ValueError(f"must be a finite number, got {out}")
    if knob.minimum is not None and out < knob.minimum:
        raise ValueError(f"must be >= {knob.minimum}, got {out}")
    if knob.choices and out not in knob.choices:
        raise ValueError(f"must be one of {', '.join(knob.choices)}, got {out!r}")
    return out


class _ConfigMethods:
    def as_dict(self) -> dict:
        """The knobs' values by name (no sources)."""
        return {k.name: getattr(self, k.name) for k in KNOBS}

    def describe(self) -> list:
        """(name, value as TOML, source) of every knob, in table order; secrets hidden."""
        return [(k.name, toml_value(k, self.public(k.name)), self.sources[k.name]) for k in KNOBS]

    def public(self, name: str):
        """The value of knob ``name`` as it may be shown: a secret that is set is "<hidden>"."""
        value = getattr(self, name)
        return HIDDEN if KNOB_BY_NAME[name].secret and value else value


def _default_sources():
    return MappingProxyType(dict.fromkeys(KNOB_BY_NAME, "default"))


Config = make_dataclass(
    "Config",
    [(k.name, _PY_TYPES[k.kind], field(default=k.default)) for k in KNOBS]
    + [("sources", MappingProxyType, field(default_factory=_default_sources, compare=False,
                                           repr=False)),
       ("file", str | None, field(default=None, compare=False))],
    bases=(_ConfigMethods,), frozen=True)
Config.__module__ = __name__
Config.__doc__ = ("The resolved knobs (``cfg.host_capacity``), immutable; ``sources[name]`` says "
                  "where each value came from (default, file, env, flag), ``file`` the TOML file.")


def _apply(values: dict, sources: dict, data: dict, source: str, origin: str) -> None:
    for key, raw in data.items():
        knob = KNOB_BY_NAME.get(key)
        if knob is None:
            raise ConfigError(key, f"unknown key (from {origin}; {config_checks.closest(key, KNOB_BY_NAME)})")
        try:
            values[key] = _coerce(knob, raw, text=source != "file")
        except ValueError as exc:
            raise ConfigError(key, f"{exc} (from {origin})") from None
        sources[key] = source


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None


def load_config(path: str | None = None, env: dict | None = None,
                overrides: dict | None = None) -> Config:
    """Defaults < ``path`` (TOML) < ``env`` (default: os.environ) < ``overrides`` (flags;
    None means "not given")."""
    values = {k.name: k.default for k in KNOBS}
    sources = dict.fromkeys(values, "default")
    if path:
        _apply(values, sources, _read_toml(path), "file", path)
    env = os.environ if env is None else env
    from_env = {k.name: env[f"KVD_{k.name.upper()}"] for k in KNOBS if f"KVD_{k.name.upper()}" in env}
    _apply(values, sources, from_env, "env", "environment")
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    _apply(values, sources, flags, "flag", "command line")
    config_checks.check(values)
    return Config(**values, sources=MappingProxyType(sources), file=path or None)


# ---- rendering ---------------------------------------------------------------------------

def toml_value(knob: Knob, value) -> str:
    """``value`` as a TOML literal: sizes with a unit where one divides them."""
    if knob.kind == "size":
        text = size_text(value)
        return text if text.isdigit() else f'"{text}"'
    if knob.kind == "bool":
        return "true" if value else "false"
    if knob.kind == "quotas":
        return quota_rules.to_toml(value)
    if knob.kind == "str":
        return json.dumps(value)  # a TOML basic string for every value a knob takes
    return repr(value)


def display_value(knob: Knob, value) -> str:
    """``value`` as a person reads it (``--help``, logs): 1GiB, auto, false, ""."""
    text = toml_value(knob, value)
    return text[1:-1] if text.startswith('"') and len(text) > 2 else text


_PRECEDENCE = "# Precedence: defaults < this file (--config) < KVD_<KEY> env < command-line flags."


def defaults_toml() -> str:
    """Every knob with its help and default, as a commented TOML file (configs/kvd.toml)."""
    out = ["# kvd configuration. Every key is optional; shown with its default.", _PRECEDENCE, ""]
    for knob in KNOBS:
        out.append(f"# {knob.help}")
        out.append(f"# type: {knob.kind}" + (f", one of: {', '.join(knob.choices)}" if knob.choices else ""))
        out.append(f"{knob.name} = {toml_value(knob, knob.default)}")
        out.append("")
    return "\n".join(out)


def resolved_toml(cfg: Config) -> str:
    """``cfg`` as TOML, each line saying where its value came from."""
    out = ["# kvd configuration as resolved: defaults < file < KVD_<KEY> env < flags.",
           f"# file: {cfg.file or '(none)'}", ""]
    for name, value, source in cfg.describe():
        where = f"env KVD_{name.upper()}" if source == "env" else source
        out.append(f"{name} = {value}  # {where}")
    return "\n".join(out) + "\n"
