"""Token accounting shared by every response shape."""

from __future__ import annotations

from engine.outputs import RequestOutput
from service.protocol import PromptTokensDetails, Usage


def usage(*outputs: RequestOutput) -> Usage:
    """Usage over one request, or several (a batch of completion prompts)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))
