"""Time to first token of a prefix another node computed: two kvd nodes sharing a Mooncake store.

    python examples/vllm_two_nodes.py --out /tmp/two-nodes.json     # a machine of 2 GPUs
    python examples/vllm_two_nodes.py --gpus 0,0 --out /tmp/two-nodes.json   # of 1 GPU

Each GPU is a node (``--gpus``: node A's and node B's; on one GPU both nodes
share it, their daemons and engines sharing nothing else, the engines run
one after the other): its own ``kvd serve`` (``--gpu on``, own runtime dir and
host tier, ``CUDA_VISIBLE_DEVICES`` that GPU) with the remote tier on one
``mooncake_master`` this script starts (TCP transport, loopback; Mooncake's
wheel in this python). The model is vllm_ttft.py's Llama-3-8B shape
(``--layers`` layers, dummy weights). Roles, each an engine process:

- ``store`` (node A): prefills each prefix plus a suffix; node A
  publishes the chunks to the store (the script waits for its puts);
- ``remote`` (node B): before each repeat node B's host tier is
  cleared (``clear``), so every chunk of the prefix is fetched from the
  store and then copied into the engine's blocks; TTFT of the prefix plus
  a new suffix, loaded between steps (``async_load_min_tokens`` 0);
- ``full`` (node B's GPU, no connector): the whole prefill, and the suffix alone
  with the prefix in vLLM's own cache (vllm_ttft.py's ``full`` role).

Reports medians of ``--repeat``: full, suffix, the remote hit, and
speedup = full / remote hit; ``--out`` keeps every run and node B's
remote-tier counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_ttft as T  # noqa: E402


@contextlib.contextmanager
def node(args, tmp: Path, name: str, gpu: int, store):
    """A ``kvd serve`` on GPU ``gpu`` with the remote tier on ``store``; yields its runtime dir."""
    run = tmp / f"run-{name}"
    flags = ["--gpu", args.daemon_gpu, "--host-capacity", args.host_capacity, "--warm-restart", "false",
             "--remote-backend", "mooncake", "--remote-address", store.address,
             "--remote-mooncake-metadata", store.metadata, "--remote-mooncake-local-host",
             "127.0.0.1", "--remote-prefix", "two-nodes", "--remote-timeout-s", "10",
             "--remote-mooncake-segment-bytes", args.segment]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.Popen([args.daemon_python, "-m", "kvd", "serve", "--runtime-dir", str(run), *flags],
                            env=env, stdout=open(tmp / f"kvd-{name}.log", "wb"), stderr=subprocess.STDOUT)
    try:
        T.wait_ready(args, run, proc)
        yield run
    finally:
        proc.terminate()
        proc.wait(30)


def remote_engine(args) -> dict:
    """Node B's engine: every repeat's prefix fetched from the store."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {"runtime_dir": args.runtime_dir, "async_load_min_tokens": 0, **json.loads(args.extra)}
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", seed=0,
              max_model_len=max(args.prefix_list) + args.suffix + 8, skip_tokenizer_init=True,
              enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvdConnector", kv_connector_module_path="kvd_client.vllm",
                  kv_role="kv_both", kv_connector_extra_config=extra))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    out = {}
    for n in args.prefix_list:
        shared = T.tokens(args, f"shared/{n}", n)
        print(f"[remote] prefix {n}", flush=True)
        runs = []
        for r in range(args.repeat):
            T.control(Path(args.runtime_dir), "clear")  # node B keeps nothing: the store serves it
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=shared + T.tokens(args, f"remote/{r}", args.suffix))],
                         one, use_tqdm=False)
            runs.append(time.perf_counter() - t0)
        out[n] = {"remote": runs}
    return out


