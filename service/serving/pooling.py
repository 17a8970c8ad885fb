"""Pooling requests up to the engine and back: which server serves them, their inputs
as token ids, one engine request per input, awaited together.

    serving_pooling(state, route)   a pooling model that does what the route needs,
                                    else 400 (and refuse_pooling: the other way round)
    input_items(...)                the four input forms OpenAI takes, as a list
    embed_items / pair_items        token ids on a prep lane (engine/model/pooling/inputs.py:
                                    sentence-transformers' prompts, the tokenizer's pair
                                    encoding), refusing an input that is too long unless
                                    truncate_prompt_tokens asks to cut it
    submit(...) -> PoolingJob       one engine request per input (429 and 503 as admit())
    job.collect(request)            every input's output, or None if the client left:
                                    then, and on any error, every request still running
                                    is aborted
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from starlette.requests import Request

from engine.errors import ValidationError
from engine.frontend.async_engine import EngineDeadError, QueueFullError
from engine.model.pooling.inputs import embed_input, pair_input, truncated_ids
from engine.model.pooling.params import PoolingParams
from service.errors import APIError, bad_request, from_engine_error
from service.guards.tenancy import cache_salt
from service.metrics import RequestTimer
from service.protocol.pooling import PoolingFields
from service.serving.state import ServiceState, new_id

# OpenAI's limit on inputs in one embeddings request; the server's queue may set a
# lower one (each input is a request of its own in the engine).
MAX_INPUTS = 2048
# What a pooling server serves, by the task of its model.
ROUTES_BY_TASK = {"embed": "/v1/embeddings, /pooling, /score and /rerank",
                  "classify": "/classify, /pooling, /score and /rerank"}
GENERATE_ROUTES = "/v1/chat/completions, /v1/completions and /v1/responses"
TASKS = ("embed", "classify")


def serving_pooling(state: ServiceState, route: str, tasks: tuple[str, ...] = TASKS):
    """The model's PoolingInfo when it does one of `tasks`; a 400 saying what the
    server serves instead, before the body is read."""
    info = state.engine.pooling
    if info is None:
        raise bad_request(f"this server runs a generative model: {route} needs a pooling model "
                          f"(a server started with --runner pooling); it serves "
                          f"{GENERATE_ROUTES}", param="model", code="model_not_supported")
    if info.task not in tasks:
        raise bad_request(f"this server runs a pooling model that does {info.task!r}: {route} "
                          f"needs one that does {' or '.join(map(repr, tasks))}; it serves "
                          f"{ROUTES_BY_TASK[info.task]}", param="model",
                          code="model_not_supported")
    return info


def refuse_pooling(state: ServiceState, route: str) -> None:
    """A generation route on a pooling server: a 400 saying what it serves instead."""
    info = state.engine.pooling
    if info is not None:
        raise bad_request(f"this server runs a pooling model ({info.task}): {route} needs a "
                          f"generative model; it serves {ROUTES_BY_TASK[info.task]}",
                          param="model", code="model_not_supported")


def max_inputs(state: ServiceState) -> int:
    """Inputs one request may carry: OpenAI's limit, or what the engine's queue takes."""
    return min(MAX_INPUTS, state.config.max_waiting_requests)


def input_items(state: ServiceState, value, param: str) -> list[str | list[int]]:
    """A text, texts, token ids or lists of token ids, as a list of inputs."""
    if isinstance(value, str) or (value and all(_is_token(t) for t in value)):
        items = [value]
    elif all(isinstance(v, str) for v in value) or all(
            isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        items = list(value)
    else:
        raise bad_request(f"{param} must be a string, a list of strings, a list of token ids, "
                          "or a list of lists of token ids", param=param)
    check_count(state, len(items), param)
    return items


def check_count(state: ServiceState, count: int, param: str) -> None:
    limit = max_inputs(state)
    if count > limit:
        raise bad_request(f"at most {limit} inputs per request, got {count}", param=param)


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def truncation(info, value: int | None) -> int | None:
    """truncate_prompt_tokens as a token count (-1: the longest prompt the model takes)."""
    if value is None:
        return None
    if value == -1:
        return info.max_prompt_tokens
    if value < 1 or value > info.max_prompt_tokens:
        raise bad_request(f"truncate_prompt_tokens={value} must be -1 or in [1, "
                          f"{info.max_prompt_tokens}] (the longest prompt this model takes)",
                          param="truncate_prompt_tokens")
    return value


@dataclass(frozen=True)
class Item:
    """One input as the engine runs it."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


def embed_items(state: ServiceState, info, items: list, *, truncate: int | None,
                prompt_name: str | None, param: str) -> list[Item]:
    """Each input's token ids, on a prep thread: a text through the model's prompt
    and tokenizer (inputs.py embed_input), token ids as they are."""
    prepared = []
    for item in items:
        if not isinstance(item, str):
            prepared.append(Item(_token_ids(state, info, item, truncate, param)))
            continue
        _need_tokenizer(state, param)
        try:
            token_ids, types = embed_input(state.tokenizer, info, item, prompt_name=prompt_name,
                                           truncate=truncate, param=param)
        except ValidationError as exc:
            raise from_engine_error(exc) from None
        prepared.append(Item(token_ids, types))
    return prepared


