"""POST /reset_prefix_cache and GET /openapi.json."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from engine.frontend.async_engine import EngineDeadError
from service.errors import APIError
from service.protocol.replies import encoder


async def reset_prefix_cache(request: Request) -> Response:
    """Drop every cached block no request holds (benchmarks reset between runs)."""
    state = request.app.state.service
    try:
        # Block tables belong to the engine thread: the reset runs there, between steps.
        await state.engine.call(lambda engine: engine.reset_prefix_cache())
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    return Response(encoder.encode({"status": "ok"}), media_type="application/json")


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")
