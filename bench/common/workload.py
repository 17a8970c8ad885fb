"""The one workload type of the offline benchmarks: token-id prompts and how
many tokens each request generates (greedy, ignore_eos, so exactly that many).

    random_workload("chat", 256, (16, 256), (16, 512), vocab_size, seed=0)
    shared_prefix_workload("shared", 32, num_system=2, system_len=512,
                           question_range=(32, 32), output_len=16, vocab_size=..., seed=0)

Random token ids start at FIRST_TOKEN: the ids below are the special tokens of
most vocabularies, and an EOS or a chat marker in a prompt would change what
the benchmark measures.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

FIRST_TOKEN = 100


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]  # tokens each request generates
    params: dict = field(default_factory=dict)  # how it was made: lengths, seed, ...

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens fed to decode steps: every output token but the last (one per
        step; the first comes out of the prefill)."""
        return sum(n - 1 for n in self.output_lens)

    @property
    def max_total_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)]


def random_workload(name: str, num_requests: int, input_range: tuple[int, int],
                    output_range: tuple[int, int], vocab_size: int, seed: int) -> Workload:
    """Prompt and output lengths uniform in their ranges (inclusive)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        prompts.append(random_tokens(rng, rng.randint(*input_range), vocab_size))
        outputs.append(rng.randint(*output_range))
    params = {"input_len": list(input_range), "output_len": list(output_range), "seed": seed}
    return Workload(name, prompts, outputs, params)


def shared_prefix_workload(name: str, num_requests: int, num_system: int, system_len: int,
                           question_range: tuple[int, int], output_len: int, vocab_size: int,
                           seed: int, assign: str = "round-robin") -> Workload:
    """K system prompts; each request one of them (round-robin or random), then
    its own question."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_len, vocab_size) for _ in range(num_system)]
    prompts = []
    for i in range(num_requests):
        system = systems[i % num_system] if assign == "round-robin" else rng.choice(systems)
        prompts.append(system + random_tokens(rng, rng.randint(*question_range), vocab_size))
    params = {"num_system_prompts": num_system, "system_len": system_len,
              "question_len": list(question_range), "assign": assign, "seed": seed}
    return Workload(name, prompts, [output_len] * num_requests, params)


# -- command-line values shared by the benchmarks ------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LOW:HIGH") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LOW:HIGH, 0 < LOW <= HIGH")
    return low, high


def parse_ints(text: str) -> list[int]:
    """Positive integers, comma-separated."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return values
