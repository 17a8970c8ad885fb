"""A chat answer from the engine's outputs: the whole response, or its stream of
chunks; the assistant's message split into thought, content and tool calls."""

from __future__ import annotations

import time

from service.protocol.replies import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    Delta, FunctionDelta, ToolCallDelta,
)
from service.protocol.requests import FunctionCall, ToolCall
from service.serving.admitted import Admission
from service.serving.echo import wire_prompt_logprobs
from service.serving.logprobs import chat_logprobs
from service.serving.reasoning import ReasoningParser, ReasoningPlan
from service.serving.state import ServiceState
from service.serving.streaming import event
from service.serving.usage import usage
from service.tool_calls.base import Parsed, ToolCallParser, parse_text
from service.tool_calls.plan import ToolPlan


def chat_response(state, admission: Admission, output, body, plan,
                  thinking: ReasoningPlan | None) -> ChatCompletionResponse:
    """The whole answer, from the request's one FINAL_ONLY output."""
    choices = []
    for c in output.outputs:
        message, calls = assistant_message(c.text, plan, thinking)
        choices.append(ChatChoice(
            index=c.index,
            message=message,
            logprobs=(chat_logprobs(state.tokenizer, state.token_bytes, c)
                      if body.logprobs else None),
            finish_reason=plan.finish_reason(c.finish_reason, calls) if plan else c.finish_reason,
            stop_reason=c.stop_reason,
        ))
    return ChatCompletionResponse(
        admission.request_id, int(time.time()), admission.model, choices, usage(admission),
        prompt_logprobs=(wire_prompt_logprobs(state.tokenizer, output.prompt_logprobs)
                         if body.prompt_logprobs is not None else None),
    )


def assistant_message(text: str, plan: ToolPlan | None,
                      thinking: ReasoningPlan | None) -> tuple[AssistantMessage, int]:
    """The assistant's turn: its thought, then its tool calls read out of the rest
    of the text (never out of the thought); and how many calls."""
    reasoning = None
    if thinking is not None:
        reasoning, text = thinking.split(text)
    parser = plan.new_parser() if plan is not None else None
    tool_calls = None
    if parser is not None:
        text, calls = parse_text(parser, text or "")
        tool_calls = [ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls] or None
    if tool_calls or reasoning is not None:  # no text besides: null, as OpenAI and vLLM
        text = text or None
    return (AssistantMessage("assistant", text, tool_calls, reasoning, reasoning),
            len(tool_calls or ()))


def _delta(parsed: Parsed) -> Delta:
    """A stream's delta from what a tool-call parser made of the new text."""
    calls: list[ToolCallDelta] = []
    for piece in parsed.calls:
        if calls and calls[-1].index == piece.index:  # one entry per call and chunk
            calls[-1].function.arguments += piece.arguments
        else:
            calls.append(ToolCallDelta(piece.index, piece.id, "function" if piece.id else None,
                                       FunctionDelta(piece.name, piece.arguments)))
    return Delta(content=parsed.content or None, tool_calls=calls or None)


async def chat_events(state: ServiceState, admission: Admission, body, plan: ToolPlan | None,
                      thinking: ReasoningPlan | None):
    """The SSE events of one chat stream: role, reasoning deltas, then content or
    tool-call deltas, finish, usage.

    The engine's outputs are deltas (DELTA): each choice holds only its new
    text, tokens and logprobs.
    """
    created, model = int(time.time()), admission.model
    parsers = [plan.new_parser() if plan is not None else None for _ in range(body.n)]
    thinkers = [thinking.new_parser() if thinking is not None else None for _ in range(body.n)]

    # vLLM's continuous_usage_stats: every chunk with choices tells the usage so far.
    per_chunk = body.stream_options is not None and body.stream_options.usage_per_chunk

    def chunk(choices, **extra) -> bytes:
        if per_chunk and choices:
            extra.setdefault("usage", usage(admission))
        return event(ChatCompletionChunk(admission.request_id, created, model, choices, **extra))

    # OpenAI opens every choice with the role and empty content. That chunk
    # leaves with the first token, as vLLM's does, so a client that times the
    # first chunk times the first token; until then (a long prefill) only the
    # keep-alive comments of sse_response go out.
    opening = [ChatChunkChoice(i, Delta("assistant", ""), None, None) for i in range(body.n)]
    async for update in admission.updates():
        if opening:
            yield chunk(opening)
            opening = None
        choices = []
        for c in update.choices:
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(state.tokenizer, state.token_bytes, c)
            parser, thinker = parsers[c.index], thinkers[c.index]
            delta, finish_reason = choice_delta(c, thinker, parser, plan)
            if (delta == Delta() and finish_reason is None and logprobs is None
                    and (parser is not None or thinker is not None)):
                continue  # the text so far is a call's head or part of a tag: nothing yet
            choices.append(ChatChunkChoice(c.index, delta, logprobs, finish_reason))
        if choices:
            yield chunk(choices)
    if opening:  # ended without an update: the choices still open
        yield chunk(opening)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(admission))


def choice_delta(c, thinker: ReasoningParser | None, parser: ToolCallParser | None,
                 plan: ToolPlan | None) -> tuple[Delta, str | None]:
    """One choice's new text as a delta, and its finish reason: the part that is
    thought as reasoning, the rest as content or tool-call pieces."""
    finish_reason, reasoning, text = c.finish_reason, None, c.delta_text
    if thinker is not None:
        split = thinker.feed(text)
        if finish_reason is not None:
            split.add(thinker.finish())
        reasoning, text = split.reasoning or None, split.content
    if parser is None:
        delta = Delta(content=text or None)
    else:
        parsed = parser.feed(text)
        if finish_reason is not None:
            parsed.add(parser.finish())
            finish_reason = plan.finish_reason(finish_reason, parser.calls)
        delta = _delta(parsed)
    delta.reasoning_content = delta.reasoning = reasoning
    return delta, finish_reason
