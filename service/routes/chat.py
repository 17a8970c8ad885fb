"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from engine.chat_template import ChatTemplateError, render_chat
from service.admission import Admission
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
    token_ids = render(state.tokenizer, body)
    admission = state.admit(
        request, body, [token_ids],
        id_prefix="chatcmpl",
        prompt_param="messages",
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    if body.stream:
        return sse_response(_events(state, admission, body), admission,
                            state.config.sse_ping_seconds)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    return Response(encoder.encode(_response(state, admission.request_id, outputs[0], body)),
                    media_type="application/json")


def render(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template, as token ids."""
    messages = [_message(m) for m in body.messages]
    try:
        return render_chat(tokenizer, messages, body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


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
            logprobs=(chat_logprobs(state.tokenizer, c, 0, len(c.token_ids))
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
                logprobs = chat_logprobs(state.tokenizer, c, end - len(c.delta_token_ids), end)
            choices.append(ChatChunkChoice(
                c.index, Delta(content=c.delta_text or None), logprobs, c.finish_reason
            ))
        yield chunk(choices)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(*admission.latest))
