"""What chat and text completions share: the server's state, turning a request
into token ids and SamplingParams, and submitting it to the engine.

A route handler is then only: parse, prompt, submit, shape the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from service.auth import cache_salt
from service.config import ServiceConfig
from service.errors import APIError, bad_request, from_decode_error, from_validation_error
from service.metrics import Metrics, RequestTimer
from service.protocol import SamplingFields

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServiceState:
    """The running server: its config, the engine bridge, a tokenizer and metrics."""

    config: ServiceConfig
    engine: AsyncEngine
    tokenizer: object  # the service's own instance: the engine thread uses another
    metrics: Metrics
    model_name: str
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM received: finish what runs, take nothing new

    # -- checks ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves "
                f"{self.model_name!r}", param="model", code="model_not_found",
            )

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.failure is not None:
            raise APIError(503, self.engine.failure, code="engine_dead")

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.engine.check_prompt(token_ids)
        except ValueError as exc:
            raise bad_request(f"{exc}", param=param) from None

    # -- submitting -------------------------------------------------------------------
    def submit(
        self, request_id: str, token_ids: list[int], params: SamplingParams, salt: str | None
    ) -> "TimedStream":
        """Hand a request to the engine; 429/503 are raised here, before any output."""
        try:
            stream = self.engine.generate(request_id, token_ids, params, cache_salt=salt)
        except QueueFullError as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            ) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        if self.config.log_prompts:
            logger.info("request %s: %d prompt tokens %s", request_id, len(token_ids), token_ids)
        return TimedStream(stream, self.metrics.timer())

    def salt(self, request: Request, body: SamplingFields) -> str | None:
        return cache_salt(self.config, getattr(request.state, "api_key", None), body.cache_salt)


class TimedStream:
    """A RequestStream that records latency metrics and reports a dead engine as 503."""

    def __init__(self, stream: RequestStream, timer: RequestTimer) -> None:
        self.stream = stream
        self.timer = timer

    def __aiter__(self) -> "TimedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self.stream.__anext__()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        self.timer.tokens(sum(len(c.delta_token_ids) for c in output.outputs))
        if output.finished:
            self.timer.finished()
        return output

    def close(self) -> None:
        self.stream.close()

    async def aclose(self, *_ignored) -> None:
        """Also usable as sse-starlette's client-close callback (it passes the message)."""
        self.close()


async def close_on_disconnect(request: Request, streams: list[TimedStream]):
    """Collect every stream's final output, or abort them all if the client leaves.

    A non-streaming client that disconnects would otherwise keep its request
    generating until max_tokens; uvicorn reports the disconnect as a message
    on `receive`, which is all this watches for.
    """

    async def last(stream: TimedStream) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None  # the client is gone; the finally below aborts its requests
    finally:
        for task in (work, watcher):
            task.cancel()
        for stream in streams:
            stream.close()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def parse(request: Request, kind: type):
    """Decode and validate a JSON body into `kind` (a msgspec Struct) or raise 400."""
    body = await request.body()
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


def sampling_params(
    body: SamplingFields,
    *,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
) -> SamplingParams:
    """SamplingParams for a request, refusing a length that cannot fit (vLLM's wording)."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
            f"{max_tokens} in the completion). Reduce the length of the {prompt_param} "
            f"or of the completion.",
            param="max_tokens",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    options = dict(
        n=body.n,
        max_tokens=max_tokens,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:  # None means "the default", as in OpenAI's API
            options[name] = value
    try:
        return SamplingParams(**options)
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from None
