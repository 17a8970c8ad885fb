"""What a tool-call parser yields, the parsers' base, and the JSON reading the formats share.

The parsers themselves, and how one is chosen, are service/tool_calls/registry.py.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from service.errors import bad_request

# Nesting a request's call arguments may have. Why a bound: Python's JSON
# decoder and the chat templates recurse once a level, and 50,000 levels of
# "[" were a 500 (RecursionError) on every route that takes a call.
MAX_ARGUMENTS_DEPTH = 64


@dataclass
class CallPiece:
    """Part of tool call `index`; the piece that opens a call carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def add(self, other: "Parsed") -> "Parsed":
        self.content += other.content
        self.calls += other.calls
        return self


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """Base: counts the calls it opened, and how many it may open (parallel_tool_calls)."""

    new_id = staticmethod(new_call_id)

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        return Parsed()

    def _open(self, name: str, arguments: str) -> CallPiece | None:
        """A new call, or None once max_calls are open (the rest are dropped)."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            return None
        self.calls += 1
        return CallPiece(self.calls - 1, arguments, self.new_id(), name)


def parse_text(parser: ToolCallParser, text: str) -> tuple[str, list[CallPiece]]:
    """A whole output: its content and its calls, each call's pieces joined."""
    parsed = parser.feed(text).add(parser.finish())
    calls: list[CallPiece] = []
    for piece in parsed.calls:
        if piece.name is not None:
            calls.append(CallPiece(piece.index, piece.arguments, piece.id, piece.name))
        else:
            calls[piece.index].arguments += piece.arguments
    return parsed.content, calls


def json_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls written one after another, separated by ";": all of them, or None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_of(value)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def json_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from '{"name": ..., "arguments"|"parameters": {...}}'."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return call_of(call)


def request_arguments(text: str, param: str):
    """A request's call arguments (JSON text, as OpenAI sends them) as a value, or a
    400 naming `param`: not JSON, or nested deeper than MAX_ARGUMENTS_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        value, too_deep = None, True
    except ValueError:
        raise bad_request(f"{param} must be JSON text", param=param) from None
    else:
        too_deep = depth(value) > MAX_ARGUMENTS_DEPTH
    if too_deep:
        raise bad_request(f"{param} is nested more than {MAX_ARGUMENTS_DEPTH} levels deep",
                          param=param)
    return value


def depth(value) -> int:
    """How many arrays and objects deep a decoded JSON value goes (without recursing)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (list, dict)):
            level += 1
            deepest = max(deepest, level)
            todo.extend((child, level) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def call_of(call) -> tuple[str, str] | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
