"""The backend's options, read from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the whole extra-config dict to every backend: its own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``allocator``, ...) sit beside ours. Ours start with ``kvd_`` (``OPTIONS``
names them without it); an unknown ``kvd_`` key or a value of the wrong type
is a ``ValueError`` that stops SGLang at start-up, with the list of known
options, never a silently ignored typo. Everything else is SGLang's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd_client.adapter_options import Option, checked
from kvd_protocol.keys import DTYPE_SIZES

PREFIX = "kvd_"
KEY_MODES = ("tokens", "hashes")


OPTIONS = {
    "runtime_dir": Option(str, "", "the kvd daemon's runtime directory; empty: kvd's own resolution "
                          "($KVD_RUNTIME_DIR, $XDG_RUNTIME_DIR/kvd, /run/kvd, /tmp/kvd-<uid>)"),
    "model_id": Option(str, "", "the model identity in chunk keys; empty: SGLang's model name "
                       "(--served-model-name or the model path). Engines that share chunks, SGLang "
                       "or vLLM, must agree on it"),
    "fingerprint": Option(str, "", "the weights beyond model_id (checkpoint hash, revision): "
                          "engines with other fingerprints never share chunks"),
    "key_mode": Option(str, "tokens", "'tokens': chunk keys from token ids, as every kvd client "
                       "computes them: entries shared with any engine of the same namespace (needs "
                       "SGLang's Python radix tree: SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python); "
                       "'hashes': keys from SGLang's page hashes, shared by SGLang engines only",
                       KEY_MODES),
    "salt": Option(str, "", "a fixed salt in every key, both key modes (a tenant or deployment)"),
    "kv_dtype": Option(str, "", "the KV's logical dtype when SGLang stores it as uint8 (fp8 "
                       "caches: float8_e4m3fn or float8_e5m2); empty: the host pool's dtype",
                       ("",) + tuple(DTYPE_SIZES)),
    "timeout_s": Option(float, 5.0, "deadline of each kvd call and transfer, seconds; a miss "
                        "after it (SGLang recomputes, or keeps the page in host memory only)",
                        positive=True),
    "staging_pages": Option(int, 128, "SGLang pages per direction in the staging pool (the "
                            "/dev/shm file kvd copies from and into): the most pages one kvd "
                            "request moves; SGLang's batches are 128 pages", positive=True),
    "load_pipeline_pages": Option(int, 8, "SGLang pages per kvd load request inside a batch: "
                                  "while kvd moves one request's pages into the staging pool, "
                                  "the backend copies the previous one's into SGLang's host "
                                  "pool; staging_pages or more: one request per batch, no "
                                  "overlap", positive=True),
    "copy_threads": Option(int, 4, "threads copying pages between the staging pool and "
                           "SGLang's host pool (torch copies, the GIL released)", positive=True),
    "key_map_pages": Option(int, 65536, "key_mode 'tokens': SGLang page hashes whose tokens "
                            "are remembered (least recently used forgotten first); a page whose "
                            "hash was forgotten is a miss", positive=True),
    "host_pool": Option(str, "shared", "'shared': SGLang's host pool itself is moved into a "
                        "/dev/shm file kvd maps (kvd_client.sglang.shared_host), no copy in the "
                        "backend; where it cannot be (or without interface_v1), the backend says "
                        "why and stages; 'staging': pages cross a staging pool (a /dev/shm file "
                        "kvd maps) and one copy between it and SGLang's host pool",
                        ("shared", "staging")),
    "shm_dir": Option(str, "/dev/shm", "where the staging pool's (or the shared host pool's) "
                      "file goes (the daemon's shm_dir)"),
    "offload": Option(bool, True, "the linker: False stores nothing from this engine (it loads "
                      "what other engines stored, a read-only consumer); SGLang keeps such pages "
                      "on the GPU only"),
    "gil_switch_ms": Option(float, 0.0, "sets Python's GIL switch interval of the SGLang "
                            "process (sys.setswitchinterval) to this many milliseconds: a thread "
                            "woken by a reply or a queue waits up to one interval for the GIL "
                            "while the scheduler thread runs (Python's default 5 ms); 0: leave "
                            "it as it is"),
}


@dataclass(frozen=True)
class Options:
    runtime_dir: str = ""
    model_id: str = ""
    fingerprint: str = ""
    key_mode: str = "tokens"
    salt: str = ""
    kv_dtype: str = ""
    timeout_s: float = 5.0
    staging_pages: int = 128
    load_pipeline_pages: int = 8
    copy_threads: int = 4
    key_map_pages: int = 65536
    host_pool: str = "shared"
    shm_dir: str = "/dev/shm"
    offload: bool = True
    gil_switch_ms: float = 0.0

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> Options:
        values = {}
        for key, value in (extra or {}).items():
            if not isinstance(key, str) or not key.startswith(PREFIX):
                continue  # SGLang's own keys
            name = key[len(PREFIX):]
            if name not in OPTIONS:
                known = ", ".join(PREFIX + n for n in OPTIONS)
                raise ValueError(f"unknown kvd option {key!r} in the extra config; known: {known}")
            values[name] = checked(key, OPTIONS[name], value)
        return cls(**values)

    def apply_process_settings(self) -> None:
        """The settings that are the process's, not the backend's (``gil_switch_ms``)."""
        if self.gil_switch_ms > 0:
            import sys

            sys.setswitchinterval(self.gil_switch_ms / 1000.0)
