"""Tool calling, the request side: `tools` + `tool_choice` -> how the turn is generated.

    tool_choice      the prompt                  the output                    read by
    "none"           tools through the template  free text                     -
    "auto"           tools through the template  free text in the model's      HermesParser,
                                                 own tool-call format          Llama3JsonParser or
                                                                               MistralParser
    "required"       tools (see below)           [{"name","arguments"}, ...]   CallListParser
    {"function": f}  tools (see below)           f's arguments                 ArgumentsParser

"required" and a named function constrain the output with a grammar
(engine/sampling/structured_outputs.py), so the calls always parse and the arguments
always validate against the function's parameters, whatever the model; the
first finishes with "tool_calls", the second with "stop", as OpenAI does.
"auto" leaves the model free and reads its own tool-call format, which only
a template that shows the model its tools and a known format can give: with
neither (SmolLM2) it is refused with a 400 that says what to use instead.

A template that never reads `tools` (engine/frontend/chat_template.py renders_tools)
would hide them from the model; for "required" and named functions the
tools are then described in the system turn instead, in plain words plus
each parameters schema, and earlier calls in the history are written out in
the same JSON shape the model is held to.

Call ids take the shape of the model's format whatever the tool_choice:
Mistral's templates refuse a history whose ids are not 9 letters and digits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.sampling.structured_outputs import StructuredOutputsParams
from service.errors import bad_request
from service.protocol.requests import ChatCompletionRequest, ChatMessage, Tool
from service.tool_calls.arguments import ArgumentsParser
from service.tool_calls.base import ToolCallParser, request_arguments
from service.tool_calls.call_list import CallListParser
from service.tool_calls.mistral import mistral_history_id
from service.tool_calls.registry import FORMATS, auto_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice decided."""

    choice: str  # "none" | "auto" | "required" | "function"
    tools: tuple[Tool, ...]
    function: str | None = None  # the named function
    # The model's format (service/tool_calls/registry.py): "auto" reads it.
    parser: str | None = None
    parallel: bool = True  # parallel_tool_calls
    constraint: StructuredOutputsParams | None = None
    constraint_param: str = "tools"  # the field to name when the constraint is invalid

    @property
    def calls_tools(self) -> bool:
        return self.choice != "none"

    def new_parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output (None: the output is plain content)."""
        max_calls = None if self.parallel else 1
        if self.choice == "auto":
            return auto_parser(self.parser, max_calls)
        if self.choice == "none":
            return None
        parser = (ArgumentsParser(self.function) if self.choice == "function"
                  else CallListParser(max_calls))
        if self.parser is not None:  # ids the model's template takes back
            parser.new_id = FORMATS[self.parser].new_id
        return parser

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        """OpenAI's: "tool_calls" once the model stopped after calling; a named function "stop"."""
        if reason == "stop" and calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools; 400s name the field."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: the request defines none",
                              param="tool_choice")
        return None
    _check_tools(tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"  # OpenAI's default once tools are given
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise bad_request(
                'tool_choice "auto" needs a chat template that shows the model its tools in a '
                "tool-call format this server reads (Hermes <tool_call>, Llama 3 JSON or Mistral "
                '[TOOL_CALLS]); this model has none. Use tool_choice "required" or name a '
                "function: those hold the output to the tools' schemas.", param="tool_choice")
        if parser == "mistral":  # its marker is a special token: kept in the text, as vLLM does
            body.skip_special_tokens = False
        return ToolPlan("auto", tools, parser=parser, parallel=parallel)
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        return ToolPlan("required", tools, parser=parser, parallel=parallel,
                        constraint=StructuredOutputsParams(json=schema))
    return _named(tools, choice.function.name, parallel, parser)


def _named(tools: tuple[Tool, ...], name: str, parallel: bool, parser: str | None) -> ToolPlan:
    for i, tool in enumerate(tools):
        if tool.function.name == name:
            return ToolPlan("function", tools, function=name, parser=parser, parallel=parallel,
                            constraint=StructuredOutputsParams(json=parameters(tool)),
                            constraint_param=f"tools[{i}].function.parameters")
    raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                      param="tool_choice")


def _check_tools(tools: tuple[Tool, ...]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise bad_request(f"tools has two functions named {name!r}",
                              param=f"tools[{i}].function.name")
        seen.add(name)
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of type "
                              f"object, got type {kind!r}",
                              param=f"tools[{i}].function.parameters")


