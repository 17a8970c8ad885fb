"""GET /health (for load balancers and Kubernetes probes) and GET /metrics (Prometheus)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from service.protocol import Health, encoder


async def health(request: Request) -> Response:
    """200 while the engine thread runs and the server admits requests; 503 otherwise."""
    state = request.app.state.service
    engine = state.engine
    if engine.error is not None:
        status = Health("dead", f"the engine stopped after an error: {engine.error!r}")
    elif state.draining:
        status = Health("draining", "the server is shutting down")
    elif not engine.is_alive:
        status = Health("dead", "the engine is not running")
    else:
        status = Health("ok")
    code = 200 if status.status == "ok" else 503
    return Response(encoder.encode(status), status_code=code, media_type="application/json")


async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
