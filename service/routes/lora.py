"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's run-time LoRA routes.

    load    {"lora_name": "sql", "lora_path": "/adapters/sql"}
            -> 200 "Success: LoRA adapter 'sql' added successfully."
    unload  {"lora_name": "sql"}  (vLLM's optional "lora_int_id" too)
            -> 200 "Success: LoRA adapter 'sql' removed successfully."

Present only with --allow-runtime-lora-updating, behind the admin key. A name
already served, or a folder that does not fit the model, is a 400 (`param`
lora_name / lora_path); an unknown name to unload a 404. Requests running
under an adapter being unloaded finish (the engine defers the removal); new
ones naming it get 404 at once (service/serving/loras.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from service.errors import bad_request
from service.protocol.requests import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from service.serving.state import ServiceState, parse


async def load_lora_adapter(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, LoadLoRAAdapterRequest)
    _require(body, "lora_name", "lora_path")
    await state.loras.load(state.engine, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, UnloadLoRAAdapterRequest)
    _require(body, "lora_name")
    await state.loras.unload(state.engine, body.lora_name, body.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _require(body, *names: str) -> None:
    """A missing or empty field is a 400 naming it (msgspec would leave `param` out)."""
    for name in names:
        if not getattr(body, name):
            raise bad_request(f"'{name}' must be provided", param=name,
                              code="missing_required_parameter")
