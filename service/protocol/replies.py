"""The OpenAI wire types of answers (chat, completions, models, errors, health) and
the one JSON encoder every response goes through."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from service.protocol.logprob_types import PromptLogprobs
from service.protocol.requests import ToolCall


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None


class AssistantMessage(Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None  # null when the turn is only tool calls, or only a thought
    tool_calls: list[ToolCall] | None = None
    # With --reasoning-parser, the thought (service/serving/reasoning.py) under both of
    # its names: DeepSeek's and vLLM's first, and vLLM's newer `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # as AssistantMessage's
    reasoning: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: on each choice


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    root: str  # the base model's path; an adapter's folder
    object: Literal["model"] = "model"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); null for the base
    # What the model serves: "generate" (chat, completions, responses), or with
    # --runner pooling "embed" (/v1/embeddings) or "classify" (/classify);
    # both of those also serve /pooling, /score and /rerank.
    task: Literal["generate", "embed", "classify"] = "generate"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(Struct):
    error: ErrorInfo


class Health(Struct):
    status: Literal["ok", "starting", "warming", "draining", "dead"]
    detail: str | None = None


# One encoder for every response: it is reusable and thread-safe.
encoder = msgspec.json.Encoder()

RESPONSE_TYPES = (
    ChatCompletionResponse, ChatCompletionChunk, CompletionResponse, ModelList, ErrorResponse,
    Health,
)
