"""The sampler's batch of one step: which rows of the flat batch are sampled.

    ordered:  seq A decode      seq B prefill chunk      seq C decode + draft d1 d2
    tokens:   [ a9 |            b0 b1 b2 b3 |           c4 d1 d2 ]
    rows:     [ 0,                          4,          5, 6, 7 ]
    requests: [ A,                          B,          C ]   one per sequence

A sequence samples when its chunk reaches its last known token. With a
draft (speculative decoding) its rows are the last real token and each
drafted token, verified in order by engine/sampling/speculative.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sched_output import ScheduledSequence
from engine.sampling.sampler import SamplingRequest
from engine.sampling.speculative import Drafted
from engine.sampling.stopping import banned_token_ids


@dataclass
class SamplingBatch:
    # The flat batch rows whose logits are computed: each sampled sequence's
    # last real token, then its drafted tokens if it has a draft.
    rows: list[int]
    seq_ids: list[int]
    requests: list[SamplingRequest]  # the sampler's input, one per sequence
    drafts: list[list[int]]  # per sequence; all empty without speculation

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    def drafted(self, eos_token_ids: frozenset[int]) -> list[Drafted]:
        """Verification's view (engine/sampling/speculative.py): each sequence's
        request and draft, and the logits row of its first position."""
        drafted, first_row = [], 0
        for request, draft in zip(self.requests, self.drafts):
            drafted.append(Drafted(request, draft, first_row, eos_token_ids))
            first_row += len(draft) + 1
        return drafted


def build_sampling_batch(
    ordered: list[ScheduledSequence], eos_token_ids: frozenset[int]
) -> SamplingBatch:
    """The sampler's input for a step whose tokens are flattened in `ordered`
    order: a request for every sequence that samples. Which tokens a row may not
    draw is stopping's decision (min_tokens); the sampler only masks them."""
    batch = SamplingBatch([], [], [], [])
    end = 0
    for s in ordered:
        end += s.num_new_tokens
        if s.sampling is None:
            continue
        num_drafted = len(s.draft_token_ids)
        batch.rows.extend(range(end - 1 - num_drafted, end))
        batch.drafts.append(s.draft_token_ids)
        batch.seq_ids.append(s.seq_id)
        banned = banned_token_ids(s.sampling, len(s.output_token_ids), eos_token_ids)
        batch.requests.append(SamplingRequest(
            params=s.sampling,
            generator=s.generator,
            prompt_token_ids=s.prompt_token_ids,
            output_token_ids=s.output_token_ids,
            banned_token_ids=banned,
            grammar=s.grammar,
        ))
    return batch
