"""POST /v1/completions: a text prompt, token ids, or a batch of either.

Each prompt of a batch is its own engine request; choice i*n + j is sample j
of prompt i, as in OpenAI's API, and streamed choices interleave as they come
(service/serving/completions.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.protocol.replies import encoder
from service.serving.completions import (
    admission_args, completion_events, completion_response, prepare,
)
from service.serving.state import ServiceState
from service.serving.streaming import sse_response


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body, prompts, constraint = await prepare(request, state)
    admission = state.admit(request, body, prompts, id_prefix="cmpl",
                            **admission_args(body, constraint))
    if body.stream:
        return sse_response(completion_events(state, admission, body), admission,
                            state.config.sse_ping_seconds)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    return Response(encoder.encode(completion_response(state, admission, outputs, body)),
                    media_type="application/json")
