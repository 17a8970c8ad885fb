"""Chat preparation: a chat request parsed, checked and rendered through the model's
chat template up to the engine (what /v1/chat/completions, /render, /tokenize and
/v1/responses share)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from starlette.requests import Request

from engine.errors import ValidationError
from engine.frontend.chat_template import render_chat_text
from service.errors import bad_request, from_engine_error
from service.guards.limits import check_chat_body, check_chat_size
from service.protocol.requests import ChatCompletionRequest
from service.serving.constraints import check_constraint, compile_tenant, constraint_of
from service.serving.lanes import unless_gone
from service.serving.state import ServiceState, parse
from service.tool_calls.plan import ToolPlan, plan_tools, template_messages, template_tools


@dataclass
class PreparedChat:
    """A chat request up to the engine: what serving and /render share."""

    body: ChatCompletionRequest
    plan: ToolPlan | None
    constraint: object | None
    messages: list[dict]  # as the chat template took them
    prompt: str
    token_ids: list[int]

    def admission_args(self) -> dict:
        """What ServiceState.admit (and .validate) take besides the request, prompts and id prefix."""
        body = self.body
        return dict(
            prompt_param="messages",
            # `is None`, not `or`: a max_completion_tokens of 0 must never mean "no limit".
            max_tokens=(body.max_tokens if body.max_completion_tokens is None
                        else body.max_completion_tokens),
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            constraint=self.constraint)


async def prepare(request: Request, state: ServiceState) -> PreparedChat:
    """Parse, check and render a chat request (its constraint compiled)."""
    body = await parse(request, ChatCompletionRequest, partial(check_chat_body, state))
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    refuse_unsupported(body)
    check_chat_size(state, body)  # before the messages are rendered
    plan = plan_tools(body, state.tool_parser)
    constraint, constraint_param = _constraint(body, plan)
    messages, prompt, token_ids = await unless_gone(
        request, _prepare(state, body, plan, constraint, constraint_param,
                          compile_tenant(request)))
    return PreparedChat(body, plan, constraint, messages, prompt, token_ids)


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """400 for OpenAI's deprecated `functions` / `function_call`, naming them.

    Answering with free text would look like success to a client that relies
    on a function call; `tools` and `tool_choice` are their served successors.
    """
    for param, value in (("functions", body.functions), ("function_call", body.function_call)):
        if value not in (None, [], "none"):
            raise bad_request(f"{param} is OpenAI's deprecated form of tool calling and is not "
                              "served: send tools and tool_choice instead",
                              param=param, code="unsupported_parameter")


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None):
    """The output constraint: response_format / structured_outputs, or the tools' grammar."""
    constraint, param = constraint_of(body)
    if plan is None or not plan.calls_tools:
        return constraint, param
    if constraint is not None:
        field = param.split(".")[0]
        raise bad_request(f"{field} cannot be combined with tool_choice {plan.choice!r}: a "
                          "turn is either tool calls or constrained content",
                          param=field)
    return plan.constraint, plan.constraint_param


async def _prepare(state: ServiceState, body: ChatCompletionRequest, plan: ToolPlan | None,
                   constraint, constraint_param: str,
                   tenant: str) -> tuple[list[dict], str, list[int]]:
    """The conversation through the model's chat template (on a prep thread): the
    messages as the template took them, the prompt's text and its token ids; then
    the constraint compiled (on the compile lane), once the prompt is known to fit.
    Oversized conversations were refused before (check_chat_size)."""
    rendered = await state.off_loop(render_prompt, state, body, plan)
    await check_constraint(state, constraint, constraint_param, tenant)
    return rendered


def render_prompt(state: ServiceState, body: ChatCompletionRequest,
                  plan: ToolPlan | None) -> tuple[list[dict], str, list[int]]:
    """The messages as the template took them, the prompt text and its token ids
    (serving and /tokenize alike); run off the loop."""
    messages = template_messages(body.messages, plan, state.renders_tools, state.tool_parser)
    try:
        text = render_chat_text(state.tokenizer, messages, body.add_generation_prompt,
                                tools=template_tools(plan, state.renders_tools),
                                template_kwargs=body.chat_template_kwargs)
    except ValidationError as exc:  # names "messages" or the chat_template_kwargs entry
        raise from_engine_error(exc) from None
    state.check_text_size(len(text), "messages")  # before the costly part: tokenizing
    return messages, text, state.tokenizer.encode(text, add_special_tokens=False)


def system_turn(messages: list[dict]) -> list[dict]:
    """The system messages the conversation opens with (as rendered)."""
    system = []
    for message in messages:
        if message["role"] != "system":
            break
        system.append(message)
    return system
