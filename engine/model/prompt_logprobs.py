"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's
logprob given the tokens before it, with the top-k at its position.

The logits at position p score token p + 1, so a sequence that asks for them
gives a row for every position p of its chunk with p + 1 < its prompt length:

    prompt      t0 t1 t2 t3 t4 t5            chunk of this step: positions 2..4
    rows        p2 p3 p4  -> score t3 t4 t5  (p5 would score the first output token:
                                               that is sampling's row, not ours)

The rows ride in the step's sampled rows after the sampler's own
(engine/model/step_inputs.py's sample_rows), so a tensor-parallel step carries
them with no change to its encoding and rank 0 gathers their logits like any
other. The log-softmax is taken in float32 on the raw logits, vLLM's default
`raw` mode: before penalties, logit_bias, temperature or a constraint's mask.
Chunks add up across steps in the engine (engine/frontend/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sched_output import ScheduledSequence

# Rows log-softmaxed at a time: bounds the float32 copy of a long prefill's logits.
ROWS_AT_ONCE = 256


@dataclass
class PromptChunk:
    """One sequence's prompt logprobs from one step: rows for positions start, start + 1, ..."""

    start: int  # the position whose logits the first row holds (they score token start + 1)
    token_logprobs: list[float]  # the prompt token's logprob at each row
    ranks: list[int]  # its rank there (1 + the tokens strictly likelier)
    top_ids: list[list[int]]  # the top-k token ids at each row, likeliest first
    top_logprobs: list[list[float]]


@dataclass
class PromptRows:
    """The flat batch rows whose logits score a prompt token, for every sequence that asks."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # seq, start, rows, k

    def split(self, logits: torch.Tensor | None, num_sampled: int
              ) -> tuple[torch.Tensor | None, dict[int, PromptChunk]]:
        """(the sampler's logits, each sequence's PromptChunk) from the logits of
        the sampled rows followed by these."""
        if not self.rows:
            return logits, {}
        return logits[:num_sampled], self.compute(logits[num_sampled:])

    def compute(self, logits: torch.Tensor) -> dict[int, PromptChunk]:
        targets = torch.tensor(self.targets, device=logits.device)
        k = max(span[3] for span in self.spans)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for first in range(0, len(self.rows), ROWS_AT_ONCE):
            logprobs = torch.log_softmax(logits[first:first + ROWS_AT_ONCE].float(), dim=-1)
            picked = logprobs.gather(1, targets[first:first + ROWS_AT_ONCE, None])
            chosen.append(picked[:, 0])
            ranks.append((logprobs > picked).sum(dim=1) + 1)
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        chosen_list = torch.cat(chosen).tolist()
        ranks_list = torch.cat(ranks).tolist()
        values_list, ids_list = torch.cat(top_values).tolist(), torch.cat(top_ids).tolist()
        chunks, row = {}, 0
        for seq_id, start, count, seq_k in self.spans:
            end = row + count
            chunks[seq_id] = PromptChunk(
                start, chosen_list[row:end], ranks_list[row:end],
                [ids[:seq_k] for ids in ids_list[row:end]],
                [values[:seq_k] for values in values_list[row:end]])
            row = end
        return chunks


def prompt_logprob_rows(ordered: list[ScheduledSequence]) -> PromptRows:
    """The rows of a step whose tokens are flattened in `ordered` order."""
    found = PromptRows()
    offset = 0
    for s in ordered:
        k = s.prompt_logprobs
        end = min(s.context_len, len(s.prompt_token_ids) - 1)  # the last position that scores
        if k is not None and s.start_position < end:
            count = end - s.start_position
            found.rows.extend(range(offset, offset + count))
            found.targets.extend(s.prompt_token_ids[s.start_position + 1:end + 1])
            found.spans.append((s.seq_id, s.start_position, count, k))
        offset += s.num_new_tokens
    return found
