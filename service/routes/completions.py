"""POST /v1/completions: a text prompt, token ids, or a batch of either.

Each prompt of a batch is its own engine request; choice i*n + j is sample j
of prompt i, as in OpenAI's API, and streamed choices interleave as they come.
"""

from __future__ import annotations

import time

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from service.errors import bad_request
from service.protocol import (
    CompletionChoice, CompletionRequest, CompletionResponse, encoder,
)
from service.routes.logprobs import completion_logprobs
from service.routes.usage import usage
from service.serving import ServiceState, close_on_disconnect, new_id, parse, sampling_params
from service.streaming import event, merge, with_done

# OpenAI's default for /v1/completions (chat defaults to "whatever fits").
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, CompletionRequest)
    state.check_model(body.model)
    state.check_accepting()
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    prompts = _prompts(state.tokenizer, body.prompt)
    all_params = []
    for token_ids in prompts:
        state.check_prompt(token_ids, "prompt")
        all_params.append(sampling_params(
            body,
            prompt_len=len(token_ids),
            max_model_len=state.max_model_len,
            max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
            logprobs=body.logprobs,
            prompt_param="prompt",
        ))
    request_id = new_id("cmpl")
    salt = state.salt(request, body)
    streams = []
    try:
        for i, (token_ids, params) in enumerate(zip(prompts, all_params)):
            streams.append(state.submit(f"{request_id}-{i}", token_ids, params, salt))
    except BaseException:
        for stream in streams:  # a later prompt was refused (429): drop the earlier ones
            stream.close()
        raise

    async def close_all(_message=None) -> None:
        for stream in streams:
            stream.close()

    if body.stream:
        return EventSourceResponse(
            with_done(_events(state, request_id, streams, body, close_all)),
            ping=state.config.sse_ping_seconds,
            client_close_handler_callable=close_all,
        )
    outputs = await close_on_disconnect(request, streams)
    if outputs is None:
        return Response(status_code=499)
    return Response(encoder.encode(_response(state, request_id, outputs, body)),
                    media_type="application/json")


def _prompts(tokenizer, prompt) -> list[list[int]]:
    """Normalise the four prompt forms OpenAI accepts to a list of token-id lists."""
    if isinstance(prompt, str):
        items = [prompt]
    elif all(_is_token(t) for t in prompt):
        items = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(
        isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt
    ):
        items = prompt
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids", param="prompt",
        )
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}",
                          param="prompt")
    if any(isinstance(p, str) for p in items) and tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", param="prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(state, c, prompt_index: int, n: int, body, start: int, text: str,
            text_offset: int) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, c, start, len(c.token_ids), text_offset)
    return CompletionChoice(prompt_index * n + c.index, text, logprobs, c.finish_reason,
                            c.stop_reason)


def _response(state, request_id, outputs, body) -> CompletionResponse:
    choices = [
        _choice(state, c, i, body.n, body, 0, c.text, 0)
        for i, output in enumerate(outputs)
        for c in output.outputs
    ]
    return CompletionResponse(request_id, int(time.time()), state.model_name, choices,
                              usage=usage(*outputs))


async def _events(state, request_id, streams, body, close_all):
    created, model = int(time.time()), state.model_name
    n = body.n
    sent = [[0] * n for _ in streams]  # tokens sent per (prompt, sample)
    chars = [[0] * n for _ in streams]  # characters sent: the logprobs text offset
    finished = [[False] * n for _ in streams]
    finals = [None] * len(streams)
    try:
        async for i, output in merge(streams):
            choices = []
            for c in output.outputs:
                new_tokens = len(c.token_ids) > sent[i][c.index]
                if finished[i][c.index] or not (c.delta_text or c.finished or new_tokens):
                    continue
                choices.append(_choice(state, c, i, n, body, sent[i][c.index],
                                       c.delta_text, chars[i][c.index]))
                sent[i][c.index] = len(c.token_ids)
                chars[i][c.index] += len(c.delta_text)
                finished[i][c.index] = c.finished
            if choices:
                yield event(CompletionResponse(request_id, created, model, choices))
            finals[i] = output
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event(CompletionResponse(request_id, created, model, [], usage=usage(*finals)))
    finally:
        await close_all()
