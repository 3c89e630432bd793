"""The connector's two halves against a real daemon, without vLLM: what the part tests drive.

``Engine(runtime_dir, name, **settings)`` wires one engine's ``SchedulerSide``
and ``WorkerSide`` over one real pool in /dev/shm, with real clients (what
KvdConnector wires together); ``run_step`` plays one vLLM step. vLLM's own
objects are small stand-ins with the attributes the connector reads:
``Request``, ``Blocks`` (``KVCacheBlocks``), ``step_output``
(``SchedulerOutput``). ``store_prompt`` computes a prompt in one engine and
waits until its chunks are in kvd; ``frozen(daemon)`` stops the daemon
(SIGSTOP) for the length of a ``with`` block. The ``engines`` fixture
(tests/vllm/conftest.py) makes engines on one daemon and closes them.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from kvd_client import KvdClient, shm
from kvd_client.vllm import geometry as G
from kvd_client.vllm.counters import Counters
from kvd_client.vllm.pool import VllmKVPool
from kvd_client.vllm.scheduler import SchedulerSide
from kvd_client.vllm.settings import Settings
from kvd_client.vllm.worker import WorkerSide
from kvd_protocol import layout as L

BS, BLOCKS, CHUNK = 4, 64, 16    # vLLM blocks of 4 tokens; kvd chunks of 16 = 4 blocks


@dataclass
class Request:  # the attributes of vllm.v1.request.Request the connector reads
    request_id: str
    all_token_ids: list
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: object = None
    num_prompt_tokens: int = field(default=0)

    def __post_init__(self):
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def step_output(new=(), cached=(), scheduled=None, preempted=()):
    """A scheduler output: new requests (id, blocks, computed) and cached ones."""
    cr = SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                         new_block_ids=[c[1] for c in cached],
                         num_computed_tokens=[c[2] for c in cached])
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                            for r, b, c in new],
        scheduled_cached_reqs=cr, num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(preempted))


class Engine:
    """One engine's two halves over one pool: what KvdConnector wires together."""

    def __init__(self, runtime_dir, name, **settings):
        # a generous lookup wait: a loaded test machine's replies still come on the first call
        self.s = Settings(**{"runtime_dir": str(runtime_dir), "timeout_s": 2.0,
                             "async_load_min_tokens": 32, "lookup_wait_ms": 1000.0, **settings})
        self.geo = G.KVGeometry(model=f"test|{name}", kv_dtype="uint8", attention="opaque",
                                num_layers=2, kv_heads=1, head_dim=8, tp_size=1, block_size=BS,
                                interior="HNC")
        size = 2 * BLOCKS * BS * 8
        self.file = shm.ShmFile.create("kvd-pool", size, "/dev/shm")
        self.path, self.map = self.file.path, self.file.map
        self.kv = np.frombuffer(self.map, dtype=np.uint8).reshape(2, BLOCKS, 1, BS, 8)
        refs_ = [L.TensorRef(0, l * BLOCKS * BS * 8, (BLOCKS, 1, BS, 8), (BS * 8, BS * 8, 8, 1), 1)
                 for l in range(2)]
        pool = VllmKVPool(self.geo, refs_, [{"kind": "shm", "path": str(self.path), "size": size}],
                          BLOCKS)
        self.counters = Counters()
        self.sc, self.wc = (KvdClient(str(runtime_dir), timeout=self.s.timeout_s).connect()
                          for _ in range(2))  # as KvdConnector makes them
        self.sched = SchedulerSide(self.sc, self.sc.attach(**self.geo.attach_fields()), self.s, BS,
                                   loads=True, stores=True, counters=self.counters)
        self.worker = WorkerSide(self.wc, self.geo, ["l0", "l1"], 0, self.counters)
        self.worker.register(pool)

    def run_step(self, so, finished=()):
        plan = self.sched.step(so)
        self.worker.preempted(plan)
        self.worker.start(plan)
        for layer in ("l0", "l1"):
            self.worker.wait_layer(layer)
        self.worker.after_forward(plan)
        sending, recving = self.worker.finished(set(finished))
        errors = self.worker.load_errors()
        self.sched.update(recving, self.worker.report())
        return plan, sending, recving, errors

    def close(self):
        self.sched.close()
        self.worker.close(2.0)
        self.sc.close()
        self.kv = self.map = None
        self.file.close()


def fill(engine, blocks, seed):
    engine.kv[:, blocks] = np.random.default_rng(seed).integers(0, 256, engine.kv[:, blocks].shape)


def store_prompt(e, req_id, tokens, blocks):
    """A request that computes ``tokens`` in one step into ``blocks``; its chunks go to kvd."""
    req = Request(req_id, tokens)
    assert e.sched.matched(req, 0) == (0, False)
    e.sched.allocated(req, Blocks(blocks), 0)
    fill(e, blocks, seed=len(tokens))
    plan, *_ = e.run_step(step_output(new=[(req_id, blocks, 0)], scheduled={req_id: len(tokens)}))
    assert [len(s.keys) for s in plan.stores] == [len(tokens) // CHUNK]
    assert e.sched.finished(req, blocks) is True  # blocks wait for the store
    for _ in range(500):
        _, sending, _, _ = e.run_step(step_output(), finished=[req_id])
        if sending:
            return req
        time.sleep(0.01)
    raise AssertionError("the store was never reported done")


def frozen(daemon):
    """The daemon stops answering (SIGSTOP) until the block ends: loads miss their deadline."""
    class Frozen:
        def __enter__(self):
            os.kill(daemon.proc.pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            os.kill(daemon.proc.pid, signal.SIGCONT)
    return Frozen()
