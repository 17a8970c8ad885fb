"""What chat and text completions share: the server's state and admit().

A route handler reads: parse -> render the prompt -> admit -> respond. admit()
does every check, builds the SamplingParams, picks the tenant's cache salt and
submits to the engine; what it returns (service/serving/admitted.py) is read as a
stream of changed choices or collected whole.

Rendering and tokenizing run on a prep thread (`off_loop`, service/serving/lanes.py),
never on the event loop: a 100,000-message chat or a megabyte prompt would
otherwise stall every stream and /health while it is worked through; grammar
compiles have a lane of their own. A text that cannot fit the context is
refused by its size before any of that work (`check_text_size`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request

from engine.errors import ValidationError
from engine.frontend.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from engine.model.lora.request import LoRARequest
from engine.outputs import RequestOutputKind
from engine.sampling_params import SamplingParams
from engine.sampling.structured_outputs import StructuredOutputsParams
from service.config import ServiceConfig
from service.errors import (
    APIError, ClientGone, bad_request, from_decode_error, from_engine_error,
    from_validation_error,
)
from service.guards.tenancy import cache_salt, check_priority_floor
from service.metrics import Metrics
from service.protocol.requests import ChatCompletionRequest, SamplingFields, served_defaults
from service.serving.admitted import Admission, TimedStream
from service.serving.lanes import Prep
from service.serving.loras import LoRARegistry
from service.serving.token_bytes import TokenBytes

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
    token_bytes: TokenBytes | None  # None when the model has no tokenizer
    metrics: Metrics
    model_name: str
    # Sampling settings a request leaves out (--generation-config).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # The prep lanes (service/serving/lanes.py): rendering and tokenizing on a few
    # threads, grammar compiles on their own, so no request's prep holds up
    # another's. (A fast tokenizer is safe to share: encoding only reads it.)
    prep: Prep = field(default_factory=Prep)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM received: finish what runs, take nothing new
    fleet: Any = None  # service.fleet.Fleet with --redis-url, else None
    # Tool calling (service/tool_calls/plan.py): whether the chat template shows the model
    # its tools, and the tool-call format tool_choice "auto" reads (None: refused).
    renders_tools: bool = False
    tool_parser: str | None = None
    loras: LoRARegistry | None = None  # the adapters served by name (None: none yet)

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = LoRARegistry(self.model_name)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a light prep thread (rendering, tokenizing); its errors re-raise here."""
        return await self.prep.light.run(fn, *args)

    def check_text_size(self, size: int, param: str) -> None:
        """Refuse a text of `size` characters that cannot fit the context, untokenized.

        No token covers more than `token_bytes.longest` bytes, hence characters,
        so such a text is at least size / longest tokens (safe from any thread).
        """
        if self.token_bytes is None:
            return
        limit = self.engine.config.max_model_len
        fewest = self.token_bytes.min_tokens(size)
        if fewest >= limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens; {size} characters "
                f"of {param} are at least {fewest} tokens. Reduce the length of the {param}.",
                param=param,
            )

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
        constraint: StructuredOutputsParams | None = None,
    ) -> Admission:
        """Check a parsed request and hand its prompts to the engine.

        Every refusal is raised here as an APIError, before any output: the
        model name (404), a draining or dead engine (503), a prompt or
        sampling value the engine cannot take (400), a full queue (429).
        """
        self.check_accepting()
        all_params, salt, lora = self.validate(request, body, prompts, prompt_param=prompt_param,
                                               max_tokens=max_tokens, logprobs=logprobs,
                                               constraint=constraint)
        request_id = new_id(id_prefix)
        streams: list[TimedStream] = []
        try:
            for i, (token_ids, params) in enumerate(zip(prompts, all_params)):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self._submit(engine_id, token_ids, params, salt, body.priority,
                                            lora))
        except BaseException:
            for stream in streams:  # a later prompt was refused (429): drop the earlier ones
                stream.close()
            raise
        return Admission(request_id, streams, self.loras.model_name(lora), lora)

    def validate(self, request: Request, body: SamplingFields, prompts: list[list[int]], *,
                 prompt_param: str, max_tokens: int | None, logprobs: int | None,
                 constraint: StructuredOutputsParams | None = None,
                 ) -> tuple[list[SamplingParams], str | None, LoRARequest | None]:
        """admit()'s checks without the engine (the render routes): the model name
        (404) and each prompt's SamplingParams (400); the tenant's cache salt and
        the LoRA adapter the model name selects (None: the base model)."""
        lora = self.check_model(body.model)
        api_key = getattr(request.state, "api_key", None)
        self.check_priority(body.priority, api_key)
        all_params = [
            self._sampling_params(body, token_ids, prompt_param, max_tokens, logprobs, constraint)
            for token_ids in prompts
        ]
        return all_params, cache_salt(self.config, api_key, body.cache_salt), lora

    async def drain(self, grace_seconds: float) -> None:
        """SIGTERM: admit nothing new, let open requests run up to `grace_seconds`,
        then end those still open with a 503 error (in-band for a stream, then
        [DONE]). /health answers 503 "draining" meanwhile, as the listener
        stays open until this returns."""
        self.draining = True
        if self.fleet is not None:
            self.fleet.announce()  # routers reading Redis hear it now, not a heartbeat later
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self.engine.num_open and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_open:
            logger.warning("shutdown grace of %gs is over: ending %d open request(s)",
                           grace_seconds, self.engine.num_open)
            self.engine.fail_open(APIError(
                503, f"the server is shutting down and its grace period "
                f"({grace_seconds:g} s) is over", code="shutting_down"))

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for other names."""
        return self.loras.resolve(model)

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.failure is not None:
            raise APIError(503, self.engine.failure, code="engine_dead")
        if self.fleet is not None and self.fleet.warming:
            # Not ready, as /health says: a load balancer that sent this anyway
            # (nginx learns only from answers) retries it on another replica.
            raise APIError(503, "this replica is warming its prefix cache; retry shortly",
                           code="warming",
                           headers={"Retry-After": str(self.config.retry_after_seconds)})

    def _sampling_params(self, body, token_ids, prompt_param, max_tokens, logprobs, constraint):
        try:
            self.engine.check_prompt(token_ids)
            params = sampling_params(
                body, prompt_len=len(token_ids), max_model_len=self.engine.config.max_model_len,
                max_tokens=max_tokens, logprobs=logprobs, prompt_param=prompt_param,
                defaults=self.sampling_defaults, structured_outputs=constraint,
            )
            self.engine.check_params(params)  # a constraint compiled already (off the loop)
        except ValidationError as exc:
            raise from_engine_error(exc, request_fields(body, prompt_param)) from None
        return params

    def check_priority(self, priority: int, api_key: str | None) -> None:
        """400 for a priority the scheduling policy ignores; 403 for one more urgent
        than the request's key may ask for (service/guards/tenancy.py)."""
        if priority and self.engine.config.scheduling_policy != "priority":
            raise bad_request("priority needs a server started with --scheduling-policy "
                              "priority", param="priority")
        check_priority_floor(self.config, api_key, priority)

    def _submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
                salt: str | None, priority: int = 0,
                lora: LoRARequest | None = None) -> TimedStream:
        try:
            # The whole LoRARequest, every time: the engine may have let the
            # adapter's weights go and reads them again from its path.
            stream = self.engine.generate(request_id, token_ids, params, cache_salt=salt,
                                          priority=priority, lora_request=lora)
        except QueueFullError as exc:
            raise APIError(
                429, f"the server is busy: {exc}; retry later", code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            ) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        if self.config.log_prompts:
            logger.info("request %s: %d prompt tokens %s", request_id, len(token_ids), token_ids)
        return TimedStream(stream, self.metrics.timer(), params.n)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def parse(request: Request, kind: type,
                precheck: Callable[[bytes], None] | None = None):
    """Decode and validate a JSON body into `kind` (a msgspec Struct) or raise 400.

    `precheck(body)` may refuse it first, by what it can read without decoding
    the rest (service/guards/limits.py: 3,000 tools take 28 ms to decode, holding the
    interpreter, and are counted in 0.3 ms).

    Whatever a client sends ends here as a 4xx, never as a 500 with a
    traceback: a declared non-JSON body (415), invalid UTF-8 or nesting
    deeper than the decoder's recursion limit (400 invalid_json), a client
    that hangs up mid-upload (ClientGone, answered quietly).
    """
    check_content_type(request)
    try:
        body = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    if precheck is not None:
        precheck(body)
    if len(body) <= DECODE_ON_LOOP_BYTES:
        parsed = decode(body, kind)
    else:  # megabytes of JSON take tens of ms to decode, all holding the interpreter
        parsed = await anyio.to_thread.run_sync(decode, body, kind)
    unserved = served_defaults(parsed)
    if unserved is not None:
        raise bad_request(f"{unserved}={getattr(parsed, unserved)!r} is not served here",
                          param=unserved, code="unsupported_parameter")
    return parsed


