"""Scoring text pairs (vLLM's /score and LLM.score): which pairs, and a bi-encoder's score.

    text_1 "q",        text_2 ["a", "b"]   ->  (q, a), (q, b)      one against many
    text_1 ["q", "r"], text_2 ["a", "b"]   ->  (q, a), (r, b)      pair by pair

A cross-encoder reads each pair as one input (engine/model/pooling/inputs.py
`pair_input`); an embedding model scores a pair by the cosine similarity of
its two embeddings, as vLLM does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import ValidationError
from engine.outputs import PoolingOutput, PoolingRequestOutput


def score_pairs(text_1: str | list[str], text_2: str | list[str],
                params: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, or a ValidationError naming the field."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for texts, param in ((firsts, params[0]), (seconds, params[1])):
        if not texts:
            raise ValidationError(f"{param} is empty", param)
        if not all(isinstance(t, str) for t in texts):
            raise ValidationError(f"{param} must be a string or a list of strings", param)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValidationError(f"{params[0]} has {len(firsts)} texts and {params[1]} "
                              f"{len(seconds)}: give one {params[0]}, or as many as "
                              f"{params[1]}", params[1])
    return list(zip(firsts, seconds))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))


def cosine_output(first: PoolingRequestOutput, second: PoolingRequestOutput) -> PoolingRequestOutput:
    """A pair's score from its two embeddings' outputs (the token ids are both halves')."""
    score = torch.tensor([cosine(first.outputs.data, second.outputs.data)])
    return PoolingRequestOutput(f"{first.request_id}-{second.request_id}",
                                first.prompt_token_ids + second.prompt_token_ids,
                                PoolingOutput(score))
