"""Token accounting shared by every response shape."""

from __future__ import annotations

from service.protocol.replies import PromptTokensDetails, Usage
from service.serving.admitted import Admission


def usage(admission: Admission) -> Usage:
    """Usage over an admitted request's prompts (a batch of completion prompts
    has several), once its outputs were read, streamed or collected.

    Completion tokens are the admission's running count: a streamed output holds
    only its new tokens, so no output has them all.
    """
    outputs = admission.latest
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = admission.num_completion_tokens
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))
