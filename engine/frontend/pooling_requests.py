"""Pooling requests inside LLMEngine: how one enters, and how its answer leaves.

A pooling request (PoolingParams) is a prompt whose answer is a vector. It
runs through the engine as a request of `max_tokens=0` (its prompt is all it
computes: engine/frontend/prompt_logprobs.py ends it once the prompt is in)
whose step hands back a pooled row instead of sampling (ModelRunnerOutput.pooled).
`take_pooled` turns that row into the request's answer as its params ask
(engine/model/pooling/pooler.py `finish`); `pooling_output` reports it.

An engine runs one kind: a generate engine refuses PoolingParams and a pooling
engine (EngineConfig.runner="pooling") refuses SamplingParams, naming the
field, so the service can answer 400.
"""

from __future__ import annotations

import torch

from engine.errors import ValidationError
from engine.model.pooling import pooler
from engine.model.pooling.params import PoolingParams
from engine.model.pooling.pooler import PoolingInfo
from engine.model.pooling.token_types import carry
from engine.outputs import PoolingOutput, PoolingRequestOutput, RequestOutputKind
from engine.sampling_params import SamplingParams

# What a pooling request runs as: its prompt, then nothing; one output at the end.
PROMPT_ONLY = SamplingParams(max_tokens=0, output_kind=RequestOutputKind.FINAL_ONLY)


def check_request_kind(info: PoolingInfo | None, params) -> None:
    """Refuse params of the kind this engine does not run, and pooling params it cannot honour."""
    if isinstance(params, PoolingParams):
        if info is None:
            raise ValidationError("this engine runs a generative model: pooling requests "
                                  "(embeddings, scores) need a pooling model (--runner pooling)",
                                  "model")
        pooler.check_params(params, info)
    elif info is not None:
        raise ValidationError("this engine runs a pooling model (embeddings, classification, "
                              "scores): it does not generate text", "model")


def pooling_prompt(info: PoolingInfo | None, params, token_ids: list[int],
                   token_type_ids: list[int] | None) -> tuple[SamplingParams, list[int]]:
    """(what the sequence runs with, the ids it carries: token types in their high bits)."""
    if token_type_ids is not None:
        if not isinstance(params, PoolingParams) or not info.token_types:
            raise ValidationError("token_type_ids are for a model that reads token types "
                                  "(BERT's pairs)", "token_type_ids")
        if len(token_type_ids) != len(token_ids) or any(t not in (0, 1) for t in token_type_ids):
            raise ValidationError("token_type_ids must be 0 or 1, one per token",
                                  "token_type_ids")
    if not isinstance(params, PoolingParams):
        return params, token_ids
    return PROMPT_ONLY, carry(token_ids, token_type_ids)


def take_pooled(requests: dict, pooled: dict[int, torch.Tensor], info: PoolingInfo | None) -> None:
    """Give each request whose prompt the step computed its answer (before the
    step's settle_prompts ends it)."""
    if not pooled:
        return
    for request in requests.values():
        data = pooled.get(request.seqs[0].seq_id)
        if data is not None:
            request.pooled = pooler.finish(data, request.pooling, info)


def pooling_output(request) -> PoolingRequestOutput | None:
    """The request's one output, once it finished (None before)."""
    if not request.finished:
        return None
    data = request.pooled if request.pooled is not None else torch.empty(0)  # aborted: none
    return PoolingRequestOutput(request.request_id, request.prompt_token_ids,
                                PoolingOutput(data), True, request.seqs[0].num_cached_tokens)
