"""A load that times out never lands later, on the GPU: real kernels, real DMA, a real daemon.

The engine (this process) loads 8 GiB (16 layers of 512 MiB) into poisoned
pages of its own and ends the load part-way: both copy paths, the SM
kernels (``gpu_copy_path = "kernels"``: staged pieces, each kernel reads the
load's cancel word as it starts) and the copy engines (``"dma"``: the
daemon's load thread reads the cancel word before each step it queues).

- Mid-copy: a layer-wise load times out once the daemon signalled layer
  ``K`` (the client's own deadline, set to now at that moment: the time-out
  path of the client, with no guessing at copy speeds). Layers ``0..K``
  landed; no page of a layer past ``K + SLACK`` was written (what was
  already running when the cancel word was written may finish: one layer,
  and one queued behind it); the load is fenced by its done word; half a
  second later not one page changed.
- Queued: a load queued behind an 8 GiB load on the same streams times out
  while that load still copies: none of its pages was written, though its
  kernels (or its DMA steps) were queued (the daemon's debug log has its
  copy), and it is fenced by its done word. The daemon then serves the next
  load bit-exact.

With a broken cancel word (a kernel that ignores it, a load thread that
does not check it) the later layers and the queued load's pages land, and
these tests fail. Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]
CHUNK, PAGE, HEADS, DIM, LAYERS = 64, 16, 16, 128, 16
PPC = CHUNK // PAGE
N = 4096                    # pages of one load: 1024 chunks, 512 MiB a layer, 8 GiB
SMALL = 16                  # chunks of the queued load
K = 3                       # the mid-copy load times out once layer K landed
SLACK = 2                   # layers past K that may still land (running, queued behind)
POISON = 0xA5
PATHS = {"kernels": ({"gpu_copy_path": "kernels"}, r"\d+ staged pieces"),
         "dma": ({"gpu_copy_path": "dma", "gpu_dma_load_window": "256MiB"}, "DMA")}


def page_states(kv, src: slice, dst: slice) -> np.ndarray:
    """[layer, page] of ``dst``: 1 holds ``src``'s bytes, 0 the poison, -1 anything else."""
    out = []
    for x in kv:
        a, b = x[:, dst].view(torch.uint8), x[:, src].view(torch.uint8)
        same = (a == b).all(dim=4).all(dim=3).all(dim=2).all(dim=0)
        poison = (a == POISON).all(dim=4).all(dim=3).all(dim=2).all(dim=0)
        state = torch.full_like(same, -1, dtype=torch.int8)
        state[poison], state[same] = 0, 1
        out.append(state.cpu().numpy())
    return np.stack(out)


def poison(kv, pages: slice) -> None:
    for x in kv:
        x[:, pages].view(torch.uint8).fill_(POISON)
    torch.cuda.synchronize()  # an idle stream: the loads need no mark


def time_out_now(client, t) -> None:
    """The load's deadline passes now: the client's housekeeping fails it with Timeout,
    writes its cancel word and releases its waits (what it does at any deadline)."""
    t.deadline = time.monotonic() - 1.0
    client.progress(None, 0.0)
    assert t.status == "failed" and isinstance(t.error, kvd_client.Timeout), t


@pytest.mark.parametrize("path", sorted(PATHS))
def test_timed_out_load_never_lands_later(start_daemon, path):
    knobs, how = PATHS[path]
    d = start_daemon(chunk_tokens=CHUNK, host_capacity="9GiB", gpu="on", warm_restart="false",
                     log_level="debug", **knobs)
    kv = [torch.randint(0, 256, (2, 2 * N + SMALL * PPC, PAGE, HEADS, DIM * 2), dtype=torch.uint8,
                        device="cuda").view(torch.bfloat16) for _ in range(LAYERS)]
    src, dst, small = slice(0, N), slice(N, 2 * N), slice(2 * N, 2 * N + SMALL * PPC)
    head = slice(0, SMALL * PPC)  # the pages of the first SMALL chunks in src
    tokens = np.arange(N // PPC * CHUNK)
    # fence_quiet_s: a failed load is fenced by the daemon's done word, never by the clock
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=60,
                                  fence_quiet_s=60).connect()
    try:
        reg = client.register_kv(CudaKVPool("vllm_flash_attn", kv), model="cancel-gpu")
        torch.cuda.synchronize()
        assert client.store(tokens, range(src.start, src.stop)) == len(tokens)

        # 1. mid-copy: layer-wise, timed out once layer K landed
        poison(kv, dst)
        t = client.submit_load(tokens, range(dst.start, dst.stop), layerwise=True)
        deadline = time.monotonic() + 30
        while not reg.flags.layer_landed(t.slot, K, t.seq):
            assert time.monotonic() < deadline and not t.done, f"layer {K} never landed: {t}"
        time_out_now(client, t)
        assert t.wait(30).done and reg.flags.done(t.slot, t.seq), t
        state = page_states(kv, src, dst)
        landed = [int((s == 1).sum()) for s in state]
        print(f"{path}: pages landed per layer after a time-out at layer {K}: {landed}")
        assert (state[:K + 1] == 1).all(), f"layers 0..{K} did not all land: {landed}"
        # a kernel starting as the cancel word was written may skip in some blocks only:
        # the layers in flight may hold a mix; every layer after them is untouched
        assert (state[K + 1 + SLACK:] == 0).all(), f"layers landed after the cancel: {landed}"
        time.sleep(0.5)
        assert np.array_equal(page_states(kv, src, dst), state), "pages changed after the fence"

        # 2. queued behind an 8 GiB load on the same streams, timed out before it ran
        poison(kv, dst)
        poison(kv, small)
        big = client.submit_load(tokens, range(dst.start, dst.stop))
        late = client.submit_load(tokens[:SMALL * CHUNK], range(small.start, small.stop))
        deadline = time.monotonic() + 10
        while d.stats()["copies_queued"] < 2:  # both in the daemon's copy queue
            assert time.monotonic() < deadline and not big.done, (big, late)
        time_out_now(client, late)
        assert not big.done, "the big load ended before the queued one was cancelled"
        assert late.wait(30).done and reg.flags.done(late.slot, late.seq), late
        assert big.wait(30).ok and big.tokens == len(tokens), big
        assert (page_states(kv, head, small) == 0).all(), "a cancelled queued load wrote pages"
        assert (page_states(kv, src, dst) == 1).all(), "the big load is not bit-exact"
        queued = re.findall(rf"scatter of {SMALL} chunks, [\d.]+ MB, {how}:", d.log())
        assert queued, f"the cancelled load was never queued on the GPU:\n{d.log()[-4000:]}"

        # 3. the daemon serves the next load, bit-exact
        assert client.load(tokens[:SMALL * CHUNK], range(small.start, small.stop)) == SMALL * CHUNK
        torch.cuda.synchronize()
        assert (page_states(kv, head, small) == 1).all()
    finally:
        client.close()
    assert d.stop() == 0, d.log()[-4000:]
