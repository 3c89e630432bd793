"""The multi-turn workload: conversations whose next turn lands on another server.

``write(args)`` writes the JSONL file that ``vllm bench serve --dataset-name custom`` reads:
``--conversations`` conversations of ``--turns`` turns. A conversation opens with a first
message of its own (``--prefix-len`` tokens) and a question (``--suffix-len``); each later
turn's prompt is the turn before's, then that turn's answer (``--output-len`` tokens), then a
new question. The prompts go round by round (every conversation's first turn, then every
second turn, ...), so a conversation's next turn is sent a whole round after its last one,
and round robin over the servers gives it another server, since the number of
conversations is not a multiple of the servers (``check``).

The answers are fixed words, not the model's output: the load generator knows its prompts
before it sends them. So a turn reuses its whole predecessor's prompt (KV the fleet
computed or loaded once), while the predecessor's answer counts as new prompt tokens, in
every arm alike.

Words are ``w<id>`` of the word-level tokenizer (examples/fleet/model.py): one token each,
so a turn's tokens start with its predecessor's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FIRST_WORD = 3  # ids 0-2 are the tokenizer's special tokens


def check(args) -> str | None:
    """Why the settings cannot give each conversation's next turn another server, or None."""
    if args.turns < 2:
        return "--turns: at least 2 (a conversation of one turn has no next turn)"
    if args.conversations % args.servers == 0:
        return (f"--conversations {args.conversations} is a multiple of --servers {args.servers}: round "
                f"robin would send each conversation's every turn to one server (pick e.g. "
                f"{args.conversations + 1})")
    return None


def final_len(args) -> int:
    """Prompt tokens of a conversation's last turn."""
    return args.prefix_len + args.turns * args.suffix_len + (args.turns - 1) * args.output_len


def num_prompts(args) -> int:
    return args.conversations * args.turns


def new_tokens(args) -> int:
    """Prompt tokens no earlier turn held: every first turn, then each later turn's answer and
    question (what an arm that reloads all history still computes)."""
    later = args.conversations * (args.turns - 1)
    return args.conversations * (args.prefix_len + args.suffix_len) + later * (args.output_len + args.suffix_len)


def write(args, path: Path, vocab_size: int) -> Path:
    rng = random.Random(args.seed)

    def words(n: int) -> list[str]:
        return [f"w{rng.randrange(FIRST_WORD, vocab_size)}" for _ in range(n)]

    chats = [words(args.prefix_len) + words(args.suffix_len) for _ in range(args.conversations)]
    with open(path, "w") as f:
        for turn in range(args.turns):
            for c, chat in enumerate(chats):
                if turn:
                    chat += words(args.output_len) + words(args.suffix_len)
                f.write(json.dumps({"prompt": " ".join(chat), "conversation": c, "turn": turn}) + "\n")
    return path
