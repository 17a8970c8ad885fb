"""Completions' `echo` and vLLM's `prompt_logprobs`, on the wire.

`echo: true` puts the prompt before each choice's text: the prompt string as
sent, or a token-id prompt decoded. With `logprobs: k` the choice's logprobs
cover the prompt's tokens first, then the output's, as OpenAI and vLLM answer:

    tokens          [p0,   p1,            ..., o0, ...]
    token_logprobs  [null, lp(p1 | p0),   ..., lp(o0 | prompt), ...]
    top_logprobs    [null, {p1 and the top k}, ..., {the top k}, ...]
    text_offset     offsets in the echoed text: the prompt's, then the output's

Nothing scores the first prompt token, hence its nulls. The prompt positions'
top_logprobs hold the prompt token itself besides the top k (up to k + 1
entries, OpenAI's rule for a chosen token). `max_tokens: 0` (with echo only)
answers the prompt alone, which is how lm-evaluation-harness asks for a
loglikelihood. A stream sends the prompt in each choice's first chunk, as vLLM.

`prompt_logprobs: k` (both routes; not with stream) returns vLLM's list: null,
then per position {token id: {logprob, rank, decoded_token}} for the prompt
token and the top k; on each choice in completions, top-level in chat, where
vLLM puts them. The engine computes them in the prefill (a request asking for
them recomputes its prompt instead of taking prefix-cache hits).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import Logprob, PromptLogprobs, RequestOutput
from service.protocol.logprob_types import PromptLogprob
from service.protocol.replies import CompletionLogprobs
from service.serving.logprobs import _text
from service.serving.token_bytes import TextOffsets

# JSON has no -inf: vLLM's floor for a logprob on the wire.
FLOOR = -9999.0


@dataclass(frozen=True)
class Echo:
    """The prompt part of a choice's answer."""

    text: str
    token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None


def prompt_texts(prompt) -> list[str | None]:
    """The text of each prompt of a completions request as sent (None: token ids),
    in the order service/serving/completions.py normalises them."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [None] * len(prompt)
    return [None]


def echo_of(tokenizer, skip_special_tokens: bool, output: RequestOutput,
            text: str | None) -> Echo:
    if text is None:
        text = tokenizer.decode(output.prompt_token_ids, skip_special_tokens=skip_special_tokens)
    return Echo(text, output.prompt_token_ids, output.prompt_logprobs)


def echo_logprobs(tokenizer, echo: Echo, k: int, offsets: TextOffsets) -> CompletionLogprobs:
    """The legacy logprobs of the echoed prompt; `offsets` moves past it."""
    ids = echo.token_ids
    entries = echo.prompt_logprobs or [None] * len(ids)
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token_id, entry in zip(ids, entries):
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(entry[token_id].logprob, FLOOR))
        top: dict[str, float] = {}
        for top_id, logprob in entry.items():  # the prompt token first, then by rank
            if top_id == token_id or logprob.rank <= k:
                top.setdefault(_text(tokenizer, top_id), max(logprob.logprob, FLOOR))
        top_logprobs.append(top)
    return CompletionLogprobs([_text(tokenizer, t) for t in ids], token_logprobs,
                              top_logprobs, offsets.advance(ids))


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + then.tokens,
                              first.token_logprobs + then.token_logprobs,
                              first.top_logprobs + then.top_logprobs,
                              first.text_offset + then.text_offset)


def wire_prompt_logprobs(tokenizer, entries: PromptLogprobs | None
                         ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: token ids as JSON keys, each with its logprob, rank
    and text."""
    if entries is None:
        return None
    return [None if entry is None else {str(t): _wire(tokenizer, t, lp) for t, lp in entry.items()}
            for entry in entries]


def _wire(tokenizer, token_id: int, logprob: Logprob) -> PromptLogprob:
    return PromptLogprob(max(logprob.logprob, FLOOR), logprob.rank, _text(tokenizer, token_id))
