"""The request sets of `pagedserve bench serve`.

    random             token-id prompts of random lengths (exact input lengths)
    prefix-repetition  a few shared prefixes, each followed by a unique suffix
                       (the prefix-caching workload)
    sharegpt           conversations from a ShareGPT-format JSON file
    grounded           chats whose answers copy their prompt: rewrite, fix the
                       typos, quote, edit code (bench/serving/grounded.py; the
                       speculative-decoding workload)
    open-chat          open questions, whose answers repeat little

The chat sets go to /v1/chat/completions and stop at EOS (or
--chat-max-tokens); their input_len is a word-count estimate.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.serving.grounded import grounded_chats, open_chats


@dataclass
class Request:
    prompt: str | list[int]
    input_len: int
    output_len: int
    # A chat request (sent to /v1/chat/completions) instead of a completion prompt.
    messages: list[dict] | None = None
    # Exact output lengths; a workload of real text lets the model stop at EOS.
    ignore_eos: bool = True


# -- datasets --------------------------------------------------------------------------
def random_dataset(args, rng: random.Random, vocab: int) -> list[Request]:
    def length(mean: int) -> int:
        low = max(1, int(mean * (1 - args.random_range_ratio)))
        high = max(low, int(mean * (1 + args.random_range_ratio)))
        return rng.randint(low, high)

    requests = []
    for _ in range(args.num_prompts):
        n_in = length(args.random_input_len)
        # Token ids away from the special tokens at the start of most vocabularies.
        prompt = [rng.randrange(1000, vocab) for _ in range(n_in)]
        requests.append(Request(prompt, n_in, length(args.random_output_len)))
    return requests


def prefix_repetition_dataset(args, rng: random.Random, vocab: int) -> list[Request]:
    prefixes = [
        [rng.randrange(1000, vocab) for _ in range(args.prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    requests = []
    for i in range(args.num_prompts):
        suffix = [rng.randrange(1000, vocab) for _ in range(args.suffix_len)]
        prompt = prefixes[i % args.num_prefixes] + suffix
        requests.append(Request(prompt, len(prompt), args.output_len))
    rng.shuffle(requests)
    return requests


def sharegpt_dataset(args, rng: random.Random, vocab: int) -> list[Request]:
    """First human turn as the prompt; the first reply's length (in words) bounds the output."""
    data = json.loads(Path(args.dataset_path).read_text())
    requests = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        output_len = max(4, min(args.sharegpt_max_output, int(len(reply.split()) * 1.3)))
        requests.append(Request(prompt, int(len(prompt.split()) * 1.3), output_len))
    rng.shuffle(requests)
    return requests[: args.num_prompts]


def grounded_dataset(args, rng: random.Random, vocab: int) -> list[Request]:
    """Chats whose answers copy their prompt (bench/serving/grounded.py): rewrite, fix the
    typos, quote the passage, edit the code."""
    return _chats(grounded_chats(), args, rng)


def open_chat_dataset(args, rng: random.Random, vocab: int) -> list[Request]:
    """Open questions whose answers repeat little of their prompt."""
    return _chats(open_chats(), args, rng)


def _chats(conversations: list[list[dict]], args, rng: random.Random) -> list[Request]:
    rng.shuffle(conversations)
    picked = [conversations[i % len(conversations)] for i in range(args.num_prompts)]
    return [Request("", sum(len(m["content"].split()) for m in chat) * 4 // 3,
                    args.chat_max_tokens, messages=chat, ignore_eos=False) for chat in picked]


DATASETS = {
    "random": random_dataset,
    "prefix-repetition": prefix_repetition_dataset,
    "sharegpt": sharegpt_dataset,
    "grounded": grounded_dataset,
    "open-chat": open_chat_dataset,
}
