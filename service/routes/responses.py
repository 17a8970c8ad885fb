"""POST /v1/responses: OpenAI's Responses API on the chat machinery.

    body ──► ResponsesRequest ──► refuse_unserved ──► to_chat (responses/input.py)
         ──► tools plan, text.format constraint, chat template (as chat renders it)
         ──► admit ──► a ResponseObject (JSON), or its events (responses/events.py)

Nothing is stored: store=false semantics (store true and previous_response_id
are 400s naming them), so there is no GET /v1/responses/{id}. The output
items are read out of the text as chat reads its message: a thought
(--reasoning-parser) becomes a reasoning item, the answer a message item,
tool calls function_call items, in that order.
"""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from service.errors import APIError
from service.guards.limits import check_chat_body
from service.protocol.replies import encoder
from service.responses.events import finished, response_events
from service.responses.input import refuse_unserved, translated
from service.responses.protocol import ResponsesRequest
from service.responses.serving import output_items, prepare, response_head
from service.serving.chat import system_turn
from service.serving.reasoning import plan_reasoning
from service.serving.state import ServiceState, parse
from service.serving.streaming import sse_response


async def create(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body = await parse(request, ResponsesRequest, partial(check_chat_body, state))
    refuse_unserved(body)
    prepared, sources = await prepare(request, state, body)
    thinking = plan_reasoning(state.config.reasoning_parser, prepared.prompt,
                              constrained=prepared.constraint is not None)
    try:
        admission = state.admit(request, prepared.body, [prepared.token_ids], id_prefix="resp",
                                prompt_param="input", max_tokens=body.max_output_tokens,
                                logprobs=None, constraint=prepared.constraint)
    except APIError as exc:
        raise translated(exc, sources) from None
    if state.fleet is not None and admission.lora is None:  # warming runs the base model
        state.fleet.observe_chat(system_turn(prepared.messages), prepared.token_ids,
                                 getattr(request.state, "api_key", None))
    template = response_head(state, body, admission)
    if body.stream:
        events = response_events(state, admission, template, prepared.plan, thinking)
        return sse_response(events, admission, state.config.sse_ping_seconds, wrap=None)
    outputs = await admission.collect(request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening any more
    choice = outputs[0].outputs[0]
    items = output_items(choice.text, prepared.plan, thinking, choice.finish_reason)
    response = finished(state, template, admission, items, choice.finish_reason)
    return Response(encoder.encode(response), media_type="application/json")
