"""Probes and Prometheus: GET /health (readiness), GET /live (liveness), GET /metrics.

    /health   200 when this replica should get traffic; 503 while it warms the
              fleet's prefixes, drains after SIGTERM, or after an engine fault
    /live     200 while the process can serve at all (warming and draining
              included); 503 only once the engine is dead: restarting helps then
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from service.protocol.replies import Health, encoder


async def health(request: Request) -> Response:
    """200 while the engine thread runs and the server admits requests; 503 otherwise."""
    state = request.app.state.service
    failure = state.engine.failure
    if state.draining and state.engine.fault is None:
        status = Health("draining", "the server is shutting down")
    elif failure is not None:
        status = Health("dead", failure)
    elif state.fleet is not None and state.fleet.warming:
        status = Health("warming", "prefilling the fleet's popular system prompts")
    else:
        status = Health("ok")
    code = 200 if status.status == "ok" else 503
    return Response(encoder.encode(status), status_code=code, media_type="application/json")


async def live(request: Request) -> Response:
    """Liveness: a dead engine needs a restart; a warming or draining one does not."""
    state = request.app.state.service
    if state.engine.fault is not None:
        status = Health("dead", state.engine.fault)
    else:
        status = Health("ok")
    code = 200 if status.status == "ok" else 503
    return Response(encoder.encode(status), status_code=code, media_type="application/json")


async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
