"""The Responses API's serving: a request prepared as chat prepares one (tools plan,
text.format constraint, chat template), the response's head, and a whole
output's items read out of the text as chat reads its message."""

from __future__ import annotations

import time

from starlette.requests import Request

from service.errors import APIError, bad_request
from service.guards.limits import check_chat_size
from service.responses.events import item_id
from service.responses.input import responses_param, text_constraint, to_chat, translated
from service.responses.protocol import (
    EchoedTool, FunctionCallItem, OutputMessage, OutputTextPart, ReasoningItem,
    ReasoningTextPart, ResponseObject, ResponsesRequest, TextConfig, TextFormat,
)
from service.serving.admitted import Admission
from service.serving.chat import PreparedChat, render_prompt
from service.serving.chat_answer import assistant_message
from service.serving.constraints import check_constraint, compile_tenant
from service.serving.lanes import unless_gone
from service.serving.reasoning import ReasoningPlan
from service.serving.state import ServiceState
from service.tool_calls.plan import plan_tools


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
            request, _render(state, chat, plan, constraint, param, sources,
                             compile_tenant(request)))
    except APIError as exc:
        raise translated(exc, sources) from None
    return PreparedChat(chat, plan, constraint, messages, prompt, token_ids), sources


async def _render(state: ServiceState, chat, plan, constraint, param: str,
                  sources: list[str], tenant: str) -> tuple[list[dict], str, list[int]]:
    rendered = await state.off_loop(render_prompt, state, chat, plan)
    await check_constraint(state, constraint, responses_param(param, sources), tenant)
    return rendered


def response_head(state: ServiceState, body: ResponsesRequest,
                  admission: Admission) -> ResponseObject:
    """The response before any output: its id and the request's settings, echoed."""
    defaults = state.sampling_defaults
    form = body.text.format if body.text is not None else None
    return ResponseObject(
        id="resp_" + admission.request_id.split("-", 1)[1],
        created_at=int(time.time()), model=admission.model, status="in_progress", output=[],
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
    message, _ = assistant_message(text, plan, thinking)
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
