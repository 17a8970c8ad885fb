"""Verifying drafts: keep the drafted tokens the model would have drawn itself.

A sequence with a draft d1..dK is scored in one forward pass at K + 1
positions: its last real token and each drafted token. Position j's logits
are the model's distribution for the token after d1..dj. Verification then
samples position by position, with the ordinary sampler, exactly as plain
decoding would:

    round 0   sample t0 from position 0                 t0 == d1 ?  yes: go on
    round 1   sample t1 from position 1 (after d1)      t1 == d2 ?  no: stop
    emitted:  d1 (== t0), t1                          (t1 replaces d2: a correction)

Every emitted token is a draw from the target distribution, so the output is
distributed as without speculation, at any temperature. This is rejection
sampling for a draft that puts all its mass on one token (an n-gram or suffix
proposal): the draft d is accepted with probability p(d), and on rejection
the token comes from the residual p restricted to tokens other than d, which
is what a draw from p that came out different from d is. It also keeps
seeded requests reproducible: a seeded row draws one noise vector from its
generator per emitted token, the same draws in the same order as without
speculation, so a seeded request gives the same tokens with or without it.

Each round sees the sequence as if the earlier rounds' tokens were already
decoded: penalties count them, min_tokens counts them, and a structured-output
matcher is advanced by each accepted token and rolled back afterwards (the
stop checker advances it for real when the engine appends the tokens). A
round stops a sequence at a token that may end it (EOS, a stop token): what
follows would be thrown away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.sampling.sampler import Sampler, SamplerOutput, SamplingRequest
from engine.sampling.stopping import banned_token_ids


@dataclass
class Drafted:
    """One sampled sequence of the step: its request and its draft."""

    request: SamplingRequest  # as for plain decoding, at the first position
    draft: list[int]
    first_row: int  # the logits row of its first position; the others follow
    eos_token_ids: frozenset[int]


def verify(sampler: Sampler, logits: torch.Tensor,
           drafted: Sequence[Drafted]) -> tuple[list[int], SamplerOutput]:
    """Sample each sequence's positions in rounds; returns (index into `drafted`
    of every emitted token, in order, and the tokens with their logprobs):
    a sequence's accepted draft tokens, then the token that ended its draft."""
    owners: list[int] = []
    output = SamplerOutput([], [], [])
    alive = list(range(len(drafted)))
    accepted: list[list[int]] = [[] for _ in drafted]
    try:
        for position in range(max(len(d.draft) for d in drafted) + 1):
            requests = [_request_at(drafted[i], accepted[i]) for i in alive]
            rows = torch.tensor([drafted[i].first_row + position for i in alive],
                                device=logits.device)
            sampled = sampler(logits.index_select(0, rows), requests)
            alive = _emit(drafted, alive, position, sampled, owners, output, accepted)
            if not alive:
                break
    finally:
        for item, tokens in zip(drafted, accepted):
            if item.request.grammar is not None and tokens:
                item.request.grammar.rollback(len(tokens))
    return owners, output


def _emit(drafted, alive, position, sampled, owners, output, accepted) -> list[int]:
    """Record this round's tokens; return the sequences whose draft goes on."""
    still = []
    for row, i in enumerate(alive):
        token = sampled.token_ids[row]
        owners.append(i)
        output.token_ids.append(token)
        output.logprobs.append(sampled.logprobs[row])
        output.top_logprobs.append(sampled.top_logprobs[row])
        item = drafted[i]
        if position < len(item.draft) and token == item.draft[position] \
                and not _may_stop(item, token):
            accepted[i].append(token)
            if item.request.grammar is not None:
                item.request.grammar.accept(token)
            still.append(i)
    return still


def _request_at(item: Drafted, accepted: list[int]) -> SamplingRequest:
    """The request as it would look once `accepted` were decoded."""
    if not accepted:
        return item.request
    request = item.request
    outputs = [*request.output_token_ids, *accepted]
    banned = banned_token_ids(request.params, len(outputs), item.eos_token_ids)
    return replace(request, output_token_ids=outputs, banned_token_ids=banned)


def _may_stop(item: Drafted, token: int) -> bool:
    """A token after which the sequence may end: the rest of a draft is moot."""
    params = item.request.params
    return (token in item.eos_token_ids and not params.ignore_eos) \
        or token in params.stop_token_ids
