"""One arm of the fleet run: fresh servers (and a fresh kvd), the passes of vLLM's benchmark.

``run_arm(args, procs, arm, index)`` starts ``args.servers`` OpenAI servers
with the arm's cache (``none``, ``native``, ``kvd``, ``lmcache``) and the
proxy, then runs the scenarios asked for, each a pass of the same prompts:

- ``steady``: the pass on fresh servers (every prefix cold at first);
- ``restart``: server 0 is taken out of the rotation, drained, killed (its
  GPU and native caches lost) and started again while a pass runs on the
  others (``during_restart``); then a pass with it back: the TTFT of its
  first 50 requests (the proxy's records);
- ``kvd-restart`` (arm ``kvd``): the daemon is stopped (SIGTERM) and started
  again on the tier it left (warm restart) during a pass, the servers
  carrying on: in the ``restart`` pass once server 0 served its 50, else in
  a pass of its own. Failed requests, and answers that differ from the
  previous pass's (greedy: the same prompts should give the same text),
  are counted.

Returns the arm's figures (times in ms); every process of the arm is
stopped before it returns.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time

from . import bench
from .lmcache import lmcache_start, lmcache_status
from .procs import Procs, get, kvd_drop, kvd_start, kvd_stats, post, server_cmd, wait_http


def say(msg: str) -> None:
    # the real stdout: the benchmark's printout, redirected to its log, may be running
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.__stdout__, flush=True)


def start_servers(args, procs: Procs, arm: str, ports: list[int], run) -> tuple[list, float]:
    """The servers, started together (``args.parallel_start``) or one after another."""
    t0, servers = time.monotonic(), []
    for i, port in enumerate(ports):
        servers.append(procs.start(f"{arm}-server{i}", server_cmd(args, arm, port, run), args.server_env))
        if not args.parallel_start:
            wait_http(f"http://127.0.0.1:{port}/health", servers[-1], procs, args.start_timeout)
    for port, p in zip(ports, servers):
        wait_http(f"http://127.0.0.1:{port}/health", p, procs, args.start_timeout)
    return servers, time.monotonic() - t0


def run_arm(args, procs: Procs, arm: str, index: int) -> dict:
    run = args.work / f"kvd-{arm}"
    base = args.port + 20 * index
    count = args.none_servers if arm == "none" and args.none_servers else args.servers
    ports = [base + 1 + i for i in range(count)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    proxy_url = f"http://127.0.0.1:{base}"
    out = {"arm": arm, "servers": count}
    try:
        daemon = kvd_start(args, procs, run, cold=True) if arm == "kvd" else None
        if arm == "lmcache":
            lmcache_start(args, procs, count)
            say(f"lmcache: its server is up ({args.host_gib:g} GiB of L1)")
        say(f"{arm}: starting {count} servers")
        servers, out["start_s"] = start_servers(args, procs, arm, ports, run)
        say(f"{arm}: servers up in {out['start_s']:.0f} s")
        proxy = procs.start(f"{arm}-proxy", [args.python, str(args.proxy_py), "--port", str(base),
                                             "--backends", ",".join(urls)])
        wait_http(proxy_url + "/fleet/state", proxy, procs, 60)
        passes = out["passes"] = {}
        ctx = {"args": args, "procs": procs, "arm": arm, "urls": urls, "proxy": proxy_url,
               "ports": ports, "servers": servers, "run": run, "daemon": daemon}
        previous = None
        for scenario in args.scenario_list:
            if scenario == "kvd-restart" and arm != "kvd" or scenario == "restart" and arm not in args.restart_arms:
                continue
            say(f"{arm}: pass '{scenario}'")
            fig, result = SCENARIOS[scenario](ctx, previous)
            if fig is None:
                continue
            passes[scenario], row = fig, fig["summary"]
            say(f"{arm}: {scenario}: TTFT p50 {row['ttft_p50']:.1f} ms, p99 {row['ttft_p99']:.1f} ms, "
                f"{row['output_tok_s']:.0f} tok/s, {row['failed']} failed; hits {passes[scenario]['hits']}")
            previous = result
        if arm == "kvd":
            out["kvd_stats"] = kvd_stats(args, run)
        if arm == "lmcache":
            out["lmcache_status"] = lmcache_status(args)
    finally:
        procs.stop_all()
        if arm == "kvd":
            kvd_drop(args, run)
    return out


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """``fn()`` in a thread; its value (or the SystemExit it raised) lands in the dict."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except SystemExit as exc:
            box["exit"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def joined(t: threading.Thread, box: dict):
    t.join()
    if "exit" in box:
        raise box["exit"]
    return box["value"]


def one_pass(ctx, tag: str, during=None) -> tuple[dict, dict]:
    """A pass of the benchmark through the proxy; ``during(thread)`` runs while it does."""
    args = ctx["args"]
    before = [bench.scrape(u) for u in ctx["urls"]]
    daemon_before = kvd_stats(args, ctx["run"]) if ctx["arm"] == "kvd" else None
    logged = json.loads(get(ctx["proxy"] + "/fleet/state"))["logged"]
    t, box = in_thread(lambda: bench.bench(args, ctx["proxy"], f"{ctx['arm']}-{tag}"))
    extra = during(t, logged) if during else {}
    result = joined(t, box)
    after = [bench.scrape(u) for u in ctx["urls"]]
    records = json.loads(get(f"{ctx['proxy']}/fleet/log?since={logged}", 30))
    fig = {"summary": bench.summary(result), "hits": bench.hits(before, after),
           "hits_by_server": [bench.hits([b], [a]) for b, a in zip(before, after)],
           "engine_times": bench.engine_times(before, after),
           "ttfts_ms": [round(t, 2) for t in bench.ttfts_ms(result)],
           "backend_ttft_p50_ms": backend_p50(records, len(ctx["urls"])), "records": records,
           "errors": sorted({e for e in result.get("errors", []) if e})[:5],
           "failed_requests": [i for i, e in enumerate(result.get("errors", [])) if e],
           "text_hashes": [hashlib.sha1(t.encode()).hexdigest()[:10] for t in bench.texts(result)], **extra}
    if args.workload == "multi_turn":
        fig["ttft_p50_by_turn"] = bench.ttft_p50_by_turn(result, args.conversations)
    if daemon_before is not None:
        fig["daemon"] = daemon_pass(daemon_before, kvd_stats(args, ctx["run"]))
    return fig, result


def daemon_pass(before: dict, after: dict) -> dict:
    """What the daemon did in a pass: the bytes it moved and its requests' latencies (p50/p99
    ms of its latest requests, up to 2,048 an op, as ``kvd stats`` gives them: a restarted
    daemon's cover only the part after its restart), loads and stores split by phase."""
    restarted = after.get("uptime_s", 0) < before.get("uptime_s", 0)  # its counters began again
    moved = {k: after.get(k, 0) - (0 if restarted else before.get(k, 0))
             for k in ("bytes_stored", "bytes_loaded", "chunks_stored", "chunks_loaded", "hits", "misses")}
    latency = {op: {"count": v.get("count"), "p50_ms": v.get("p50_ms"), "p99_ms": v.get("p99_ms")}
               for op, v in after.get("latency", {}).items() if op in ("lookup", "load", "store", "lease")}
    phases = {op: after.get("latency_phases", {}).get(op) for op in ("load", "store")}
    return {**moved, "latency": latency, "phases": phases, "uptime_s": after.get("uptime_s")}


def backend_p50(records: list, n: int) -> list[float]:
    return [round(bench.pct([r["ttft"] * 1e3 for r in records if r["backend"] == i], 50), 2)
            for i in range(n)]


def same_texts(fig: dict, result: dict, previous: dict | None) -> None:
    if previous is not None:
        a, b = bench.texts(result), bench.texts(previous)
        fig["texts_differ"] = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def steady(ctx, previous):
    fig, result = one_pass(ctx, "steady")
    same_texts(fig, result, previous)
    return strip(fig), result


def restart(ctx, previous):
    """Server 0 drained, killed and started again while a pass runs on the others; then a pass
    with it back: its first 50 requests' TTFT. In the kvd arm (with ``kvd-restart`` asked for)
    the daemon is restarted during that pass once server 0 served its 50 (or 3/4 of its share of a
    smaller pass)."""
    args, procs, proxy = ctx["args"], ctx["procs"], ctx["proxy"]
    post(proxy + "/fleet/off/0")
    while json.loads(get(proxy + "/fleet/state"))["inflight"][0]:
        time.sleep(0.1)
    procs.stop(ctx["servers"][0])
    t0 = time.monotonic()
    ctx["servers"][0] = procs.start(f"{ctx['arm']}-server0-restarted",
                                    server_cmd(args, ctx["arm"], ctx["ports"][0], ctx["run"]), args.server_env)
    t, box = in_thread(lambda: one_pass(ctx, "during-restart"))
    wait_http(ctx["urls"][0] + "/health", ctx["servers"][0], procs, args.start_timeout)
    restart_s = time.monotonic() - t0
    say(f"{ctx['arm']}: server 0 back in {restart_s:.0f} s")
    during, _ = joined(t, box)
    post(proxy + "/fleet/on/0")
    bounce = ctx["arm"] == "kvd" and "kvd-restart" in args.scenario_list
    share = args.num_prompts * 3 // (4 * len(ctx["urls"]))  # 3/4 of server 0's share
    fig, result = one_pass(ctx, "restart", (lambda t, since: bounce_kvd(ctx, t, since, min(50, max(1, share))))
                           if bounce else None)
    first = [r["ttft"] * 1e3 for r in fig["records"] if r["backend"] == 0][:50]
    fig.update(restart_s=round(restart_s, 1), first50_n=len(first),
               first50_ttft_p50_ms=round(bench.pct(first, 50), 2), first50_ttft_ms=[round(t, 2) for t in first],
               during_restart=strip(during)["summary"])
    same_texts(fig, result, previous)
    return strip(fig), result


def bounce_kvd(ctx, t: threading.Thread, since: int, server0: int = 0) -> dict:
    """Stop the daemon (SIGTERM) and start it on the tier it left, once server 0 served
    ``server0`` requests of this pass (0: once a third of the pass was served)."""
    args, procs, total = ctx["args"], ctx["procs"], ctx["args"].num_prompts
    while t.is_alive():
        records = json.loads(get(f"{ctx['proxy']}/fleet/log?since={since}", 30))
        served = sum(r["backend"] == 0 for r in records) if server0 else len(records)
        if served >= (server0 or total // 3):
            t0 = time.monotonic()
            procs.stop(ctx["daemon"], grace=60)
            ctx["daemon"] = kvd_start(args, procs, ctx["run"], cold=False)
            say(f"kvd: daemon restarted (warm) in {time.monotonic() - t0:.1f} s, mid-pass")
            return {"kvd_restarted": True, "kvd_down_s": round(time.monotonic() - t0, 2),
                    "kvd_restart_after": len(records)}
        time.sleep(0.2)
    return {"kvd_restarted": False}


def kvd_restart(ctx, previous):
    """A pass with the daemon restarted (warm) once a third of it was served (when the
    ``restart`` scenario is not run, which restarts it in its own pass)."""
    if "restart" in ctx["args"].scenario_list and "kvd" in ctx["args"].restart_arms:
        return None, previous
    fig, result = one_pass(ctx, "kvd-restart", lambda t, since: bounce_kvd(ctx, t, since))
    same_texts(fig, result, previous)
    return strip(fig), result


def strip(fig: dict) -> dict:
    fig.pop("records", None)  # kept in the proxy's log only: too long for the report
    return fig


SCENARIOS = {"steady": steady, "restart": restart, "kvd-restart": kvd_restart}
