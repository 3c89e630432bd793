"""A tiny Llama checkpoint for vLLM, written with numpy: config.json and seeded random weights.

``DEEPSEEK`` is the same for a DeepSeek-V2-shaped model (MLA attention,
latent 512 + rope 64 as in DeepSeek-V2-Lite, dense MLPs only: the MoE
layers begin at ``first_k_dense_replace`` = the layer count).

2 layers, hidden 128, 4 query heads and 2 KV heads of 32, vocabulary 1024,
bf16. The weights are random but real (matrices ~ N(0, 0.08), norms 1), so
logits have margins and greedy outputs depend on every KV byte, unlike
vLLM's dummy weights (all ~1e-3: flat logits). ``model.safetensors`` is
written by hand (an 8-byte header length, a JSON header, the raw tensors),
so the test needs neither torch nor transformers to make it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
          "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "first_k_dense_replace": 4,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "moe_intermediate_size": 256, "hidden_act": "silu", "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    if cfg["model_type"] == "deepseek_v2":
        return _deepseek_shapes(cfg)
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


def _deepseek_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    lat, rope, nope, vd = (cfg[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                            "v_head_dim"))
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "self_attn.q_proj.weight": (n * (nope + rope), h),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (lat + rope, h),
                    p + "self_attn.kv_a_layernorm.weight": (lat,),
                    p + "self_attn.kv_b_proj.weight": (n * (nope + vd), lat),
                    p + "self_attn.o_proj.weight": (h, n * vd),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def bf16(x: np.ndarray) -> bytes:
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype("<u2").tobytes()


def write(path: Path, seed: int = 0, config: dict | None = None, std: float = 0.08,
          shapes=shapes, constants: dict | None = None) -> Path:
    """The checkpoint in ``path``: ``CONFIG`` (or ``config``), weights ~ N(0, ``std``); 1-D
    weights are 1, or ``constants[suffix]`` for a name ending in that suffix."""
    config = config or CONFIG
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    header, blobs, offset = {}, [], 0
    for name, shape in sorted(shapes(config).items()):
        fill = next((v for k, v in (constants or {}).items() if name.endswith(k)), 1.0)
        x = np.full(shape, fill) if len(shape) == 1 else rng.normal(0.0, std, shape)
        blob = bf16(x)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path