# Bodies up to this size decode on the event loop: a thread hop costs more.
DECODE_ON_LOOP_BYTES = 64 << 10


def decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise from_decode_error(exc) from None


def check_content_type(request: Request) -> None:
    """Refuse a body declared as something other than JSON (no header: read as JSON)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        return
    raise APIError(
        415, f"the request body must be JSON, sent as 'Content-Type: application/json' "
        f"(got {media_type or 'an empty Content-Type'!r})", code="unsupported_media_type",
    )


def sampling_params(
    body: SamplingFields,
    *,
    prompt_len: int,
    max_model_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    defaults: dict[str, float] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for a request, refusing a length that cannot fit (vLLM's wording).

    A sampling setting the request leaves out takes `defaults` (the model's
    generation config), else SamplingParams' own.
    """
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
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs are not available with stream=true (as in vLLM)",
                          "prompt_logprobs")
    options = dict(
        n=body.n,
        max_tokens=max_tokens,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(body, logprobs),
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
        logit_bias=_logit_bias(body.logit_bias),
        structured_outputs=structured_outputs,
        # Only what is new: the engine copies no cumulative lists step after
        # step, and a whole answer is folded from the deltas (Admission), so
        # every token is timed as it arrives, streamed or not.
        output_kind=RequestOutputKind.DELTA,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is None:  # None means "the default", as in OpenAI's API
            value = (defaults or {}).get(name)
        if value is not None:
            options[name] = value
    return SamplingParams(**options)  # a ValidationError names the field it refuses


def request_fields(body: SamplingFields, prompt_param: str) -> dict[str, str]:
    """The request's own name for each engine field it spells differently."""
    fields = {"prompt": prompt_param}
    if isinstance(body, ChatCompletionRequest):  # chat sets these under other names
        fields["logprobs"] = "top_logprobs"
        if body.max_completion_tokens is not None:
            fields["max_tokens"] = "max_completion_tokens"
    return fields


def _prompt_logprobs(body: SamplingFields, logprobs: int | None) -> int | None:
    """vLLM's prompt_logprobs; completions' echo with logprobs: k needs them too
    (service/serving/echo.py), with at least k top tokens."""
    wanted = body.prompt_logprobs
    if getattr(body, "echo", False) and logprobs is not None:
        wanted = max(wanted or 0, logprobs)
    return wanted


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings: back to ints."""
    if bias is None:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          param="logit_bias") from None
