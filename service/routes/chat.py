"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE."""

from __future__ import annotations

import time

import jinja2
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from engine.outputs import RequestOutput
from service.errors import bad_request
from service.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatMessage, Delta, encoder,
)
from service.routes.logprobs import chat_logprobs
from service.routes.usage import usage
from service.serving import ServiceState, TimedStream, close_on_disconnect, new_id, parse
from service.serving import sampling_params
from service.streaming import event, with_done


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, ChatCompletionRequest)
    state.check_model(body.model)
    state.check_accepting()
    token_ids = render(state.tokenizer, body)
    state.check_prompt(token_ids, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_params(
        body,
        prompt_len=len(token_ids),
        max_model_len=state.max_model_len,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages",
    )
    request_id = new_id("chatcmpl")
    stream = state.submit(request_id, token_ids, params, state.salt(request, body))
    if body.stream:
        return EventSourceResponse(
            with_done(_events(state, request_id, stream, body)),
            ping=state.config.sse_ping_seconds,
            client_close_handler_callable=stream.aclose,
        )
    outputs = await close_on_disconnect(request, [stream])
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    return Response(encoder.encode(_response(state, request_id, outputs[0], body)),
                    media_type="application/json")


def render(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The conversation as the model was trained to see it, as token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions")
    messages = [_message(m) for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
    except jinja2.TemplateError as exc:  # e.g. a template that insists roles alternate
        raise bad_request(f"the chat template refused these messages: {exc}", "messages")
    # The template already placed the special tokens (BOS, role markers).
    return tokenizer.encode(text, add_special_tokens=False)


def _message(message: ChatMessage) -> dict:
    content = message.content
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


def _response(state, request_id, output: RequestOutput, body) -> ChatCompletionResponse:
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


async def _events(state: ServiceState, request_id: str, stream: TimedStream, body):
    """The SSE events of one chat stream: role, content deltas, finish, usage."""
    created, model = int(time.time()), state.model_name

    def chunk(choices, **extra) -> bytes:
        return event(ChatCompletionChunk(request_id, created, model, choices, **extra))

    try:
        # OpenAI opens every choice with the role and empty content.
        yield chunk([ChatChunkChoice(i, Delta("assistant", ""), None, None)
                     for i in range(body.n)])
        sent = [0] * body.n  # tokens already sent, per choice
        finished = [False] * body.n
        final = None
        async for output in stream:
            choices = []
            for c in output.outputs:
                new_tokens = len(c.token_ids) > sent[c.index]
                if finished[c.index] or not (c.delta_text or c.finished or new_tokens):
                    continue
                logprobs = (chat_logprobs(state.tokenizer, c, sent[c.index], len(c.token_ids))
                            if body.logprobs else None)
                sent[c.index] = len(c.token_ids)
                finished[c.index] = c.finished
                delta = Delta(content=c.delta_text or None)
                choices.append(ChatChunkChoice(c.index, delta, logprobs, c.finish_reason))
            if choices:
                yield chunk(choices)
            final = output
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=usage(final))
    finally:
        stream.close()
