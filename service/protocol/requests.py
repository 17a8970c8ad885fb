"""The OpenAI wire types of requests, as msgspec Structs (answers: replies.py).

msgspec decodes and validates a request body in one pass (types, ranges,
enums) and encodes responses without building dicts first, which matters on
the streaming path where every token becomes one JSON chunk. The same Structs
generate `/openapi.json` (see service/openapi.py), so the published schema and
the validation are one thing and cannot drift apart.

A request's unknown top-level field is a 400 naming it, as OpenAI answers
(`forbid_unknown_fields`): an option this server does not serve must never
be dropped silently (an unconstrained answer to a request that asked for a
constraint looks like success). Nested objects (messages, tools) stay lenient:
SDKs send back an assistant turn with the extra fields they received.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from engine.sampling_params import MAX_LOGPROBS

# Ranges follow OpenAI's API reference where it gives one, vLLM's otherwise.
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
MinP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
MaxTokens = Annotated[int, Meta(ge=1)]
# torch seeds go to 2**64 - 1, but msgspec bounds must fit an int64.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0)]
# n samples share one prompt; more than this is a way to fill the server
# with a single request rather than a real use.
NumChoices = Annotated[int, Meta(ge=1, le=16)]
StopStrings = str | Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# OpenAI's logit_bias: token ids as JSON object keys (strings), biases in [-100, 100].
LogitBias = dict[str, Annotated[float, Meta(ge=-100, le=100)]]
# vLLM bounds `priority` not at all; a server shared by tenants takes a signed
# 32-bit value (what schedulers' priority fields hold): -1e18 or 2**63 is a
# mistake or a probe, never a scheme. Keys that are not admin keys get a floor
# on top (--min-priority-non-admin, service/guards/tenancy.py).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
Priority = Annotated[int, Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)]


# -- requests ------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = False
    # vLLM's: every chunk also carries the usage so far (with include_usage).
    continuous_usage_stats: bool = False

    @property
    def usage_per_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class TextPart(Struct):
    type: Literal["text"]
    text: str


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct):
    """A call the assistant made: in a response, and in the history a client sends back."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers
    # An assistant turn's thought, as this server returns it (either name): the
    # template gets it as `reasoning_content`, Qwen3's name, and shows it or not.
    reasoning_content: str | None = None
    reasoning: str | None = None


# OpenAI's rule for function names (service/tool_calls/plan.py).
FunctionName = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None  # accepted; the output is always held to the schema


class Tool(Struct):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Struct):
    name: str


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """Options shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    n: NumChoices = 1
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: LogitBias | None = None
    # Mixed into the server's per-tenant salt, never used alone (see service/guards/tenancy.py).
    cache_salt: str | None = None
    # vLLM's: with --scheduling-policy priority, lower values run first.
    priority: Priority = 0
    # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    # (service/serving/constraints.py).
    structured_outputs: dict[str, Any] | None = None
    # text, json_object or json_schema (service/serving/constraints.py); vLLM takes it on
    # both routes too.
    response_format: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs' json, regex, choice and grammar.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's router (vllm-router) adds these to every body it forwards, at the
    # values below (SGLang's names). `no_stop_trim` is served (it keeps the stop
    # string, as include_stop_str_in_output does); the others only at those
    # values: served_defaults() refuses any other by name.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: service/serving/echo.py


# The router's additions this server takes only at their defaults (see above).
ROUTER_DEFAULTS = {"return_hidden_states": False, "continue_final_message": False,
                   "separate_reasoning": True, "stream_reasoning": True,
                   "include_reasoning": True}


def served_defaults(body: SamplingFields) -> str | None:
    """The first router-added field set to a value this server does not serve."""
    for name, default in ROUTER_DEFAULTS.items():
        if getattr(body, name, default) != default:
            return name
    return None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    # Tool calling (service/tool_calls/plan.py); tool_choice defaults to "auto" with tools.
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # More variables for the chat template, as vLLM's: {"enable_thinking": false}
    # (engine/frontend/chat_template.py check_template_kwargs).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's deprecated form of tools: decoded only to refuse it by name.
    functions: list[Any] | None = None
    function_call: Any | None = None
    # More that vllm-router adds (see SamplingFields), served at these values only.
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True


# A text prompt, a list of token ids, or a batch of either (checked in
# service/serving/completions.py: msgspec unions allow only one array type).
PromptInput = str | Annotated[list[Any], Meta(min_length=1)]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: PromptInput
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0: only with echo
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None


# -- /tokenize and /detokenize (service/routes/tokenize.py) --------------------------
class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt`
    or `messages` (with what chat serving renders them with)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, as serving
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0)]]


# -- /v1/load_lora_adapter and /v1/unload_lora_adapter (service/routes/lora.py) -----
# vLLM's fields. Each is optional here so that a missing one is a 400 naming it
# (service/routes/lora.py); the schema (service/openapi.py) marks them required.
class LoadLoRAAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_int_id: Annotated[int, Meta(ge=1)] | None = None  # if given, it must be the name's


REQUEST_TYPES = (ChatCompletionRequest, CompletionRequest)
