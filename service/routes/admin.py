"""POST /reset_prefix_cache, GET /openapi.json, GET / (a page until the web client lands)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from engine.async_engine import EngineDeadError
from service.errors import APIError
from service.protocol import encoder


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


INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pagedserve</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>pagedserve</h1>
<p>Serving <code>{model}</code>. The OpenAI-compatible API is at <code>/v1</code>:
<code>POST /v1/chat/completions</code>, <code>POST /v1/completions</code>,
<code>GET /v1/models</code>; see <a href="/openapi.json">/openapi.json</a>,
<a href="/health">/health</a> and <a href="/metrics">/metrics</a>.</p>
</body></html>
"""


async def index(request: Request) -> Response:
    model = request.app.state.service.model_name
    return HTMLResponse(INDEX.format(model=model.replace("<", "&lt;")))
