"""Completions preparation and answers: prompts normalised and tokenized (what
/v1/completions and /render share), then the engine's outputs as choices, whole
or streamed, with echo and legacy logprobs.

Each prompt of a batch is its own engine request; choice i*n + j is sample j
of prompt i, as in OpenAI's API, and streamed choices interleave as they come.
"""

from __future__ import annotations

import time

from starlette.requests import Request

from service.errors import bad_request
from service.protocol.replies import CompletionChoice, CompletionResponse
from service.protocol.requests import CompletionRequest
from service.serving.admitted import Admission
from service.serving.constraints import check_constraint, compile_tenant, constraint_of
from service.serving.echo import (
    Echo, echo_logprobs, echo_of, joined, prompt_texts, wire_prompt_logprobs,
)
from service.serving.lanes import unless_gone
from service.serving.logprobs import completion_logprobs
from service.serving.state import ServiceState, parse
from service.serving.streaming import event
from service.serving.token_bytes import TextOffsets
from service.serving.usage import usage

# OpenAI's default for /v1/completions (chat defaults to "whatever fits").
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64


def admission_args(body: CompletionRequest, constraint) -> dict:
    """What ServiceState.admit (and .validate) take besides the request, prompts and id prefix."""
    return dict(prompt_param="prompt",
                max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
                logprobs=body.logprobs, constraint=constraint)


async def prepare(request: Request, state: ServiceState):
    """Parse, check and tokenize a completions request (its constraint compiled):
    what serving and /render share. Returns (body, prompts as token ids, constraint)."""
    body = await parse(request, CompletionRequest)
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens=0 is allowed only with echo=true (the prompt is then "
                          "answered, with its logprobs if asked, and nothing generated)",
                          param="max_tokens")
    if body.echo and state.tokenizer is None:
        raise bad_request("echo needs the model's tokenizer, which this model has not",
                          param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of not in (1, body.n):
        # best_of > n would sample extra candidates and return the likeliest:
        # not served (vLLM's current engine dropped it too).
        raise bad_request(f"best_of={body.best_of} is not supported: only best_of=n "
                          f"(n={body.n})", param="best_of", code="unsupported_parameter")
    constraint, constraint_param = constraint_of(body)
    prompts = await unless_gone(request, _prepare(state, body, constraint, constraint_param,
                                                  compile_tenant(request)))
    return body, prompts, constraint


async def _prepare(state: ServiceState, body: CompletionRequest, constraint,
                   constraint_param: str, tenant: str) -> list[list[int]]:
    """The prompts as token ids (on a prep thread), then the constraint compiled (on
    the compile lane) once they are known to fit (service/serving/lanes.py)."""
    prompts = await state.off_loop(_prompts, state, body.prompt)
    await check_constraint(state, constraint, constraint_param, tenant)
    return prompts


def _prompts(state: ServiceState, prompt) -> list[list[int]]:
    """Normalise the four prompt forms OpenAI accepts to a list of token-id lists.

    Runs off the loop; a text that cannot fit is refused before it is tokenized.
    """
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
    if any(isinstance(p, str) for p in items) and state.tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", param="prompt")
    for p in items:
        if isinstance(p, str):
            state.check_text_size(len(p), "prompt")
    return [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(state, c, prompt_index: int, body, offsets: TextOffsets | None,
            echo: Echo | None = None, prompt_logprobs=None) -> CompletionChoice:
    """Choice j of prompt i is choice i*n + j, with its output's text and logprobs:
    a whole answer's (FINAL_ONLY), or a stream chunk's new part (DELTA); after
    the prompt's (service/serving/echo.py) when it echoes."""
    logprobs = None
    if body.logprobs is not None:
        prompt_part = None if echo is None else echo_logprobs(state.tokenizer, echo,
                                                               body.logprobs, offsets)
        logprobs = completion_logprobs(state.tokenizer, c, offsets)
        if prompt_part is not None:
            logprobs = joined(prompt_part, logprobs)
    text = c.text if echo is None else echo.text + c.text
    return CompletionChoice(prompt_index * body.n + c.index, text, logprobs, c.finish_reason,
                            c.stop_reason, prompt_logprobs)


def _echo(state, body, output, texts: list[str | None], index: int) -> Echo | None:
    """Prompt `index`'s echo, when the request asks for it."""
    if not body.echo:
        return None
    return echo_of(state.tokenizer, body.skip_special_tokens, output, texts[index])


def _offsets(state, body) -> TextOffsets | None:
    """A fresh text-offset counter for one choice, when logprobs were asked for."""
    if body.logprobs is None:
        return None
    return TextOffsets(state.token_bytes, body.skip_special_tokens)


def completion_response(state, admission: Admission, outputs, body) -> CompletionResponse:
    texts = prompt_texts(body.prompt)
    choices = []
    for i, output in enumerate(outputs):
        echo = _echo(state, body, output, texts, i)
        extra = (wire_prompt_logprobs(state.tokenizer, output.prompt_logprobs)
                 if body.prompt_logprobs is not None else None)
        choices.extend(_choice(state, c, i, body, _offsets(state, body), echo, extra)
                       for c in output.outputs)
    return CompletionResponse(admission.request_id, int(time.time()), admission.model, choices,
                              usage=usage(admission))


async def completion_events(state, admission: Admission, body):
    created, model = int(time.time()), admission.model
    # Legacy logprobs number each token by its text offset in the choice; the
    # offsets run on across chunks, so they match a non-streamed answer.
    offsets: dict[tuple[int, int], TextOffsets | None] = {}
    texts = prompt_texts(body.prompt)
    options = body.stream_options
    async for update in admission.updates():
        choices = []
        for c in update.choices:
            key, echo = (update.prompt_index, c.index), None
            if key not in offsets:  # a choice's first chunk: it carries the echo
                offsets[key] = _offsets(state, body)
                echo = _echo(state, body, admission.latest[update.prompt_index], texts,
                             update.prompt_index)
            choices.append(_choice(state, c, update.prompt_index, body, offsets[key], echo))
        running = usage(admission) if options is not None and options.usage_per_chunk else None
        yield event(CompletionResponse(admission.request_id, created, model, choices,
                                       usage=running))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield event(CompletionResponse(admission.request_id, created, model, [],
                                       usage=usage(admission)))
