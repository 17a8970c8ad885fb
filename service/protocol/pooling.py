"""The wire types of the pooling routes: embeddings, /pooling, /classify, /score, /rerank.

    /v1/embeddings   OpenAI's shape (input, encoding_format, dimensions, user), with
                     vLLM's extras (truncate_prompt_tokens, normalize, priority)
    /pooling         vLLM's: one `data` per input, the model's own output
    /classify        vLLM's ClassificationResponse: label, probs, num_classes per input
    /score           vLLM's: text_1 against text_2 (1:N or N:N), a score per pair
    /rerank          Jina's and Cohere's (as vLLM serves them): a query and documents,
                     results by relevance, best first

Every request type forbids unknown fields (service/protocol/requests.py says why):
an option this server does not serve is a 400 naming it, never dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from service.protocol.requests import Priority

# A text, a list of texts, token ids, or a list of token-id lists (which of them
# is told apart in service/serving/pooling.py: msgspec unions allow one array type).
EmbedInput = str | Annotated[list[Any], Meta(min_length=1)]
Texts = str | Annotated[list[str], Meta(min_length=1)]


class PoolingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """What every pooling request takes."""

    model: str | None = None
    user: str | None = None  # accepted, as OpenAI's: nothing is stored per user
    # vLLM's: keep only this many tokens of each input (-1: as many as the model
    # takes); None: an input that is too long is a 400.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    priority: Priority = 0  # vLLM's: with --scheduling-policy priority, lower runs first
    # Mixed into the tenant's salt (service/guards/tenancy.py): a decoder embedder
    # shares cached prefixes only within it.
    cache_salt: str | None = None


class EmbeddingRequest(PoolingFields, kw_only=True):
    input: EmbedInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first n, then normalised again
    normalize: bool | None = None  # vLLM's; None: the model's own setting
    # sentence-transformers' prompt name (config_sentence_transformers.json:
    # "query", ...); None: the model's default prompt.
    prompt_name: str | None = None


class PoolingRequest(EmbeddingRequest, kw_only=True):
    task: Literal["embed", "classify"] | None = None  # None: what the model does
    use_activation: bool | None = None  # classify: softmax/sigmoid (None: the model's)


class ClassificationRequest(PoolingFields, kw_only=True):
    input: EmbedInput
    use_activation: bool | None = None


class ScoreRequest(PoolingFields, kw_only=True):
    text_1: Texts
    text_2: Texts
    use_activation: bool | None = None  # a cross-encoder's sigmoid (None: the model's)


class RerankRequest(PoolingFields, kw_only=True):
    query: str
    documents: Annotated[list[str], Meta(min_length=1)]
    top_n: Annotated[int, Meta(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True  # vLLM always returns them; Cohere's clients may not
    use_activation: bool | None = None


POOLING_REQUEST_TYPES = (EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest,
                         RerankRequest)


# -- answers ---------------------------------------------------------------------
class PoolingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class Embedding(Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI's
    object: Literal["embedding"] = "embedding"


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class PoolingData(Struct):
    index: int
    data: list[float] | str
    object: Literal["pooling"] = "pooling"


class PoolingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class ClassificationData(Struct):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class ScoreData(Struct):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # left out with return_documents=false


class RerankResponse(Struct):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


POOLING_RESPONSE_TYPES = (EmbeddingResponse, PoolingResponse, ClassificationResponse,
                          ScoreResponse, RerankResponse)

