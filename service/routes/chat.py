"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from service.protocol.replies import encoder
from service.serving.chat import prepare, system_turn
from service.serving.chat_answer import chat_events, chat_response
from service.serving.reasoning import plan_reasoning
from service.serving.state import ServiceState
from service.serving.streaming import sse_response


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    prepared = await prepare(request, state)
    body, plan, constraint = prepared.body, prepared.plan, prepared.constraint
    messages, token_ids = prepared.messages, prepared.token_ids
    thinking = plan_reasoning(state.config.reasoning_parser, prepared.prompt,
                              body.chat_template_kwargs, constrained=constraint is not None)
    admission = state.admit(request, body, [token_ids], id_prefix="chatcmpl",
                            **prepared.admission_args())
    if state.fleet is not None and body.cache_salt is None and admission.lora is None:
        # A client's own salt is not recorded: no other replica could warm it;
        # nor an adapter's prompt: warming runs the base, whose blocks it never hits.
        state.fleet.observe_chat(system_turn(messages), token_ids,
                                 getattr(request.state, "api_key", None))
    if body.stream:
        return sse_response(chat_events(state, admission, body, plan, thinking), admission,
                            state.config.sse_ping_seconds)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    response = chat_response(state, admission, outputs[0], body, plan, thinking)
    return Response(encoder.encode(response), media_type="application/json")
