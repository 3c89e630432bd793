"""The transformer side of examples/prefix_reuse.py: model, KV pages, logits checks.

A Hugging Face ``LlamaForCausalLM`` of the Llama-3-8B shape (``TINY`` for tests) with random
weights from ``SEED``; its KV cache copied into and read back from a paged pool in vLLM's
flash-attn layout (one ``[2, num_blocks, page_size, kv_heads, head_dim]`` tensor per layer);
a suffix prefill over pooled pages with a per-layer hook (where a kvd load waits for its
layer); ``check_logits``, the bf16 comparison against a full prefill; ``corrupt_byte``.
Device-agnostic: torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import inspect

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=1000, rope_theta=500000.0)
SEED = 1234
CORRUPT_XOR = 0x40  # flips the top exponent bit of one bf16 value (its high byte)

def model_shape(args) -> dict:
    shape = dict(TINY if args.tiny else LLAMA3_8B)
    shape["num_hidden_layers"] = args.layers
    return shape


def build_model(shape: dict, device, seed: int = SEED):
    """LlamaForCausalLM with random weights from ``seed``, bf16, SDPA, on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=131072, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def weights_fingerprint(model) -> float:
    """A cheap checksum so both engines can confirm they built the same weights."""
    import torch
    with torch.no_grad():
        return float(sum(p.float().sum().item() * (i + 1) for i, p in enumerate(model.parameters())))


def _forward_kwargs(model, start: int, length: int, device) -> dict:
    """position_ids (and cache_position where this transformers version takes it)."""
    import torch
    takes = getattr(model, "_e2e_takes", None)
    if takes is None:  # inspected once per model, not inside the timed calls
        takes = model._e2e_takes = (
            "cache_position" in inspect.signature(model.model.forward).parameters,
            "logits_to_keep" if "logits_to_keep" in inspect.signature(model.forward).parameters
            else "num_logits_to_keep")
    pos = torch.arange(start, start + length, device=device)
    kw = {"position_ids": pos.unsqueeze(0), takes[1]: 1}
    if takes[0]:
        kw["cache_position"] = pos
    return kw


def layer_kv(cache, i: int):
    """K, V of layer i from a transformers cache ([1, kv_heads, seq, head_dim] each)."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def full_prefill(model, ids):
    """Prefill ``ids`` ([1, n]); returns (last-token logits [vocab] fp32, the cache)."""
    import torch
    with torch.no_grad():
        out = model(ids, use_cache=True, **_forward_kwargs(model, 0, ids.shape[1], ids.device))
    return out.logits[0, -1].float(), out.past_key_values


def cache_to_pool(cache, pool, pages, n: int) -> None:
    """Copy the first ``n`` tokens of every layer's K, V into ``pages`` of the paged pool."""
    page_size = pool[0].shape[2]
    for i, t in enumerate(pool):
        k, v = layer_kv(cache, i)
        for plane, x in enumerate((k, v)):
            x = x[0, :, :n].transpose(0, 1)  # [n, kv_heads, head_dim]
            t[plane, pages] = x.reshape(n // page_size, page_size, *x.shape[1:])


def pool_to_kv(t, pages, n: int):
    """One layer's K, V from ``pages`` as contiguous [1, kv_heads, n, head_dim] tensors."""
    out = []
    for plane in (0, 1):
        x = t[plane, pages].reshape(n, t.shape[3], t.shape[4])  # gather: [n, kv_heads, head_dim]
        out.append(x.transpose(0, 1).unsqueeze(0).contiguous())
    return out


def prefill_from_pool(model, pool, pages, hit: int, suffix_ids, before_layer=None):
    """Suffix-only prefill on top of the ``hit`` prefix tokens held in ``pages``.

    The cache is built lazily: a forward pre-hook on decoder layer i calls
    ``before_layer(i)`` (kvd: ``wait_for_layer``), gathers layer i's KV from
    the pool and appends it to the cache, so layer i's gather is queued after
    layer i-1's compute. Layer 0 is filled before the forward, because the
    attention mask's size is taken from layer 0's cache length.
    Returns the last-token logits [vocab] in fp32."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    wait = before_layer or (lambda i: None)

    def fill(i):
        wait(i)
        k, v = pool_to_kv(pool[i], pages, hit)
        cache.update(k, v, i)

    def hook(i):
        return lambda module, args: fill(i)

    fill(0)
    handles = [layer.register_forward_pre_hook(hook(i))
               for i, layer in enumerate(model.model.layers) if i > 0]
    try:
        with torch.no_grad():
            out = model(suffix_ids, past_key_values=cache, use_cache=True,
                        **_forward_kwargs(model, hit, suffix_ids.shape[1], suffix_ids.device))
    finally:
        for h in handles:
            h.remove()
    return out.logits[0, -1].float()


def corrupt_byte(pool, page: int, row: int) -> None:
    """Flip bits of one byte: layer 0, K plane, token ``row`` of ``page``, head 0, the high
    byte of element 0 (bf16 is little-endian: byte 1 holds the sign and top exponent bits)."""
    import torch
    pool[0][0, page, row, 0, 0:1].view(torch.uint8)[1:2].bitwise_xor_(CORRUPT_XOR)


def check_logits(got, ref, rtol: float) -> dict:
    """Pass if max|got-ref| <= rtol * max|ref| and the argmax agrees (or, where it
    differs, the reference's top two are within that same tolerance: a tie)."""
    import torch
    diff = (got - ref).abs()
    finite = bool(torch.isfinite(got).all())
    max_abs = float(diff.max()) if finite else float("inf")
    scale = float(ref.abs().max())
    rel = max_abs / scale if scale else max_abs
    a_got, a_ref = int(got.argmax()), int(ref.argmax())
    tie = a_got != a_ref and float(ref[a_ref] - ref[a_got]) <= rtol * scale
    ok = finite and rel <= rtol and (a_got == a_ref or tie)
    return {"max_abs": max_abs, "rel": rel, "argmax": a_got, "argmax_ref": a_ref,
            "argmax_same": a_got == a_ref, "argmax_tie": tie, "ok": ok}
