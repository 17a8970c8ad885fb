"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.protocol import ModelCard, ModelList, encoder


async def list_models(request: Request) -> Response:
    state = request.app.state.service
    card = ModelCard(
        id=state.model_name,
        created=state.created,
        owned_by="pagedserve",
        max_model_len=state.config.engine.max_model_len,
        root=state.config.engine.model,
    )
    return Response(encoder.encode(ModelList([card])), media_type="application/json")
