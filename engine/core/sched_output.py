"""What one step runs: the scheduler's decision as plain data.

`SchedulerOutput` is the only thing the model runner sees of the scheduler, so
this file is a leaf: model/ imports it, and nothing here imports model/ or the
scheduler. Each `ScheduledSequence` names the tokens whose K/V the step
computes and the block table that covers them; a sequence whose chunk reaches
its last known token also carries what sampling reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams

# An input id not on the host yet: the token the step in flight samples for the
# sequence (async scheduling, engine/frontend/async_step.py); the runner takes
# it from that step's tokens on the device. Never an id the model reads.
PLACEHOLDER = -1


@dataclass
class ScheduledSequence:
    seq_id: int
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_position: int  # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]  # covers start_position + len(token_ids) tokens
    # The request's settings when this step samples the sequence (its chunk
    # reaches the last known token), None otherwise.
    sampling: SamplingParams | None
    # What sampling reads, owned by the sequence (the runner only reads them):
    # the generator of a seeded request, and the tokens for penalties and min_tokens.
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: object | None = None  # the sequence's structured-output matcher
    # The sliding layers' own block table, in a model that mixes sliding and
    # global layers (engine/core/hybrid_blocks.py); None: every layer reads block_table.
    window_block_table: list[int] | None = None
    # SamplingParams.prompt_logprobs of a sequence that asks for them: the runner
    # scores the prompt tokens its chunk reaches (engine/model/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # Speculative decoding: the last len(draft_token_ids) of token_ids are guessed
    # tokens; the runner samples at the last real token and at each of them and
    # keeps the guesses the model agrees with (engine/sampling/speculative.py).
    draft_token_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter its rows run under (0: the base model)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # (source, destination) block pairs whose K/V the runner copies before the forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The same for the sliding layers' pool of a hybrid model (window_block_table).
    window_blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
