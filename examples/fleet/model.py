"""A Llama-shaped checkpoint of random N(0, 0.02) weights and a word-level tokenizer, offline.

``write(path, shape, layers, max_len)`` writes ``config.json``,
``model.safetensors`` and a ``tokenizers`` word-level tokenizer of the
model's vocabulary (``w0 ... w{V-1}``, split on spaces, wrapped in
``PreTrainedTokenizerFast``) into ``path``, so ``vllm serve`` and ``vllm bench
serve`` run unchanged with no download. Random weights, unlike vLLM's dummy
ones, make the greedy output depend on the prompt. A directory written before
with the same config is reused.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}
TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 1024, "rope_theta": 10000.0}
SPARE_TOKENS = 64  # of context beyond the longest prompt and its output


def context_len(prompt_tokens: int, output_len: int, vocab_size: int) -> int:
    """The ``--max-model-len`` that serves prompts of up to ``prompt_tokens`` words.

    vLLM refuses a text prompt of more characters than its input tokens (the context less the
    request's output) times its tokenizer's longest token. A word here is up to that long plus the
    space after it, so a prompt of n words can exceed n tokens' worth of characters: with the
    Llama vocabulary (``w128255``: 7 characters) about 7.1 characters per word on average.
    """
    longest_word = len(f"w{vocab_size - 1}")
    chars = prompt_tokens * (longest_word + 1)
    return -(-chars // longest_word) + output_len + SPARE_TOKENS


def config(shape: dict, layers: int, max_len: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
            "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0, **shape}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def write(path: Path, shape: dict, layers: int, max_len: int, seed: int = 0, std: float = 0.02) -> Path:
    """The checkpoint; ``std`` 0.08 for the tiny model, whose logits would be nearly level at 0.02
    (greedy answers then flip with float noise)."""
    cfg = {**config(shape, layers, max_len), "initializer_range": std}
    done = path / "config.json"
    if done.exists() and json.loads(done.read_text()) == cfg and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_weights(path / "model.safetensors", cfg, seed, std)
    write_tokenizer(path, cfg["vocab_size"])
    done.write_text(json.dumps(cfg, indent=1))  # last: its presence says the rest is complete
    return path


def write_weights(file: Path, cfg: dict, seed: int, std: float) -> None:
    """N(0, std) matrices and unit norms in bf16, drawn on the GPU where there is one (a
    32-layer Llama-3-8B is 16 GB: seconds there, minutes on a CPU)."""
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes(cfg).items()):
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
            tensors[name] = x.to(torch.bfloat16).cpu()
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """Word ``w<i>`` is token ``i``: any token list decodes to words that encode back to it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    # special tokens match whole words only: "w1" must not split "w1023"
    word = {name: AddedToken(f"w{i}", single_word=True, special=True)
            for name, i in (("unk_token", 0), ("pad_token", 0), ("bos_token", 1), ("eos_token", 2))}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20, **word)
    fast.save_pretrained(str(path))


if __name__ == "__main__":  # python model.py DIR tiny|llama3-8b LAYERS MAX_LEN (a child: no CUDA kept)
    import sys

    tiny = sys.argv[2] == "tiny"
    write(Path(sys.argv[1]), TINY if tiny else LLAMA3_8B, int(sys.argv[3]), int(sys.argv[4]),
          std=0.08 if tiny else 0.02)