def parameters(tool: Tool) -> dict:
    """The function's parameters schema; a function without one takes no arguments."""
    schema = tool.function.parameters
    if not schema:
        return EMPTY_PARAMETERS
    return schema if "type" in schema else {"type": "object", **schema}


def _calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict:
    """tool_choice "required": a list of one or more calls, each to one of the tools.

    "name" comes before "arguments" in every call object: the grammar writes
    properties in the schema's order, and CallListParser reads the name first.
    """
    one_call = [{
        "type": "object",
        "properties": {"name": {"enum": [tool.function.name]}, "arguments": parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# -- the prompt --------------------------------------------------------------------------
def template_messages(messages: list[ChatMessage], plan: ToolPlan | None,
                      renders_tools: bool, call_format: str | None = None) -> list[dict]:
    """The conversation as the chat template takes it (Hugging Face's message dicts).
    `call_format`: the server's tool-call format; Mistral's templates take the
    history's call ids only in their own form (mistral_history_id)."""
    check_tool_turns(messages)
    fit_id = mistral_history_id if call_format == "mistral" else _same
    rendered = [_message(m, i, renders_tools, fit_id) for i, m in enumerate(messages)]
    if plan is not None and plan.choice in ("required", "function") and not renders_tools:
        rendered = _with_tool_note(rendered, plan)
    return rendered


def check_tool_turns(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call an earlier assistant turn made, by its id (a
    400 otherwise, as OpenAI's): a result the model cannot tie to a call is noise."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "assistant":
            calls.update(call.id for call in message.tool_calls or ())
        elif message.role == "tool":
            param = f"messages[{i}].tool_call_id"
            if message.tool_call_id is None:
                raise bad_request(f"{param} is missing: a tool message must say which call "
                                  "it answers", param=param)
            if message.tool_call_id not in calls:
                raise bad_request(f"{param} {message.tool_call_id!r} answers no call of an "
                                  "earlier assistant message's tool_calls", param=param)


def template_tools(plan: ToolPlan | None, renders_tools: bool) -> list[dict] | None:
    """The tools for the template's `tools` variable, as OpenAI's JSON objects."""
    if plan is None or not renders_tools:
        return None
    return [{"type": "function", "function": _function_dict(tool)} for tool in plan.tools]


def _function_dict(tool: Tool) -> dict:
    function = {"name": tool.function.name}
    if tool.function.description:
        function["description"] = tool.function.description
    function["parameters"] = parameters(tool)
    return function


def _same(call_id: str) -> str:
    return call_id


def _message(message: ChatMessage, index: int, renders_tools: bool, fit_id) -> dict:
    content = message.content
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    rendered = {"role": role, "content": content}
    if message.role == "tool" and message.tool_call_id is not None:
        rendered["tool_call_id"] = fit_id(message.tool_call_id)
    thought = message.reasoning_content or message.reasoning
    if thought and message.role == "assistant":  # Qwen3's templates read it by this name
        rendered["reasoning_content"] = thought
    if message.tool_calls:
        calls = [{"id": fit_id(call.id) if call.id else call.id, "type": "function",
                  "function": {"name": call.function.name,
                               "arguments": _arguments(call.function.arguments, index, j)}}
                 for j, call in enumerate(message.tool_calls)]
        if renders_tools:
            rendered["tool_calls"] = calls
        else:  # the shape "required" generates, so the model sees its calls as it wrote them
            written = json.dumps([{"name": c["function"]["name"],
                                   "arguments": c["function"]["arguments"]} for c in calls],
                                 ensure_ascii=False)
            rendered["content"] = f"{content}\n{written}" if content else written
    return rendered


def _arguments(text: str, message: int, call: int):
    """A call's arguments as a value: templates write them out themselves."""
    return request_arguments(text, f"messages[{message}].tool_calls[{call}].function.arguments")


def _with_tool_note(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """The tools described in the system turn, for a template that cannot show them."""
    lines = ["You answer by calling functions. Reply with a JSON list of the calls the "
             "request needs, each call once. The functions:"]
    for tool in plan.tools:
        if plan.choice == "function" and tool.function.name != plan.function:
            continue
        described = f"- {tool.function.name}"
        if tool.function.description:
            described += f": {tool.function.description}"
        lines.append(f"{described} Parameters: "
                     f"{json.dumps(parameters(tool), ensure_ascii=False)}")
    note = "\n".join(lines)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{note}" if first["content"] else note
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