def role(args, name: str, run: Path, gpu: int, tmp: Path) -> dict:
    """vllm_ttft.py's ``store`` / ``full`` role, or ``remote``, on node ``run``'s GPU."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    args.runtime_dir = str(run)
    sys.argv[sys.argv.index("--runtime-dir") + 1] = str(run)
    return T.run_role(args, name, tmp, __file__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    T.add_prompt_args(ap, "2048,8192,16384,32768", layers=32, repeat=5)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--segment", default="8GiB", help="memory each node lends the store")
    ap.add_argument("--gpus", default="0,1", help="node A's GPU and node B's (0,0: both on one)")
    ap.add_argument("--daemon-gpu", default="on", help="the daemons' --gpu (off: a check of the "
                    "nodes and the store without engines' GPU pools)")
    T.add_common_args(ap)
    ap.set_defaults(host_capacity="12GiB")
    args = ap.parse_args()
    args.prefix_list, args.tiny = [int(p) for p in args.prefixes.split(",")], False
    if args.role:
        got = remote_engine(args) if args.role == "remote" else T.engine(args, args.role)
        Path(args.role_out).write_text(json.dumps(got))
        return
    from kvd.bench.stores import MooncakeMaster

    if why := MooncakeMaster.missing():
        raise SystemExit(f"no Mooncake store here: {why}")
    gpu_a, gpu_b = (int(g) for g in args.gpus.split(","))
    store = MooncakeMaster().start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvd-2n-") as tmp, \
                node(args, Path(tmp), "a", gpu_a, store) as a, \
                node(args, Path(tmp), "b", gpu_b, store) as b:
            tmp, model = Path(tmp), Path(tmp) / "model"
            sys.argv += ["--model", str(model), "--runtime-dir", str(a)]
            args.model = str(model)
            T.write_config(model, T.LLAMA3_8B, args.layers, max(args.prefix_list) + args.suffix + 64)
            role(args, "store", a, gpu_a, tmp)
            wait_published(a, sum(n // 256 for n in args.prefix_list))
            rows = {n: {} for n in args.prefix_list}
            for name in ("remote", "full"):
                for n, got in role(args, name, b, gpu_b, tmp).items():
                    rows[n].update(got)
            report(args, rows, T.control(b, "stats")["tiers"].get("remote", {}))
    finally:
        store.stop()


def wait_published(run: Path, chunks: int, timeout: float = 300.0) -> None:
    """Until node A put at least ``chunks`` chunks (the prefixes' whole 256-token chunks) and
    its puts stopped for 2 s."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        puts = T.control(run, "stats")["tiers"]["remote"]["puts"]
        if puts != last:
            last, since = puts, time.monotonic()
        elif puts >= chunks and time.monotonic() - since > 2.0:
            print(f"[store] node A put {puts} chunks into the store", flush=True)
            return
        time.sleep(0.2)
    raise SystemExit(f"node A put {last} of at least {chunks} chunks in {timeout} s")


def report(args, rows: dict, remote: dict) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    print(f"{'prefix':>8}{'full ms':>12}{'suffix ms':>12}{'remote hit ms':>15}{'speedup':>9}")
    for n, m in med.items():
        cells = "".join(f"{m[k] * 1e3:>12.1f}" if k in m else f"{'-':>12}" for k in ("full", "suffix"))
        hit = f"{m['remote'] * 1e3:>15.1f}" if "remote" in m else f"{'-':>15}"
        speed = f"{m['full'] / m['remote']:>8.1f}x" if "full" in m and "remote" in m else f"{'-':>9}"
        print(f"{n:>8}{cells}{hit}{speed}")
    print(f"node B's remote tier: gets {remote.get('gets')}, {remote.get('get_bytes')} bytes, "
          f"corrupt {remote.get('corrupt')}, errors {remote.get('errors')}")
    if args.out:
        Path(args.out).write_text(json.dumps({**T.environment(), "args": vars(args), "runs": rows,
                                              "median": med, "node_b_remote": remote},
                                             default=str, indent=1))


if __name__ == "__main__":
    main()
