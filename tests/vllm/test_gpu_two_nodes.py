"""Two nodes on one machine: a daemon per GPU, one Mooncake store between them.

Each GPU is a node: its own ``kvd serve --gpu on`` (own runtime dir and host
tier, ``CUDA_VISIBLE_DEVICES`` that GPU) with the remote tier on one
``mooncake_master`` (TCP transport, loopback), and its own vLLM engine. On a
machine of one GPU both nodes share it (their daemons and engines share
nothing else; the engines run one after the other).
Engine A on GPU 0 computes and stores the prompts, daemon A publishes their
chunks to the store. Engine B on GPU 1, fresh and poisoned, serves the same
prompts through daemon B, whose host tier held nothing: every hit chunk is
fetched from the store, then copied into B's blocks. B's hit blocks are
byte-identical to A's, the first tokens' logprobs agree, a control prompt
with another prefix gets no hit and other logprobs, and daemon B counts the
fetches. Needs a CUDA GPU, a GPU build of vLLM and the Mooncake wheel
(skipped otherwise, with the reason).

On the GPU machine (nvidia-h200-x2, or nvidia-h200: one GPU), Mooncake and vLLM do not fit one run's
carry: stage both here (``bash tools/gpu/stage_remote.sh``,
``bash ../shared/gpu/vllm/stage.sh``), then three runs back to back:
carry [".gpu"] ``REMOTE_THREADS= REMOTE_TESTS=0 bash .gpu/run.sh bash
tools/gpu/remote_bench.sh`` (installs Mooncake into /tmp/site, its libraries
into /tmp/kvd-mooncake-libs); carry [".vstage/cur1"] ``bash
.vstage/cur1/call1.sh``; carry [".vstage/cur2"] ``PYTHONPATH=/tmp/site
LD_LIBRARY_PATH=/tmp/kvd-mooncake-libs PATH=/tmp/site/bin:$PATH bash
.vstage/cur2/call2.sh python3 -m pytest -q -rs tests/vllm/test_gpu_two_nodes.py``.
"""

from __future__ import annotations

import pytest
from daemons import wait_for
from remote_servers import remote_knobs, running
from test_gpu_engine import ASYNC_MIN, CHUNK, HITS, MODEL, check_pair, finish, prompts, spawn
import tiny_llama

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(1500),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPUS = (0, 1) if torch.cuda.device_count() >= 2 else (0, 0)  # node A's, node B's


@pytest.fixture
def store():
    yield from running("mooncake")


def node(start_daemon, store, gpu: int):
    """A daemon on GPU ``gpu`` with the remote tier on ``store``, its breaker closed."""
    knobs, env = remote_knobs(store, segment="256MiB", buffer="64MiB", remote_prefix="two-nodes",
                              remote_timeout_s=5.0)
    d = start_daemon(env={**env, "CUDA_VISIBLE_DEVICES": str(gpu)}, gpu="on", chunk_tokens=CHUNK,
                     host_capacity="1GiB", client_timeout_s=30.0, heartbeat_interval_s=1.0, **knobs)
    wait_for(lambda: remote(d)["breaker"] == "closed", 30, "the store to answer")
    return d


def remote(d) -> dict:
    return d.stats()["tiers"]["remote"]


def test_a_prefix_computed_on_one_node_is_served_on_another_through_the_store(
        start_daemon, store, tmp_path, tmp_path_factory):
    model = tiny_llama.write(tmp_path_factory.mktemp("two-nodes"), config=MODEL, std=0.05)
    nodes = [node(start_daemon, store, gpu) for gpu in GPUS]
    p = prompts("two-nodes")

    def spec(d, names: list, poison=None) -> dict:
        return {"model": str(model), "poison": poison, "batches": [[p[n]] for n in names],
                "kvd": {"runtime_dir": str(d.runtime_dir), "timeout_s": 10.0,
                        "async_load_min_tokens": ASYNC_MIN, "partial_tails": False}}
    (stored,) = finish([spawn(tmp_path, "store-node-a", spec(nodes[0], ["long", "short"]), "v2",
                              env={"CUDA_VISIBLE_DEVICES": str(GPUS[0])})])
    chunks = (HITS["long"] + HITS["short"]) // CHUNK
    wait_for(lambda: remote(nodes[0])["puts"] >= chunks, 30, "daemon A's puts")
    (loaded,) = finish([spawn(tmp_path, "load-node-b", spec(nodes[1], ["long", "short", "control"],
                                                          poison=0.75), "v2",
                              env={"CUDA_VISIBLE_DEVICES": str(GPUS[1])})])
    check_pair(stored, loaded)
    b = remote(nodes[1])
    assert b["gets"] >= chunks and b["corrupt"] == 0 and b["errors"] == 0, b
    assert nodes[0].stats()["chunks_loaded"] == 0  # B's hits came through the store
    assert all(d.proc.poll() is None for d in nodes)
