r"""A Sequence: one stream of tokens that the engine generates, and its progress.

The one number that drives scheduling is `num_computed_tokens`: how many of
the sequence's tokens already have their K/V in the cache. Each step the
scheduler lets a sequence catch up toward `num_tokens`:

    tokens:    p0 p1 p2 p3 p4 p5 p6 p7 | o0 o1
               |<-- computed -->|         ^ prompt ends here
                                 \__ this step computes p5..p7 (a chunk)

    prefill        computed < num_prompt_tokens, maybe in several chunks
    decode         computed == num_tokens - 1: one new token per step
    preempted      computed reset to 0: recompute everything on resume
    prefix hit     computed starts at the cached length

When a step's chunk reaches the last known token, the model's logits for it
are sampled and the new token appended.

Async scheduling (engine/frontend/async_step.py) schedules the next step before
a sampled token reaches the host: until then the sequence counts a
*placeholder* past its outputs (`num_placeholders`), in `num_tokens` (what
the scheduler reads) but not in `output_token_ids` (what is reported). Its
id in `token_slice` is PLACEHOLDER; the runner takes the real one on the device.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.core.block_hash import ROOT_HASH, block_extra, hash_block
from engine.core.sched_output import PLACEHOLDER
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    # Its place in the request's structured-output constraint, if it has one
    # (engine/sampling/structured_outputs.py: a GrammarMatcher of its own).
    grammar: object | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's meaning)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_token_time: float | None = None
    # Prefix caching: hashes of this sequence's full blocks, and what goes into them.
    block_hashes: list[bytes] = field(default_factory=list)
    hash_extra: bytes = b""  # model fingerprint
    cache_salt: bytes = b""  # per tenant, first block only
    # The LoRA adapter it runs under (0: the base model) and what that adds
    # to its first block's hash: one prompt under two adapters shares no block.
    lora_id: int = 0
    lora_key: bytes = b""
    # n > 1: the sample that computes the shared prompt (None for the first sample).
    fork_parent: Sequence | None = None
    # Speculative decoding: tokens guessed to follow, set before each step by
    # engine/spec_decode/; the scheduler gives them query slots after the last token.
    draft_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: sampled tokens still on the device, counted after the outputs.
    num_placeholders: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host holds: num_tokens without the placeholders."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating both lists;
        PLACEHOLDER for positions past the known tokens."""
        known = self.num_known_tokens
        if end > known:
            return self.token_slice(min(start, known), known) + [PLACEHOLDER] * (end - max(start, known))
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)

    def drop_last_outputs(self, count: int) -> None:
        """Forget the last `count` output tokens: those a step accepted after a
        token that stopped the sequence (the sequence finishes right away)."""
        if count:
            del self.output_token_ids[-count:]

    def update_block_hashes(self, block_size: int) -> None:
        """Hash the full blocks that have appeared since the last call."""
        hashes = self.block_hashes
        while (len(hashes) + 1) * block_size <= self.num_known_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            tokens = self.token_slice(i * block_size, (i + 1) * block_size)
            extra = block_extra(i, self.hash_extra, self.cache_salt + self.lora_key)
            hashes.append(hash_block(parent, tokens, extra))

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.num_placeholders = 0  # a token still in flight for it is dropped
        self.finish_reason = reason
        self.stop_reason = stop_reason
