"""What chat and text completions share: the server's state and admit().

A route handler reads: parse -> render the prompt -> admit -> respond. admit()
does every check, builds the SamplingParams, picks the tenant's cache salt and
submits to the engine; what it returns (service/admission.py) is read as a
stream of changed choices or collected whole.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from engine.sampling_params import SamplingParams
from service.admission import Admission, TimedStream
from service.auth import cache_salt
from service.config import ServiceConfig
from service.errors import APIError, bad_request, from_decode_error, from_validation_error
from service.metrics import Metrics
from service.protocol import SamplingFields

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ServiceState:
    """The running server: its config, the engine bridge, a tokenizer and metrics.

    `config.engine` is the engine's resolved config (max_model_len, dtype
    filled in from the model), the same object as `engine.config`.
    """

    config: ServiceConfig
    engine: AsyncEngine
    tokenizer: object  # the service's own instance: the engine thread uses another
    metrics: Metrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM received: finish what runs, take nothing new

    def admit(
        self,
        request: Request,
        body: SamplingFields,
        prompts: list[list[int]],
        *,
        id_prefix: str,
        prompt_param: str,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> Admission:
        """Check a parsed request and hand its prompts to the engine.

        Every refusal is raised here as an APIError, before any output: the
        model name (404), a draining or dead engine (503), a prompt or
        sampling value the engine cannot take (400), a full queue (429).
        """
        self._check_model(body.model)
        self._check_accepting()
        all_params = [
            self._sampling_params(body, token_ids, prompt_param, max_tokens, logprobs)
            for token_ids in prompts
        ]
        request_id = new_id(id_prefix)
        salt = cache_salt(self.config, getattr(request.state, "api_key", None), body.cache_salt)
        streams: list[TimedStream] = []
        try:
            for i, (token_ids, params) in enumerate(zip(prompts, all_params)):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self._submit(engine_id, token_ids, params, salt))
        except BaseException:
            for stream in streams:  # a later prompt was refused (429): drop the earlier ones
                stream.close()
            raise
        return Admission(request_id, streams)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves "
                f"{self.model_name!r}", param="model", code="model_not_found",
            )

    def _check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.failure is not None:
            raise APIError(503, self.engine.failure, code="engine_dead")

    def _sampling_params(self, body, token_ids, prompt_param, max_tokens, logprobs):
        try:
            self.engine.check_prompt(token_ids)
        except ValueError as exc:
            raise bad_request(f"{exc}", param=prompt_param) from None
        return sampling_params(
            body, prompt_len=len(token_ids), max_model_len=self.engine.config.max_model_len,
            max_tokens=max_tokens, logprobs=logprobs, prompt_param=prompt_param,
        )

    def _submit(
        self, request_id: str, token_ids: list[int], params: SamplingParams, salt: str | None
    ) -> TimedStream:
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
