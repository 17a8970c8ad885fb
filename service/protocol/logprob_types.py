"""vLLM's `prompt_logprobs` on the wire: what service/protocol/replies.py's answers carry."""

from __future__ import annotations

from msgspec import Struct


class PromptLogprob(Struct):
    """vLLM's Logprob: `prompt_logprobs[i]` is {token id: this} for prompt position i."""

    logprob: float
    rank: int
    decoded_token: str


# None for the first prompt token (nothing scores it), then one map per position.
PromptLogprobs = list[dict[str, PromptLogprob] | None]
