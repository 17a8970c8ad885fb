"""POST /pooling, /classify, /score and /rerank (/v1/rerank, /v2/rerank): vLLM's
pooling routes, on a server started with --runner pooling.

    /pooling   {"input": ..., "task"?: "embed" | "classify"}
               -> {"data": [{"index": i, "object": "pooling", "data": [...]}], "usage": ...}
    /classify  {"input": ...}
               -> {"data": [{"index": i, "label": "...", "probs": [...], "num_classes": n}]}
    /score     {"text_1": "..." | [...], "text_2": "..." | [...]}
               -> {"data": [{"index": i, "object": "score", "score": s}], "usage": ...}
    /rerank    {"query": "...", "documents": [...], "top_n"?: n, "return_documents"?: bool}
               -> {"results": [{"index": j, "relevance_score": s, "document": {"text": ...}}],
                   "usage": ...}   best first

A classifier (cross-encoder) scores each pair itself; an embedding model's score
is the cosine similarity of the two embeddings (service/serving/scoring.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.protocol.pooling import (
    ClassificationRequest, PoolingRequest, RerankRequest, ScoreRequest,
)
from service.protocol.replies import encoder
from service.serving import pooled, scoring
from service.serving.pooling import serving_pooling
from service.serving.state import ServiceState, parse


async def pooling(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    info = serving_pooling(state, "/pooling")
    body = await parse(request, PoolingRequest)
    return _answer(await pooled.pool(request, state, info, body))


async def classify(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    info = serving_pooling(state, "/classify", ("classify",))
    body = await parse(request, ClassificationRequest)
    return _answer(await pooled.classify(request, state, info, body))


async def score(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    info = serving_pooling(state, "/score")
    body = await parse(request, ScoreRequest)
    return _answer(await scoring.score(request, state, info, body))


async def rerank(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    info = serving_pooling(state, request.url.path)
    body = await parse(request, RerankRequest)
    return _answer(await scoring.rerank(request, state, info, body))


def _answer(answer) -> Response:
    if answer is None:
        return Response(status_code=499)  # the client left: nobody is listening
    return Response(encoder.encode(answer), media_type="application/json")
