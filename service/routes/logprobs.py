"""Logprobs in OpenAI's two shapes: chat (`content: [...]`) and legacy completions."""

from __future__ import annotations

from engine.outputs import CompletionOutput
from service.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, output: CompletionOutput, start: int, end: int) -> ChoiceLogprobs:
    """The chat shape for generated tokens [start, end) of one choice."""
    content = []
    for i in range(start, end):
        token = _text(tokenizer, output.token_ids[i])
        top = [
            TopLogprob(t, lp, list(t.encode()))
            for t, lp in ((_text(tokenizer, tid), lp) for tid, lp in output.top_logprobs[i])
        ]
        content.append(TokenLogprob(token, output.logprobs[i], list(token.encode()), top))
    return ChoiceLogprobs(content)


def completion_logprobs(
    tokenizer, output: CompletionOutput, start: int, end: int, text_offset: int
) -> CompletionLogprobs:
    """The legacy completions shape for generated tokens [start, end)."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for i in range(start, end):
        token = _text(tokenizer, output.token_ids[i])
        tokens.append(token)
        values.append(output.logprobs[i])
        tops.append({_text(tokenizer, tid): lp for tid, lp in output.top_logprobs[i]})
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(tokens, values, tops, offsets)
