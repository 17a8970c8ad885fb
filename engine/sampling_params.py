"""Per-request sampling settings, with vLLM-compatible names and defaults.

The object is validated once at construction so that the sampler and the
scheduler can trust every field without re-checking it on the hot path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from engine.errors import ValidationError
from engine.outputs import RequestOutputKind
from engine.sampling.structured_outputs import StructuredOutputsParams

# Below this temperature the softmax is numerically a one-hot, so sampling
# would only add noise (and risk overflow when dividing by it): take argmax.
GREEDY_TEMPERATURE = 1e-5

# The sampler works in float32: a positive setting below its smallest normal
# number (2**-126, about 1.2e-38) would round to 0 there (top_p = 1e-300 would
# mask every token), so such values are refused here, once, for every caller.
FLOAT32_TINY = 2.0**-126

# OpenAI caps top logprobs at 20; allowing more would let one request make the
# sampler do a large top-k over the vocabulary on every step.
MAX_LOGPROBS = 20

_INT32_MAX = 2**31 - 1
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob (the first's is None) with
    # this many top tokens beside it, from the prefill's raw logits. Such a request
    # recomputes its prompt: it takes no prefix-cache hits (it still fills the cache).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to its
    # logit before sampling (greedy included); -100 all but bans a token.
    logit_bias: dict[int, float] | None = None
    # A JSON schema, regex, choice or grammar the output must match
    # (engine/sampling/structured_outputs.py); a dict of its fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    # What each output carries (engine/outputs.py): everything so far, only
    # what is new (streaming), or nothing until the end (whole answers).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # The dataclass is frozen so that a request's settings cannot change
        # under the engine; normalisation therefore goes through
        # object.__setattr__, once, before anyone can observe the object.
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if isinstance(self.structured_outputs, dict):
            try:
                constraint = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValidationError(f"structured_outputs: {exc}", "structured_outputs") from None
            object.__setattr__(self, "structured_outputs", constraint)
        if self.top_k == -1:
            # vLLM and HF both use -1 for "disabled"; keep one spelling inside.
            object.__setattr__(self, "top_k", 0)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1, allowed="an integer >= 1")
        _check_float("temperature", self.temperature, lambda v: v >= 0, "a number >= 0")
        _check_float("top_p", self.top_p, lambda v: FLOAT32_TINY <= v <= 1,
                     f"a number in [{FLOAT32_TINY:.3g}, 1] (float32's smallest normal number "
                     f"and up)")
        # A top_k past any vocabulary keeps every token; the bound keeps it a
        # tensor element (a 2**80 once reached the sampler and stopped the engine).
        _check_int("top_k", self.top_k, minimum=0, maximum=_INT32_MAX,
                   allowed=f"an integer from 0 to {_INT32_MAX}, or -1 to disable")
        _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, lambda v: v >= FLOAT32_TINY,
                     f"a number >= {FLOAT32_TINY:.3g} (float32's smallest normal number)")
        # 0: the prompt is computed (its prompt_logprobs, if asked) and nothing is
        # generated; finish_reason "length". The service allows it with echo only.
        _check_int("max_tokens", self.max_tokens, minimum=0, allowed="an integer >= 0")
        _check_int(
            "min_tokens",
            self.min_tokens,
            minimum=0,
            maximum=self.max_tokens,
            allowed=f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        if self.logprobs is not None:
            _check_int(
                "logprobs",
                self.logprobs,
                minimum=0,
                maximum=MAX_LOGPROBS,
                allowed=f"None or an integer in [0, {MAX_LOGPROBS}]",
            )
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=MAX_LOGPROBS,
                       allowed=f"None or an integer in [0, {MAX_LOGPROBS}] (-1, the whole "
                               f"vocabulary, is not served)")
        if self.seed is not None:
            _check_int(
                "seed", self.seed, minimum=_SEED_MIN, maximum=_SEED_MAX,
                allowed="None or an integer in [-2**63, 2**64 - 1]",
            )
        constraint = self.structured_outputs
        if constraint is not None and not isinstance(constraint, StructuredOutputsParams):
            raise ValidationError(f"structured_outputs must be a StructuredOutputsParams, got "
                                  f"{constraint!r}", "structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValidationError(f"output_kind must be a RequestOutputKind, got "
                                  f"{self.output_kind!r}", "output_kind")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(f"{name} must be a bool, got {getattr(self, name)!r}", name)


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a token count is always a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    name: str, value: Any, *, minimum: int, allowed: str, maximum: int | None = None
) -> None:
    in_range = _is_int(value) and value >= minimum and (maximum is None or value <= maximum)
    if not in_range:
        raise ValidationError(f"{name} must be {allowed}, got {value!r}", name)


def _check_float(
    name: str, value: Any, in_range: Callable[[float], bool], allowed: str
) -> None:
    # The type test comes first so a string gets a ValueError naming the field
    # rather than a TypeError from the comparison; isfinite rejects NaN and inf.
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and in_range(value)):
        raise ValidationError(f"{name} must be {allowed}, got {value!r}", name)


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)):
        raise ValidationError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    for item in strings:
        # An empty stop string would match at every position and end every
        # request immediately, which is never what a caller meant.
        if not isinstance(item, str) or not item:
            raise ValidationError(f"stop must contain only non-empty strings, got {item!r}",
                                  "stop")
    return list(strings)


MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def _normalise_logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValidationError(f"logit_bias must map token ids to numbers, got {bias!r}",
                              "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} token ids, "
                              f"got {len(bias)}", "logit_bias")
    for token_id, value in bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise ValidationError(f"logit_bias keys must be token ids (integers >= 0), got "
                                  f"{token_id!r}", "logit_bias")
        _check_float("logit_bias", value, lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                     f"a map of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    return {int(t): float(v) for t, v in bias.items()}


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValidationError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}",
                              "stop_token_ids")
    for item in ids:
        if not _is_int(item) or item < 0:
            raise ValidationError(f"stop_token_ids must be a list of integers >= 0, got "
                                  f"{item!r}", "stop_token_ids")
    return list(ids)
