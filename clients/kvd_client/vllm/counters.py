"""The connector's counters: what each side did since vLLM last collected them.

The scheduler counts lookups and hits, workers count loads and stores (their
tokens, bytes and failures). ``totals(source)`` returns every non-zero
counter since the start as ``{"<source>/<name>": total}``: vLLM drops the
connector stats of some steps (its offline ``LLM`` records a step's stats only
when the step has request outputs), so kvd hands over running totals, never
deltas, and a dropped step is caught up by the next one
(kvd_client.vllm.stats). ``take()`` returns the counts since its last call
(tests). With tensor parallelism every worker counts its own shard: tokens are
counted once per rank, bytes are each rank's own.
"""

from __future__ import annotations

import threading

HELP = {
    "lookups": "prompts looked up in kvd",
    "lookup_tokens": "prompt tokens looked up (whole chunks past vLLM's own prefix-cache hit)",
    "hit_tokens": "tokens kvd offered to vLLM (external prefix-cache hits)",
    "loads": "loads from kvd that ended (ok or failed)",
    "load_failures": "loads that failed or came back short (vLLM recomputes those blocks)",
    "loaded_tokens": "tokens whose KV kvd copied into vLLM's blocks",
    "loaded_bytes": "bytes kvd copied into vLLM's blocks (this rank's shard)",
    "stores": "stores to kvd that ended (ok or failed)",
    "store_failures": "stores that failed (nothing of them is cached)",
    "stored_tokens": "tokens now cached in kvd by stores (new or already there)",
    "stored_bytes": "bytes of KV offered to kvd by stores that succeeded (this rank's shard)",
    "requests": "requests that ended (finished or aborted)",
    "prompt_tokens": "prompt tokens of the requests that ended",
    "recomputed_tokens": "prompt tokens of the requests that ended that neither vLLM's own "
                         "prefix cache nor kvd served at admission (per request: divide by "
                         "requests; loads that failed later are in load_failures)",
}


class Counters:
    def __init__(self):
        self._lock = threading.Lock()
        self._data = dict.fromkeys(HELP, 0)
        self._total = dict.fromkeys(HELP, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._data[name] += n
                self._total[name] += n

    def totals(self, source: str) -> dict[str, int]:
        with self._lock:
            return {f"{source}/{k}": v for k, v in self._total.items() if v}

    def take(self) -> dict[str, int]:
        with self._lock:
            out = {k: v for k, v in self._data.items() if v}
            self._data = dict.fromkeys(HELP, 0)
        return out
