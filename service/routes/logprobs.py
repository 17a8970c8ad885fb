"""Logprobs in OpenAI's two shapes: chat (`content: [...]`) and legacy completions.

`token` is the token's text decoded alone (U+FFFD where it holds part of a
character); `bytes` are its raw bytes (service/token_bytes.py), which a client
joins to rebuild such characters; legacy `text_offset` counts characters of
the choice's text, as the text itself does.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput
from service.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from service.token_bytes import TextOffsets, TokenBytes


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_bytes: TokenBytes, output: CompletionOutput,
                  start: int, end: int) -> ChoiceLogprobs:
    """The chat shape for generated tokens [start, end) of one choice."""
    content = []
    for i in range(start, end):
        token_id = output.token_ids[i]
        top = [
            TopLogprob(_text(tokenizer, tid), lp, list(token_bytes[tid]))
            for tid, lp in output.top_logprobs[i]
        ]
        content.append(TokenLogprob(_text(tokenizer, token_id), output.logprobs[i],
                                    list(token_bytes[token_id]), top))
    return ChoiceLogprobs(content)


def completion_logprobs(
    tokenizer, output: CompletionOutput, start: int, end: int, offsets: TextOffsets
) -> CompletionLogprobs:
    """The legacy completions shape for generated tokens [start, end).

    `offsets` has seen the choice's tokens before `start` and moves past these.
    """
    token_ids = output.token_ids[start:end]
    return CompletionLogprobs(
        tokens=[_text(tokenizer, t) for t in token_ids],
        token_logprobs=list(output.logprobs[start:end]),
        top_logprobs=[{_text(tokenizer, tid): lp for tid, lp in output.top_logprobs[i]}
                      for i in range(start, end)],
        text_offset=offsets.advance(token_ids),
    )
