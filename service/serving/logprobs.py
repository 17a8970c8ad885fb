"""Logprobs in OpenAI's two shapes: chat (`content: [...]`) and legacy completions.

`token` is the token's text decoded alone (U+FFFD where it holds part of a
character); `bytes` are its raw bytes (service/serving/token_bytes.py), which a client
joins to rebuild such characters; legacy `text_offset` counts characters of
the choice's text, as the text itself does.

Each covers every token of the output it is given: a streamed output (DELTA)
holds only the chunk's new tokens, a non-streamed one (FINAL_ONLY) all of them.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput
from service.protocol.replies import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from service.serving.token_bytes import TextOffsets, TokenBytes


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_bytes: TokenBytes,
                  output: CompletionOutput) -> ChoiceLogprobs:
    """The chat shape for the tokens of one choice's output."""
    content = []
    for token_id, logprob, top_logprobs in zip(output.token_ids, output.logprobs,
                                               output.top_logprobs):
        top = [
            TopLogprob(_text(tokenizer, tid), lp, list(token_bytes[tid]))
            for tid, lp in top_logprobs
        ]
        content.append(TokenLogprob(_text(tokenizer, token_id), logprob,
                                    list(token_bytes[token_id]), top))
    return ChoiceLogprobs(content)


def completion_logprobs(tokenizer, output: CompletionOutput,
                        offsets: TextOffsets) -> CompletionLogprobs:
    """The legacy completions shape for the tokens of one choice's output.

    `offsets` has seen the choice's earlier tokens (earlier chunks of a stream)
    and moves past these.
    """
    token_ids = output.token_ids
    return CompletionLogprobs(
        tokens=[_text(tokenizer, t) for t in token_ids],
        token_logprobs=list(output.logprobs),
        top_logprobs=[{_text(tokenizer, tid): lp for tid, lp in top}
                      for top in output.top_logprobs],
        text_offset=offsets.advance(token_ids),
    )
