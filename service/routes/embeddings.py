"""POST /v1/embeddings: OpenAI's embeddings, on a server started with --runner pooling.

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...],
     "encoding_format": "float" | "base64", "dimensions": n, "user": "...",
     "truncate_prompt_tokens": n, "normalize": bool, "priority": n}   (the last three vLLM's)
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
        "model": "...", "usage": {"prompt_tokens": n, "total_tokens": n}}

Each input is an engine request of its own, run together (service/serving/pooled.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.protocol.pooling import EmbeddingRequest
from service.protocol.replies import encoder
from service.serving.pooled import embed
from service.serving.pooling import serving_pooling
from service.serving.state import ServiceState, parse


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    info = serving_pooling(state, "/v1/embeddings", ("embed",))
    body = await parse(request, EmbeddingRequest)
    answer = await embed(request, state, info, body)
    if answer is None:
        return Response(status_code=499)  # nobody is listening any more
    return Response(encoder.encode(answer), media_type="application/json")
