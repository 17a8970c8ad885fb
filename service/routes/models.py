"""GET /v1/models and GET /v1/models/{id}: the base model and its LoRA adapters.

As vLLM lists them: the base model's card, then one per adapter with
`parent` the base model's name and `root` the adapter's folder; `task` (ours)
says what the model serves: "generate", or a pooling model's "embed" or "classify".
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from engine.model.lora.request import LoRARequest
from service.protocol.replies import ModelCard, ModelList, encoder
from service.serving.state import ServiceState


def _card(state: ServiceState, lora: LoRARequest | None = None) -> ModelCard:
    return ModelCard(
        id=state.loras.model_name(lora),
        created=state.created,
        owned_by="pagedserve",
        max_model_len=state.config.engine.max_model_len,
        root=state.config.engine.model if lora is None else lora.lora_path,
        parent=None if lora is None else state.model_name,
        task="generate" if state.engine.pooling is None else state.engine.pooling.task,
    )


async def list_models(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    cards = [_card(state), *(_card(state, lora) for lora in state.loras.adapters.values())]
    return Response(encoder.encode(ModelList(cards)), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """OpenAI's `models.retrieve(id)`: the card, or 404 for another id."""
    state: ServiceState = request.app.state.service
    lora = state.check_model(request.path_params["model_id"])  # 404 model_not_found
    return Response(encoder.encode(_card(state, lora)), media_type="application/json")
