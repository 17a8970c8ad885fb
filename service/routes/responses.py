"""POST /v1/responses: OpenAI's Responses API on the chat machinery.

    body ──► ResponsesRequest ──► refuse_unserved ──► to_chat (responses_input.py)
         ──► tools plan, text.format constraint, chat template (as chat renders it)
         ──► admit ──► a ResponseObject (JSON), or its events (responses_events.py)

Nothing is stored: store=false semantics (store true and previous_response_id
are 400s naming them), so there is no GET /v1/responses/{id}. The output
items are read out of the text as chat reads its message: a thought
(--reasoning-parser) becomes a reasoning item, the answer a message item,
tool calls function_call items, in that order.
"""

from __future__ import annotations

import time
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from service.admission import Admission
from service.constraints import check_constraint
from service.errors import APIError, bad_request
from service.prep import check_chat_body, check_chat_size, unless_gone
from service.protocol import encoder
from service.reasoning import ReasoningPlan, plan_reasoning
from service.responses_input import (
    refuse_unserved, responses_param, text_constraint, to_chat, translated,
)
from service.responses_protocol import (
    EchoedTool, FunctionCallItem, OutputMessage, OutputTextPart, ReasoningItem,
    ReasoningTextPart, ResponseObject, ResponsesRequest, TextConfig, TextFormat,
)
from service.routes.chat import PreparedChat, _message, _system_turn, render_prompt
from service.routes.responses_events import finished, item_id, response_events
from service.serving import ServiceState, parse
from service.streaming import sse_response
from service.tools import plan_tools


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
    if state.fleet is not None:
        state.fleet.observe_chat(_system_turn(prepared.messages), prepared.token_ids,
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


async def prepare(request: Request, state: ServiceState,
                  body: ResponsesRequest) -> tuple[PreparedChat, list[str]]:
    """The request as chat prepares one: its tools plan, constraint and rendered prompt;
    and each chat message's Responses field, for refusals raised on the way."""
    chat, sources = to_chat(body)
    try:
        limit = state.engine.config.max_model_len
        if len(chat.messages) >= limit:  # each message costs at least its role marker
            raise bad_request(f"this model's maximum context length is {limit} tokens; the "
                              f"input has {len(chat.messages)} items", param="input")
        check_chat_size(state, chat)  # before the template runs
        plan = plan_tools(chat, state.tool_parser)
        constraint, param = text_constraint(body)
        if plan is not None and plan.calls_tools:
            if constraint is not None:
                raise bad_request(f"text.format cannot be combined with tool_choice "
                                  f"{plan.choice!r}: a turn is either tool calls or "
                                  "formatted text", param="text.format")
            constraint, param = plan.constraint, plan.constraint_param
        messages, prompt, token_ids = await unless_gone(
            request, _render(state, chat, plan, constraint, param, sources))
    except APIError as exc:
        raise translated(exc, sources) from None
    return PreparedChat(chat, plan, constraint, messages, prompt, token_ids), sources


async def _render(state: ServiceState, chat, plan, constraint, param: str,
                  sources: list[str]) -> tuple[list[dict], str, list[int]]:
    rendered = await state.off_loop(render_prompt, state, chat, plan)
    await check_constraint(state, constraint, responses_param(param, sources))
    return rendered


def response_head(state: ServiceState, body: ResponsesRequest,
                  admission: Admission) -> ResponseObject:
    """The response before any output: its id and the request's settings, echoed."""
    defaults = state.sampling_defaults
    form = body.text.format if body.text is not None else None
    return ResponseObject(
        id="resp_" + admission.request_id.split("-", 1)[1],
        created_at=int(time.time()), model=state.model_name, status="in_progress", output=[],
        instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        temperature=(body.temperature if body.temperature is not None
                     else defaults.get("temperature", 1.0)),
        top_p=body.top_p if body.top_p is not None else defaults.get("top_p", 1.0),
        tools=[EchoedTool(t.name, t.parameters, t.strict, t.description)
               for t in body.tools or () if t.name is not None],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text=TextConfig(format=form or TextFormat(type="text"), verbosity="medium"),
        metadata=body.metadata or {}, user=body.user)


def output_items(text: str, plan, thinking: ReasoningPlan | None,
                 finish_reason: str | None) -> list:
    """A whole output's items: thought, answer (if any, or if nothing else), calls.
    The last is "incomplete" when max_output_tokens cut it."""
    message, _ = _message(text, plan, thinking)
    items: list = []
    if message.reasoning_content:
        items.append(ReasoningItem(item_id("rs"),
                                   [ReasoningTextPart(message.reasoning_content)], "completed"))
    calls = message.tool_calls or []
    if message.content or not (calls or items):
        items.append(OutputMessage(item_id("msg"), "completed",
                                   [OutputTextPart(message.content or "")]))
    items.extend(FunctionCallItem(item_id("fc"), call.id, call.function.name,
                                  call.function.arguments, "completed") for call in calls)
    if finish_reason == "length":
        items[-1].status = "incomplete"
    return items
