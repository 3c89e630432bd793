"""What a cross-node tier buys 8 and 64 nodes: the tables of docs/cluster.md.

Two parts, both deterministic (fixed seeds, no timing):

1. Hit rate against cache size, by simulation. A prefix-sharing workload:
   ``PREFIXES`` distinct prefixes (system prompts, documents, long chats) of
   ``PREFIX_TOKENS`` tokens each, requests drawing one from a Zipf law
   (exponent ``--zipf``) and routed to nodes uniformly at random (no
   prefix-aware routing: the case a shared tier is for). Each node keeps an
   LRU of ``per_node`` prefixes (its host and disk tiers); with the remote
   tier the cluster also shares an LRU of ``nodes x per_node`` prefixes
   (every node lends as much as it keeps). A request hits locally, else in
   the shared store (and brings the prefix into its node), else it misses,
   computes the prefix and publishes it.
2. Break-even prefix length: fetching the prefix's KV over the network
   (``bytes per token x n / link rate`` plus a round trip) against what a
   cached prefix saves, full prefill minus the 256-token suffix's prefill
   after it, both measured in docs/performance.md (H200, Llama-3-8B shape,
   8 layers) and fitted with a quadratic (attention grows with n^2).

Usage: ``python tools/cluster_model.py [--requests N] [--zipf S]`` prints
Markdown tables.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import numpy as np

PREFIXES = 20_000
PREFIX_TOKENS = 4096
CHUNK_TOKENS = 256
KV_BYTES_PER_TOKEN_LAYER = 2 * 8 * 128 * 2  # K and V, 8 KV heads, head dim 128, bf16
LAYERS_MEASURED = 8                         # the model of the measured prefill times
# ms of the measured model (docs/performance.md, prefix_reuse.py, H200): the full prefill of
# prefix + 256-token suffix, and the suffix's prefill alone after the cached prefix
MEASURED_PREFILL_MS = {2048: 17.3, 8192: 63.6, 32768: 346.7}
MEASURED_SUFFIX_MS = {2048: 11.7, 8192: 15.1, 32768: 28.2}
LINKS_GBPS = (25, 100, 400)
# what kvd's remote tier moved per second in `kvd bench --remote` (docs/cluster.md: gets; on
# the 2-core VM the lower of its two runs, four fetches in flight; on the 16-core GPU machine
# the lower of two runs' medians of 5, eight in flight (Redis: four and eight), checksums in 4
# processes; loopback both), in Gb/s
MEASURED_GBPS = {"kvd + Mooncake (TCP), 2-core VM, measured": 2.559 * 8,
                 "kvd + Mooncake (TCP), 16-core GPU machine, measured": 3.985 * 8,
                 "kvd + Redis, 2-core VM, measured": 1.394 * 8,
                 "kvd + Redis, 16-core GPU machine, measured": 1.462 * 8}
RTT_MS = 0.2  # one lookup round trip plus the store's own overhead per fetch


def zipf_requests(n: int, s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, PREFIXES + 1) ** s
    return rng.choice(PREFIXES, size=n, p=weights / weights.sum())


class Lru:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict = OrderedDict()

    def hit(self, key) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False

    def add(self, key) -> None:
        self.items[key] = None
        self.items.move_to_end(key)
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)


def simulate(requests: np.ndarray, nodes: int, per_node: int, shared: bool, seed: int) -> dict:
    """Fractions of requests that hit locally, in the shared store, or miss."""
    route = np.random.default_rng(seed + 1).integers(0, nodes, size=len(requests))
    local = [Lru(per_node) for _ in range(nodes)]
    store = Lru(nodes * per_node) if shared else None
    warm = len(requests) // 2  # the first half warms the caches, not counted
    counts = {"local": 0, "remote": 0, "miss": 0}
    for i, (prefix, node) in enumerate(zip(requests.tolist(), route.tolist())):
        if local[node].hit(prefix):
            kind = "local"
        elif store is not None and store.hit(prefix):
            kind = "remote"
            local[node].add(prefix)
        else:
            kind = "miss"
            local[node].add(prefix)
            if store is not None:
                store.add(prefix)
        if i >= warm:
            counts[kind] += 1
    total = len(requests) - warm
    return {k: v / total for k, v in counts.items()}


def hit_rate_tables(requests: int, s: float) -> str:
    reqs = zipf_requests(requests, s, seed=7)
    prefix_gib = PREFIX_TOKENS * KV_BYTES_PER_TOKEN_LAYER * 32 / 2**30  # full 32-layer model
    out = [(f"Zipf exponent {s}, {PREFIXES:,} prefixes of {PREFIX_TOKENS} tokens "
           f"({prefix_gib:.2f} GiB of KV each for all 32 layers of Llama-3-8B), "
           f"{requests:,} requests (the first half warms up), routed at random."), ""]
    out.append("| nodes | cache per node (prefixes) | local only: hit rate | with the remote tier: "
               "local + remote = hit rate | remote fetches per request |")
    out.append("|---|---|---|---|---|")
    for nodes in (8, 64):
        for per_node in (50, 200, 1000, 4000):
            alone = simulate(reqs, nodes, per_node, False, seed=11)
            shared = simulate(reqs, nodes, per_node, True, seed=11)
            hit = shared["local"] + shared["remote"]
            out.append(f"| {nodes} | {per_node} | {1 - alone['miss']:.1%} | "
                       f"{shared['local']:.1%} + {shared['remote']:.1%} = {hit:.1%} | "
                       f"{shared['remote']:.3f} |")
    return "\n".join(out)


def saving_fit() -> np.ndarray:
    """Coefficients of saved ms = a + b n + c n^2 (full prefill minus the suffix's) through the
    three measured prefix lengths."""
    n = np.array(sorted(MEASURED_PREFILL_MS), dtype=float)
    ms = np.array([MEASURED_PREFILL_MS[k] - MEASURED_SUFFIX_MS[k] for k in sorted(MEASURED_PREFILL_MS)])
    return np.linalg.solve(np.stack([np.ones_like(n), n, n * n], axis=1), ms)


def fetch_ms(tokens, gbps: float, layers: int = LAYERS_MEASURED) -> np.ndarray:
    nbytes = np.asarray(tokens, dtype=float) * KV_BYTES_PER_TOKEN_LAYER * layers
    return RTT_MS + nbytes * 8 / (gbps * 1e9) * 1e3


def break_even_table() -> str:
    a, b, c = saving_fit()
    n = np.arange(CHUNK_TOKENS, 131_072 + 1, CHUNK_TOKENS, dtype=float)
    saving = np.maximum(a + b * n + c * n * n, 0.0)
    per_token = KV_BYTES_PER_TOKEN_LAYER * LAYERS_MEASURED
    lengths = sorted(MEASURED_PREFILL_MS)
    saved = " / ".join(f"{MEASURED_PREFILL_MS[k] - MEASURED_SUFFIX_MS[k]:.1f}" for k in lengths)
    out = [(f"Saved by a cached prefix of n tokens (full prefill minus the suffix's): ms = "
           f"{a:.2f} + {b * 1e3:.4f}e-3 n + {c * 1e6:.4f}e-6 n^2 through the measured "
           f"{saved} ms at {' / '.join(map(str, lengths))} tokens. Fetch: {RTT_MS} ms + n x "
           f"{per_token // 1024} KiB / link rate."), "",
           ("| link or path | fetch 1k tokens | fetch 2k / 8k / 32k tokens | saved 2k / 8k / 32k | "
           "fetching wins from |"), "|---|---|---|---|---|"]
    rows = [(f"{g} Gb/s (the link's full rate)", g) for g in LINKS_GBPS] + \
        [(f"{name}: {g / 8:.2f} GB/s", g) for name, g in MEASURED_GBPS.items()]
    for label, gbps in rows:
        fetch = fetch_ms(n, gbps)
        wins = n[fetch < saving]
        first = f"{int(wins[0]):,} tokens" if len(wins) else "never (up to 128k)"
        if len(wins) and not np.all(fetch[n >= wins[0]] < saving[n >= wins[0]]):
            first += " (not at every longer length)"
        row = " / ".join(f"{float(fetch_ms(k, gbps)):.1f}" for k in lengths)
        out.append(f"| {label} | {float(fetch_ms(1024, gbps)) - RTT_MS:.2f} ms | {row} ms | "
                   f"{saved} ms | {first} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--zipf", type=float, default=0.9)
    args = p.parse_args()
    print(hit_rate_tables(args.requests, args.zipf))
    print()
    print(break_even_table())


if __name__ == "__main__":
    main()
