"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from engine.errors import ValidationError
from engine.frontend.chat_template import render_chat_text
from service.admission import Admission
from service.constraints import check_constraint, constraint_of
from service.errors import bad_request, from_engine_error
from service.prep import check_chat_body, check_chat_size, unless_gone
from service.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, Delta, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta, encoder,
)
from service.reasoning import ReasoningParser, ReasoningPlan, plan_reasoning
from service.routes.echo import wire_prompt_logprobs
from service.routes.logprobs import chat_logprobs
from service.routes.usage import usage
from service.serving import ServiceState, parse
from service.streaming import event, sse_response
from service.tool_parsers import Parsed, ToolCallParser, parse_text
from service.tools import ToolPlan, plan_tools, template_messages, template_tools


@dataclass
class PreparedChat:
    """A chat request up to the engine: what serving and /render share."""

    body: ChatCompletionRequest
    plan: ToolPlan | None
    constraint: object | None
    messages: list[dict]  # as the chat template took them
    prompt: str
    token_ids: list[int]

    def admission_args(self) -> dict:
        """What ServiceState.admit (and .validate) take besides the request, prompts and id prefix."""
        body = self.body
        return dict(
            prompt_param="messages",
            # `is None`, not `or`: a max_completion_tokens of 0 must never mean "no limit".
            max_tokens=(body.max_tokens if body.max_completion_tokens is None
                        else body.max_completion_tokens),
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            constraint=self.constraint)


async def prepare(request: Request, state: ServiceState) -> PreparedChat:
    """Parse, check and render a chat request (its constraint compiled)."""
    body = await parse(request, ChatCompletionRequest, partial(check_chat_body, state))
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    refuse_unsupported(body)
    check_chat_size(state, body)  # before the messages are rendered
    plan = plan_tools(body, state.tool_parser)
    constraint, constraint_param = _constraint(body, plan)
    messages, prompt, token_ids = await unless_gone(
        request, _prepare(state, body, plan, constraint, constraint_param))
    return PreparedChat(body, plan, constraint, messages, prompt, token_ids)


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    prepared = await prepare(request, state)
    body, plan, constraint = prepared.body, prepared.plan, prepared.constraint
    messages, token_ids = prepared.messages, prepared.token_ids
    thinking = plan_reasoning(state.config.reasoning_parser, prepared.prompt,
                              body.chat_template_kwargs, constrained=constraint is not None)
    admission = state.admit(request, body, [token_ids], id_prefix="chatcmpl",
                            **prepared.admission_args())
    if state.fleet is not None and body.cache_salt is None:
        # A client's own salt is not recorded: no other replica could warm it.
        state.fleet.observe_chat(_system_turn(messages), token_ids,
                                 getattr(request.state, "api_key", None))
    if body.stream:
        return sse_response(_events(state, admission, body, plan, thinking), admission,
                            state.config.sse_ping_seconds)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    response = _response(state, admission, outputs[0], body, plan, thinking)
    return Response(encoder.encode(response), media_type="application/json")


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 for OpenAI's deprecated `functions` / `function_call`, naming them.

    Answering with free text would look like success to a client that relies
    on a function call; `tools` and `tool_choice` are their served successors.
    """
    for param, value in (("functions", body.functions), ("function_call", body.function_call)):
        if value not in (None, [], "none"):
            raise bad_request(f"{param} is OpenAI's deprecated form of tool calling and is not "
                              "served: send tools and tool_choice instead",
                              param=param, code="unsupported_parameter")


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None):
    """The output constraint: response_format / structured_outputs, or the tools' grammar."""
    constraint, param = constraint_of(body)
    if plan is None or not plan.calls_tools:
        return constraint, param
    if constraint is not None:
        field = param.split(".")[0]
        raise bad_request(f"{field} cannot be combined with tool_choice {plan.choice!r}: a "
                          "turn is either tool calls or constrained content",
                          param=field)
    return plan.constraint, plan.constraint_param


async def _prepare(state: ServiceState, body: ChatCompletionRequest, plan: ToolPlan | None,
                   constraint, constraint_param: str) -> tuple[list[dict], str, list[int]]:
    """The conversation through the model's chat template (on a prep thread): the
    messages as the template took them, the prompt's text and its token ids; then
    the constraint compiled (on the compile lane), once the prompt is known to fit.
    Oversized conversations were refused before (check_chat_size)."""
    rendered = await state.off_loop(render_prompt, state, body, plan)
    await check_constraint(state, constraint, constraint_param)
    return rendered


def render_prompt(state: ServiceState, body: ChatCompletionRequest,
                  plan: ToolPlan | None) -> tuple[list[dict], str, list[int]]:
    """The messages as the template took them, the prompt text and its token ids
    (serving and /tokenize alike); run off the loop."""
    messages = template_messages(body.messages, plan, state.renders_tools, state.tool_parser)
    try:
        text = render_chat_text(state.tokenizer, messages, body.add_generation_prompt,
                                tools=template_tools(plan, state.renders_tools),
                                template_kwargs=body.chat_template_kwargs)
    except ValidationError as exc:  # names "messages" or the chat_template_kwargs entry
        raise from_engine_error(exc) from None
    state.check_text_size(len(text), "messages")  # before the costly part: tokenizing
    return messages, text, state.tokenizer.encode(text, add_special_tokens=False)


def _system_turn(messages: list[dict]) -> list[dict]:
    """The system messages the conversation opens with (as rendered)."""
    system = []
    for message in messages:
        if message["role"] != "system":
            break
        system.append(message)
    return system


def _response(state, admission: Admission, output, body, plan,
              thinking: ReasoningPlan | None) -> ChatCompletionResponse:
    """The whole answer, from the request's one FINAL_ONLY output."""
    choices = []
    for c in output.outputs:
        message, calls = _message(c.text, plan, thinking)
        choices.append(ChatChoice(
            index=c.index,
            message=message,
            logprobs=(chat_logprobs(state.tokenizer, state.token_bytes, c)
                      if body.logprobs else None),
            finish_reason=plan.finish_reason(c.finish_reason, calls) if plan else c.finish_reason,
            stop_reason=c.stop_reason,
        ))
    return ChatCompletionResponse(
        admission.request_id, int(time.time()), state.model_name, choices, usage(admission),
        prompt_logprobs=(wire_prompt_logprobs(state.tokenizer, output.prompt_logprobs)
                         if body.prompt_logprobs is not None else None),
    )


def _message(text: str, plan: ToolPlan | None,
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


async def _events(state: ServiceState, admission: Admission, body, plan: ToolPlan | None,
                  thinking: ReasoningPlan | None):
    """The SSE events of one chat stream: role, reasoning deltas, then content or
    tool-call deltas, finish, usage.

    The engine's outputs are deltas (DELTA): each choice holds only its new
    text, tokens and logprobs.
    """
    created, model = int(time.time()), state.model_name
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
            delta, finish_reason = _choice_delta(c, thinker, parser, plan)
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


def _choice_delta(c, thinker: ReasoningParser | None, parser: ToolCallParser | None,
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
