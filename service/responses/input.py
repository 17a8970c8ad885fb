"""A Responses request read as the chat request it amounts to.

    instructions                          a system message, first
    input "text"                          a user message
    input [{role, content}, ...]          messages (content: a string or text parts)
          {type: function_call, ...}      the assistant's tool_calls (with the message
                                          just before it, if that is the assistant's)
          {type: function_call_output}    a tool message answering that call
          {type: reasoning, ...}          the next assistant turn's thought
    tools [{type: function, name, ...}]   chat's tools; tool_choice likewise
    text.format                           the output constraint (json_schema, json_object)
    max_output_tokens                     max_completion_tokens

The chat machinery then renders, constrains and reads the turn
(service/tool_calls/plan.py, service/serving/chat.py). What this server does not serve
is a 400 naming its field path here, before any work: images, files and
other content parts, item kinds it has not (item_reference, built-in tool
calls), built-in tools, stored state (store true, previous_response_id,
background, include), truncation "auto", reasoning settings. A refusal the
chat machinery raises later names a chat field; `responses_param` gives
the Responses field it came from.
"""

from __future__ import annotations

import re

from engine.errors import ValidationError
from engine.sampling.structured_outputs import StructuredOutputsParams
from service.errors import APIError, bad_request
from service.protocol.requests import (
    ChatCompletionRequest, ChatMessage, ChosenFunction, FunctionCall, FunctionDefinition,
    NamedToolChoice, Tool, ToolCall,
)
from service.responses.protocol import ContentPart, InputItem, ResponsesRequest
from service.tool_calls.base import request_arguments

TEXT_PARTS = frozenset({"input_text", "output_text"})
THOUGHT_PARTS = frozenset({"reasoning_text", "summary_text"})


def unserved(message: str, param: str) -> APIError:
    return bad_request(message, param=param, code="unsupported_parameter")


def refuse_unserved(body: ResponsesRequest) -> None:
    """400 for a setting this server cannot honour, naming it."""
    if body.store:
        raise unserved("store=true is not served: this server keeps no responses (store=false "
                       "semantics); send the whole conversation as input", "store")
    if body.previous_response_id is not None:
        raise unserved("previous_response_id needs stored responses, and this server stores "
                       "none: send the earlier turns as input items instead",
                       "previous_response_id")
    if body.background:
        raise unserved("background=true is not served: responses run in the foreground",
                       "background")
    if body.include:
        raise unserved(f"include is not served (nothing extra can be included: got "
                       f"{body.include[0]!r})", "include")
    if body.truncation == "auto":
        raise unserved('truncation "auto" is not served: an input that does not fit is '
                       'refused ("disabled")', "truncation")
    if body.reasoning is not None:
        for name in ("effort", "summary", "generate_summary"):
            if getattr(body.reasoning, name) is not None:
                raise unserved(f"reasoning.{name} is not served: the model thinks (or not) as "
                               "its chat template has it", f"reasoning.{name}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise unserved("text.verbosity is served at \"medium\" only", "text.verbosity")


