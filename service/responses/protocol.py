"""OpenAI's Responses API (`POST /v1/responses`): its wire types, as msgspec Structs.

The request is decoded in one pass, as chat's is (service/protocol/requests.py): an
unknown top-level field is a 400 naming it; nested objects stay lenient, so
a client may send back the output items it received (with their ids and
statuses) as the next turn's input. Every input item has one shape here,
whatever its `type` (a message may leave `type` out, as the SDK's
EasyInputMessage does), and service/responses/input.py reads each by its
type, refusing the kinds this server does not serve by their field path.

The answer (`ResponseObject`) carries the output items, the usage and the
request's own settings, echoed as OpenAI echoes them; the same Structs make
its part of /openapi.json.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from service.protocol.requests import FunctionName, MaxTokens, Priority, Temperature, TopP


# -- the request ---------------------------------------------------------------------
class ContentPart(Struct, kw_only=True):
    """A part of a message's content, of a tool's output or of a thought: text is served
    (input_text, output_text; reasoning_text and summary_text in a reasoning item)."""

    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True):
    """One item of `input`: a message, a function call the model made, its output,
    or a thought of an earlier turn; the fields each kind has (the others stay unset)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None  # a message's; a thought's parts
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[ContentPart] | None = None  # function_call_output
    summary: list[ContentPart] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning: never issued here, so refused
    id: str | None = None  # an output item sent back keeps its id and status
    status: str | None = None


class ResponsesTool(Struct, kw_only=True, omit_defaults=True):
    """A tool: type "function" is served; built-in tools (web_search, ...) are refused."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Struct, kw_only=True, omit_defaults=True):
    """{"type": "function", "name": ...}; other types name tools this server has not."""

    type: str
    name: str | None = None


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: its name and schema
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # accepted; the output is always held to the schema


class TextConfig(Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium" only


class ReasoningConfig(Struct, kw_only=True):
    """Taken only empty: the model thinks as its chat template has it."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


Metadata = Annotated[dict[str, Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None  # the system message, before the input
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    # Nothing is stored (service/responses/input.py refuse_unserved): store true,
    # previous_response_id, background true and include are 400s naming them.
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # "disabled" only
    reasoning: ReasoningConfig | None = None
    metadata: Metadata | None = None  # echoed, kept nowhere
    user: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra, as on chat: with --scheduling-policy priority, lower runs first.
    priority: Priority = 0


# -- the answer ----------------------------------------------------------------------
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningTextPart(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(Struct, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    content: list[OutputTextPart]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningItem(Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningTextPart]
    status: ItemStatus
    summary: list[Any] = []


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct):
    cached_tokens: int  # prompt tokens read from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's explicit prompt caching: none here


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(Struct):
    code: str
    message: str


class EchoedTool(Struct, tag_field="type", tag="function"):
    name: str
    parameters: dict[str, Any] | None
    strict: bool | None
    description: str | None = None


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    # The request's settings, as OpenAI echoes them.
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[EchoedTool]
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice
    parallel_tool_calls: bool
    text: TextConfig
    metadata: dict[str, str]
    user: str | None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: None = None
    object: Literal["response"] = "response"