def pair_items(state: ServiceState, info, pairs: list[tuple[str, str]], *,
               truncate: int | None, param: str) -> list[Item]:
    """Each (text_1, text_2) pair as one sequence, as a cross-encoder reads it."""
    _need_tokenizer(state, param)
    prepared = []
    for first, second in pairs:
        try:
            token_ids, types = pair_input(state.tokenizer, info, first, second,
                                          truncate=truncate, param=param)
        except ValidationError as exc:
            raise from_engine_error(exc) from None
        prepared.append(Item(token_ids, types))
    return prepared


def _need_tokenizer(state: ServiceState, param: str) -> None:
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", param=param)


def _token_ids(state: ServiceState, info, token_ids: list[int], truncate: int | None,
               param: str) -> list[int]:
    """Token ids sent as they are: their first `truncate` (as a text is cut: from
    its end), else refused when longer than the model takes."""
    try:
        token_ids = truncated_ids(token_ids, info, truncate, param)
        state.engine.check_prompt(token_ids)  # ids outside the vocabulary
    except ValidationError as exc:
        raise from_engine_error(exc, {"prompt": param}) from None
    return token_ids


def pooling_params(state: ServiceState, names: dict[str, str] | None = None,
                   **fields) -> PoolingParams:
    """PoolingParams the model can answer; a refusal is a 400 naming the field
    (`names`: the request's own name for a field the engine names otherwise)."""
    try:
        params = PoolingParams(**fields)
        state.engine.check_params(params)
    except ValidationError as exc:
        raise from_engine_error(exc, names) from None
    return params


@dataclass(eq=False)
class PoolingJob:
    """A request's engine requests, one per input, read together."""

    request_id: str
    streams: list
    timer: RequestTimer
    param: str  # the request's field for its inputs (an engine refusal names it)
    done: bool = False

    async def collect(self, request: Request) -> list | None:
        """Every input's output in order, or None if the client disconnects first.

        However it ends (answered, client gone, an error), every request still
        running is aborted: one input refused by the engine fails the request.
        """
        work = asyncio.ensure_future(asyncio.gather(*(self._read(s) for s in self.streams)))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                return None  # the client is gone; the finally below aborts its requests
            try:
                outputs = work.result()  # re-raises the first input's error
            except BaseException:
                self._end("error")
                raise
            self._end("stop")
            self.timer.finished()
            return outputs
        finally:
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, return_exceptions=True)  # let it unwind
            self.close()

    async def _read(self, stream):
        """A stream's finished output (a pooling request yields one)."""
        try:
            async for output in stream:
                if output.finished:
                    return output
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except ValidationError as exc:
            raise from_engine_error(exc, {"prompt": self.param}) from None
        raise APIError(500, "a pooling request ended without its output")

    def close(self) -> None:
        """Abort every input still running; safe to call again."""
        self._end("abort")
        for stream in self.streams:
            stream.close()

    def _end(self, reason: str) -> None:
        """Count the request's inputs as ended for `reason`, once (metrics)."""
        if not self.done:
            self.done = True
            self.timer.ended(reason, len(self.streams))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_request(state: ServiceState, request: Request, body: PoolingFields) -> None:
    """What every pooling request must pass before its inputs are prepared: the
    server takes requests, the model name is the served model (404), priority
    (as the request's key may ask for it)."""
    state.check_accepting()
    if state.check_model(body.model) is not None:
        raise bad_request("LoRA adapters are not served for pooling requests", param="model")
    state.check_priority(body.priority, getattr(request.state, "api_key", None))


def submit(state: ServiceState, request: Request, body: PoolingFields, items: list[Item],
           params: PoolingParams, *, id_prefix: str, param: str) -> PoolingJob:
    """Hand every input to the engine as a request of its own (its own copy of
    `params`); a refusal (429, 503) drops those already handed over."""
    state.check_accepting()  # again: the server may have begun draining meanwhile
    salt = cache_salt(state.config, getattr(request.state, "api_key", None), body.cache_salt)
    request_id = new_id(id_prefix)
    streams = []
    try:
        for i, item in enumerate(items):
            engine_id = request_id if len(items) == 1 else f"{request_id}-{i}"
            streams.append(_generate(state, engine_id, item, dataclasses.replace(params),
                                     salt, body.priority))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return PoolingJob(request_id, streams, state.metrics.timer(), param)


def _generate(state: ServiceState, request_id: str, item: Item, params: PoolingParams,
              salt: str | None, priority: int):
    try:
        return state.engine.generate(request_id, item.token_ids, params,
                                     token_type_ids=item.token_type_ids, cache_salt=salt,
                                     priority=priority)
    except QueueFullError as exc:
        raise APIError(429, f"the server is busy: {exc}; retry later", code="queue_full",
                       headers={"Retry-After": str(state.config.retry_after_seconds)}) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
