"""GET /health (for load balancers and Kubernetes probes) and GET /metrics (Prometheus)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from service.protocol import Health, encoder


async def health(request: Request) -> Response:
    """200 while the engine thread runs and the server admits requests; 503 otherwise."""
    state = request.app.state.service
    failure = state.engine.failure
    if state.draining and state.engine.error is None:
        status = Health("draining", "the server is shutting down")
    elif failure is not None:
        status = Health("dead", failure)
    else:
        status = Health("ok")
    code = 200 if status.status == "ok" else 503
    return Response(encoder.encode(status), status_code=code, media_type="application/json")


async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
