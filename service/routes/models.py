"""GET /v1/models and GET /v1/models/{id}: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.errors import APIError
from service.protocol.replies import ModelCard, ModelList, encoder


def _card(state) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.created,
        owned_by="pagedserve",
        max_model_len=state.config.engine.max_model_len,
        root=state.config.engine.model,
    )


async def list_models(request: Request) -> Response:
    card = _card(request.app.state.service)
    return Response(encoder.encode(ModelList([card])), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """OpenAI's `models.retrieve(id)`: the card, or 404 for another id."""
    state = request.app.state.service
    model_id = request.path_params["model_id"]
    if model_id != state.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                       f"{state.model_name!r}", param="model", code="model_not_found")
    return Response(encoder.encode(_card(state)), media_type="application/json")
