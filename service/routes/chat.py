"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from engine.chat_template import ChatTemplateError, render_chat_text
from service.admission import Admission
from service.constraints import check_constraint, constraint_of
from service.errors import bad_request
from service.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatMessage, Delta, encoder,
)
from service.routes.logprobs import chat_logprobs
from service.routes.usage import usage
from service.serving import ServiceState, parse
from service.streaming import event, sse_response


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    refuse_unsupported(body)
    constraint, constraint_param = constraint_of(body)
    await check_constraint(state, constraint, constraint_param)
    token_ids = await render(state, body)
    admission = state.admit(
        request, body, [token_ids],
        id_prefix="chatcmpl",
        prompt_param="messages",
        # `is None`, not `or`: a max_completion_tokens of 0 must never mean "no limit".
        max_tokens=(body.max_tokens if body.max_completion_tokens is None
                    else body.max_completion_tokens),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        constraint=constraint,
    )
    if state.fleet is not None and body.cache_salt is None:
        # A client's own salt is not recorded: no other replica could warm it.
        state.fleet.observe_chat(_system_turn(body), token_ids,
                                 getattr(request.state, "api_key", None))
    if body.stream:
        return sse_response(_events(state, admission, body), admission,
                            state.config.sse_ping_seconds)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    return Response(encoder.encode(_response(state, admission.request_id, outputs[0], body)),
                    media_type="application/json")


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 for an OpenAI option this server does not serve yet, naming it.

    Answering such a request with free text would look like success to a
    client that relies on the option (a JSON schema, a tool call), so each is
    refused unless it asks for what plain generation does anyway.
    """
    if body.tools:
        raise _unsupported("tools", "tool calling")
    if body.tool_choice not in (None, "none"):
        raise _unsupported("tool_choice", "tool calling")
    if body.functions:
        raise _unsupported("functions", "function calling")
    if body.function_call not in (None, "none"):
        raise _unsupported("function_call", "function calling")
    for i, message in enumerate(body.messages):
        if message.tool_calls:
            raise _unsupported(f"messages[{i}].tool_calls", "tool calling")


def _unsupported(param: str, feature: str):
    return bad_request(f"{param}: {feature} is not supported by this server yet",
                       param=param, code="unsupported_parameter")


async def render(state: ServiceState, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template, as token ids (off the loop).

    Every message costs at least one token (its role marker), so a conversation
    with max_model_len messages cannot fit: refused before rendering, which
    for 100,000 messages would hold the interpreter for seconds.
    """
    limit = state.engine.config.max_model_len
    if len(body.messages) >= limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens; the conversation has "
            f"{len(body.messages)} messages, at least one token each", param="messages")
    return await state.off_loop(_render, state, body)


def _render(state: ServiceState, body: ChatCompletionRequest) -> list[int]:
    messages = [_message(m) for m in body.messages]
    try:
        text = render_chat_text(state.tokenizer, messages, body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    state.check_text_size(len(text), "messages")  # before the costly part: tokenizing
    return state.tokenizer.encode(text, add_special_tokens=False)


def _system_turn(body: ChatCompletionRequest) -> list[dict]:
    """The system (or developer) messages the conversation opens with."""
    system = []
    for message in body.messages:
        if message.role not in ("system", "developer"):
            break
        system.append(_message(message))
    return system


def _message(message: ChatMessage) -> dict:
    content = message.content
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


def _response(state, request_id, output, body) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage("assistant", c.text),
            logprobs=(chat_logprobs(state.tokenizer, state.token_bytes, c, 0, len(c.token_ids))
                      if body.logprobs else None),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in output.outputs
    ]
    return ChatCompletionResponse(
        request_id, int(time.time()), state.model_name, choices, usage(output)
    )


async def _events(state: ServiceState, admission: Admission, body):
    """The SSE events of one chat stream: role, content deltas, finish, usage."""
    created, model = int(time.time()), state.model_name

    def chunk(choices, **extra) -> bytes:
        return event(ChatCompletionChunk(admission.request_id, created, model, choices, **extra))

    # OpenAI opens every choice with the role and empty content.
    yield chunk([ChatChunkChoice(i, Delta("assistant", ""), None, None) for i in range(body.n)])
    async for update in admission.updates():
        choices = []
        for c in update.choices:
            logprobs = None
            if body.logprobs:
                end = len(c.token_ids)
                logprobs = chat_logprobs(state.tokenizer, state.token_bytes, c,
                                         end - len(c.delta_token_ids), end)
            choices.append(ChatChunkChoice(
                c.index, Delta(content=c.delta_text or None), logprobs, c.finish_reason
            ))
        yield chunk(choices)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(*admission.latest))
