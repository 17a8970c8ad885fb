"""The server's answers as typed objects: msgspec Structs that mirror the
OpenAI wire types the service sends (service/protocol/), decoded leniently.

The client imports nothing of the server, so it installs on its own; fields
it does not name are ignored, so a newer server never breaks an older client.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details else 0


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text

    def parsed_arguments(self):
        """The arguments as Python values."""
        return msgspec.json.decode(self.arguments)


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class Message(Struct):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # with tools and tool_choice
    # A thinking model's thought, with --reasoning-parser (vLLM now names it `reasoning`).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Struct):
    index: int
    message: Message
    finish_reason: str | None = None


class ChatCompletion(Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    created: int = 0

    @property
    def text(self) -> str:
        """The first choice's text."""
        return self.choices[0].message.content or ""

    @property
    def thought(self) -> str:
        """The first choice's reasoning ("" when the server split none out)."""
        message = self.choices[0].message
        return message.reasoning_content or message.reasoning or ""


class Delta(Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    model: str = ""


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None


class Completion(Struct):
    """A /v1/completions answer, and each chunk of its stream (same shape)."""

    id: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    model: str = ""

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""


class Model(Struct):
    id: str
    owned_by: str = ""
    max_model_len: int | None = None
    task: str = "generate"  # "generate", or a pooling server's "embed" or "classify"


class Embedding(Struct):
    index: int
    # A list of floats; the client decodes a base64 answer (Client.embed) to one.
    embedding: list[float] | str


class Embeddings(Struct):
    """A /v1/embeddings answer: one embedding per input, in the inputs' order."""

    data: list[Embedding]
    model: str = ""
    usage: Usage | None = None

    @property
    def vectors(self) -> list[list[float]]:
        return [item.embedding for item in sorted(self.data, key=lambda item: item.index)]


class RerankDocument(Struct):
    text: str


class RerankResult(Struct):
    index: int  # the document's place in the request's list
    relevance_score: float
    document: RerankDocument | None = None


class Rerank(Struct):
    """A /v1/rerank answer: the documents by relevance, best first."""

    results: list[RerankResult]
    id: str = ""
    model: str = ""
    usage: Usage | None = None

    @property
    def order(self) -> list[int]:
        """The documents' indexes, most relevant first."""
        return [result.index for result in self.results]


class ModelList(Struct):
    data: list[Model]


class Health(Struct):
    status: str  # "ok", "warming", "draining", "dead"
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"