def to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request, and for each of its messages the Responses field it came from."""
    messages, sources = to_messages(body)
    chat = ChatCompletionRequest(
        messages=messages, model=body.model, stream=body.stream,
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, user=body.user, tools=to_tools(body),
        tool_choice=to_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls,
        priority=body.priority)
    return chat, sources


def to_messages(body: ResponsesRequest) -> tuple[list[ChatMessage], list[str]]:
    messages: list[ChatMessage] = []
    sources: list[str] = []
    if body.instructions is not None:
        messages.append(ChatMessage("system", body.instructions))
        sources.append("instructions")
    if isinstance(body.input, str):
        messages.append(ChatMessage("user", body.input))
        sources.append("input")
        return messages, sources
    reader = _Items(messages, sources)
    for i, item in enumerate(body.input):
        reader.read(item, f"input[{i}]")
    if not messages:
        raise bad_request("input holds no item, and there are no instructions", param="input")
    return messages, sources


class _Items:
    """Input items into chat messages, in order."""

    def __init__(self, messages: list[ChatMessage], sources: list[str]) -> None:
        self.messages, self.sources = messages, sources
        self.calls: set[str] = set()  # the call ids of earlier function_call items
        self.answered: set[str] = set()  # the call ids earlier outputs answered
        self.thought: str | None = None  # a reasoning item's, for the next assistant turn

    def read(self, item: InputItem, param: str) -> None:
        kind = item.type
        if kind == "message":
            self._message(item, param)
        elif kind == "function_call":
            self._call(item, param)
        elif kind == "function_call_output":
            self._output(item, param)
        elif kind == "reasoning":
            self._reasoning(item, param)
        elif kind == "item_reference":
            raise unserved(f"{param} is an item_reference: this server stores no items; send "
                           "the item itself", f"{param}.type")
        else:
            raise unserved(f"{param}.type {kind!r} is not served: input items are messages, "
                           "function_call, function_call_output and reasoning",
                           f"{param}.type")

    def _add(self, message: ChatMessage, param: str) -> None:
        if message.role == "assistant" and self.thought is not None:
            message.reasoning_content, self.thought = self.thought, None
        self.messages.append(message)
        self.sources.append(param)

    def _message(self, item: InputItem, param: str) -> None:
        if item.role is None:
            raise bad_request(f"{param}.role is missing: a message item needs a role",
                              param=f"{param}.role")
        self._add(ChatMessage(item.role, _text(item.content, f"{param}.content",
                                               TEXT_PARTS)), param)

    def _call(self, item: InputItem, param: str) -> None:
        for field in ("call_id", "name", "arguments"):
            if getattr(item, field) is None:
                raise bad_request(f"{param}.{field} is missing: a function_call item needs "
                                  "call_id, name and arguments", param=f"{param}.{field}")
        if not item.call_id:
            raise bad_request(f"{param}.call_id is empty: a function_call item needs an id "
                              "its output can name", param=f"{param}.call_id")
        if item.call_id in self.calls:
            raise bad_request(f"{param}.call_id {item.call_id!r} is an earlier function_call "
                              "item's: each call needs its own id", param=f"{param}.call_id")
        request_arguments(item.arguments, f"{param}.arguments")
        call = ToolCall(item.call_id, FunctionCall(item.name, item.arguments))
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":  # one turn: its text, then calls
            last.tool_calls = [*(last.tool_calls or ()), call]
            if self.thought is not None and last.reasoning_content is None:
                last.reasoning_content, self.thought = self.thought, None
        else:
            self._add(ChatMessage("assistant", None, tool_calls=[call]), param)
        self.calls.add(item.call_id)

    def _output(self, item: InputItem, param: str) -> None:
        if item.call_id is None:
            raise bad_request(f"{param}.call_id is missing: a function_call_output item must "
                              "say which call it answers", param=f"{param}.call_id")
        if item.call_id not in self.calls:
            raise bad_request(f"{param}.call_id {item.call_id!r} answers no function_call item "
                              "before it", param=f"{param}.call_id")
        if item.call_id in self.answered:
            raise bad_request(f"{param}.call_id {item.call_id!r} was answered by an earlier "
                              "function_call_output item", param=f"{param}.call_id")
        self.answered.add(item.call_id)
        if item.output is None:
            raise bad_request(f"{param}.output is missing", param=f"{param}.output")
        output = _text(item.output, f"{param}.output", TEXT_PARTS)
        self._add(ChatMessage("tool", output, tool_call_id=item.call_id), param)

    def _reasoning(self, item: InputItem, param: str) -> None:
        if item.encrypted_content is not None:
            raise unserved(f"{param}.encrypted_content is not served: this server issues no "
                           "encrypted thoughts; send the reasoning item's content",
                           f"{param}.encrypted_content")
        parts = item.content if isinstance(item.content, list) and item.content else None
        where = f"{param}.content" if parts else f"{param}.summary"
        if isinstance(item.content, str):
            raise bad_request(f"{param}.content must be a list of reasoning_text parts",
                              param=f"{param}.content")
        thought = _text(parts or item.summary or [], where, THOUGHT_PARTS)
        self.thought = thought or None


def _text(content: str | list[ContentPart] | None, param: str, kinds: frozenset[str]) -> str:
    """A content's text: a string, or text parts joined; other parts are refused by path."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in kinds:
            raise unserved(f"{param}[{j}].type {part.type!r} is not served: this server takes "
                           f"text only ({', '.join(sorted(kinds))})", f"{param}[{j}].type")
        if part.text is None:
            raise bad_request(f"{param}[{j}].text is missing", param=f"{param}[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def to_tools(body: ResponsesRequest) -> list[Tool] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise unserved(f"tools[{i}].type {tool.type!r} is not served: this server runs "
                           "function tools only", f"tools[{i}].type")
        if tool.name is None:
            raise bad_request(f"tools[{i}].name is missing", param=f"tools[{i}].name")
        kind = (tool.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(f"tools[{i}].parameters must be a JSON schema of type object, "
                              f"got type {kind!r}", param=f"tools[{i}].parameters")
        tools.append(Tool("function", FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters,
            strict=tool.strict)))
    return tools


def to_tool_choice(body: ResponsesRequest):
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise unserved(f"tool_choice.type {choice.type!r} is not served: use none, auto, "
                       "required or {\"type\": \"function\", \"name\": ...}", "tool_choice.type")
    if choice.name is None:
        raise bad_request("tool_choice.name is missing", param="tool_choice.name")
    return NamedToolChoice("function", ChosenFunction(choice.name))


def text_constraint(body: ResponsesRequest) -> tuple[StructuredOutputsParams | None, str]:
    """text.format as the output constraint, and the field to name if it is invalid."""
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text":
        return None, "text.format"
    if form.type == "json_object":
        return StructuredOutputsParams(json_object=True), "text.format"
    if form.name is None:
        raise bad_request("text.format.name is missing: a json_schema format needs a name",
                          param="text.format.name")
    if form.schema is None:
        raise bad_request("text.format.schema is missing", param="text.format.schema")
    try:
        return StructuredOutputsParams(json=form.schema), "text.format.schema"
    except (TypeError, ValidationError) as exc:
        raise bad_request(f"text.format.schema: {exc}", param="text.format.schema") from None


_MESSAGE = re.compile(r"messages\[(\d+)\]")
_TOOL = re.compile(r"(tools\[\d+\])\.function\.(.+)")


def responses_param(param: str | None, sources: list[str]) -> str | None:
    """The Responses field behind a chat field that a refusal names (a typed error's param)."""
    if param is None:
        return None
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param in ("messages", "prompt"):
        return "input"
    if param.startswith("response_format"):
        return "text.format"
    message = _MESSAGE.match(param)
    if message is not None:
        index = int(message.group(1))
        return sources[index] if index < len(sources) else "input"
    tool = _TOOL.match(param)
    if tool is not None:
        return f"{tool.group(1)}.{tool.group(2)}"
    return param


def translated(error: APIError, sources: list[str]) -> APIError:
    """The same refusal, naming the Responses field, in its param and its text."""
    param, message = responses_param(error.param, sources), error.message
    if error.param and param and param != error.param:
        message = re.sub(rf"(?<![\w.\[]){re.escape(error.param)}(?![\w\[])", param, message)
    return APIError(error.status, message, param=param, code=error.code, headers=error.headers)
