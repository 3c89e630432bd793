"""One arm of the fleet run: fresh servers (and a fresh kvd), the passes of vLLM's benchmark.

``run_arm(args, procs, arm, index)`` starts ``args.servers`` OpenAI servers
with the arm's cache (``none``, ``native``, ``kvd``, ``lmcache``) and the
proxy, then runs the scenarios asked for, each a pass of the same prompts:

- ``steady``: the pass on fresh servers (every prefix cold at first);
- ``restart``: server 0 is taken out of the rotation, drained, killed (its
  GPU and native caches lost) and started again; then a pass: the TTFT of
  its first 50 requests (the proxy's records) against its own in ``steady``;
- ``kvd-restart`` (arm ``kvd``): a pass during which the daemon is stopped
  (SIGTERM) and started again on the tier it left (warm restart); the
  servers carry on: failed requests, and answers that differ from the
  previous pass's (greedy: the same prompts must give the same text).

Returns the arm's figures (times in ms); every process of the arm is
stopped before it returns.
"""

from __future__ import annotations

import hashlib
import json
import time

from . import bench
from .procs import Procs, get, kvd_drop, kvd_start, kvd_stats, post, server_cmd, wait_http


def say(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
            if scenario == "kvd-restart" and arm != "kvd":
                continue
            say(f"{arm}: pass '{scenario}'")
            passes[scenario], result = SCENARIOS[scenario](ctx, previous)
            row = passes[scenario]["summary"]
            say(f"{arm}: {scenario}: TTFT p50 {row['ttft_p50']:.1f} ms, p99 {row['ttft_p99']:.1f} ms, "
                f"{row['output_tok_s']:.0f} tok/s, {row['failed']} failed; hits {passes[scenario]['hits']}")
            previous = result
        if arm == "kvd":
            out["kvd_stats"] = kvd_stats(args, run)
    finally:
        procs.stop_all()
        if arm == "kvd":
            kvd_drop(args, run)
    return out


def one_pass(ctx, tag: str, background=None) -> tuple[dict, dict]:
    """A pass of the benchmark through the proxy; ``background(started_at)`` runs while it does."""
    args, procs = ctx["args"], ctx["procs"]
    before = [bench.scrape(u) for u in ctx["urls"]]
    logged = json.loads(get(ctx["proxy"] + "/fleet/state"))["logged"]
    started = bench.start(args, procs, ctx["proxy"], f"{ctx['arm']}-{tag}")
    extra = background(started) if background else {}
    result = bench.finish(procs, *started)
    after = [bench.scrape(u) for u in ctx["urls"]]
    records = json.loads(get(f"{ctx['proxy']}/fleet/log?since={logged}", 30))
    fig = {"summary": bench.summary(result), "hits": bench.hits(before, after),
           "hits_by_server": [bench.hits([b], [a]) for b, a in zip(before, after)],
           "ttfts_ms": [round(t, 2) for t in bench.ttfts_ms(result)],
           "backend_ttft_p50_ms": backend_p50(records, len(ctx["urls"])), "records": records,
           "errors": sorted({e for e in result.get("errors", []) if e})[:5],
           "text_hashes": [hashlib.sha1(t.encode()).hexdigest()[:10] for t in bench.texts(result)], **extra}
    return fig, result


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
    """Server 0 drained, killed and started again, then a pass; its first 50 requests' TTFT."""
    args, procs, proxy = ctx["args"], ctx["procs"], ctx["proxy"]
    post(proxy + "/fleet/off/0")
    while json.loads(get(proxy + "/fleet/state"))["inflight"][0]:
        time.sleep(0.1)
    procs.stop(ctx["servers"][0])
    t0 = time.monotonic()
    ctx["servers"][0] = procs.start(f"{ctx['arm']}-server0-restarted",
                                    server_cmd(args, ctx["arm"], ctx["ports"][0], ctx["run"]), args.server_env)
    wait_http(ctx["urls"][0] + "/health", ctx["servers"][0], procs, args.start_timeout)
    restart_s = time.monotonic() - t0
    post(proxy + "/fleet/on/0")
    fig, result = one_pass(ctx, "restart")
    first = [r["ttft"] * 1e3 for r in fig["records"] if r["backend"] == 0][:50]
    fig.update(restart_s=round(restart_s, 1), first50_n=len(first),
               first50_ttft_p50_ms=round(bench.pct(first, 50), 2), first50_ttft_ms=[round(t, 2) for t in first])
    same_texts(fig, result, previous)
    return strip(fig), result


def kvd_restart(ctx, previous):
    """A pass with the daemon stopped and started again (warm) once a third of it was served."""
    args, procs = ctx["args"], ctx["procs"]
    total = args.prefixes * args.per_prefix

    def bounce(started) -> dict:
        logged0 = json.loads(get(ctx["proxy"] + "/fleet/state"))["logged"]
        while json.loads(get(ctx["proxy"] + "/fleet/state"))["logged"] - logged0 < total // 3:
            if started[0].poll() is not None:
                return {"kvd_restarted": False}
            time.sleep(0.05)
        t0 = time.monotonic()
        procs.stop(ctx["daemon"], grace=60)
        ctx["daemon"] = kvd_start(args, procs, ctx["run"], cold=False)
        return {"kvd_restarted": True, "kvd_down_s": round(time.monotonic() - t0, 2)}

    fig, result = one_pass(ctx, "kvd-restart", bounce)
    same_texts(fig, result, previous)
    return strip(fig), result


def strip(fig: dict) -> dict:
    fig.pop("records", None)  # kept in the proxy's log only: too long for the report
    return fig


SCENARIOS = {"steady": steady, "restart": restart, "kvd-restart": kvd_restart}
