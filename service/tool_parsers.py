"""Generated text -> tool calls, incrementally, so a stream can carry them as deltas.

A parser is fed the text of one choice piece by piece (each engine update's
delta) and answers what of it is plain content and what belongs to tool calls:

    feed('[{"name": "get_w')              -> nothing yet (the name is not complete)
    feed('eather", "arguments": {"ci')    -> call 0 opens: id, name "get_weather", '{"ci'
    feed('ty": "Paris"}}]')               -> call 0 arguments '{"ci' ... 'ty": "Paris"}'
    finish()                              -> whatever was held back

The same parser reads a whole response at once (`parse_text`), so a streamed
and an unstreamed answer cannot disagree.

Four formats:
  ArgumentsParser  a named tool_choice: the whole output is that function's
                   arguments (the grammar allowed nothing else).
  CallListParser   tool_choice "required": a JSON list of {"name", "arguments"}
                   objects, held to that shape by the grammar (service/tools.py).
  HermesParser     tool_choice "auto" for Hermes-style templates (Qwen2.5 and
                   Qwen3, Hermes 2 and 3, SmolLM3): free text, with each call as
                   <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
  Llama3JsonParser tool_choice "auto" for Llama 3.1-3.3 templates: the whole
                   reply is {"name": ..., "parameters": {...}} (several joined by
                   ";"), optionally after <|python_tag|>; anything else is content.
The "auto" formats are the model's own and unconstrained: a call whose JSON
does not parse is returned as content, never dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json")


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
        return CallPiece(self.calls - 1, arguments, new_call_id(), name)


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


class ArgumentsParser(ToolCallParser):
    """tool_choice names a function: every character is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__(max_calls=1)
        self.name = name

    def feed(self, text: str) -> Parsed:
        if self.calls == 0:
            return Parsed(calls=[self._open(self.name, text)])
        return Parsed(calls=[CallPiece(0, text)] if text else [])

    def finish(self) -> Parsed:
        return self.feed("") if self.calls == 0 else Parsed()


# The opening of one call in the list, up to where its arguments begin.
CALL_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]*)"\s*,\s*"arguments"\s*:\s*')


class CallListParser(ToolCallParser):
    """tool_choice "required": [{"name": "f", "arguments": {...}}, ...].

    The grammar guarantees the shape, so the parser only has to find the
    seams: a call's head (matched once it is complete), then its arguments,
    which end at the first "}" outside any string and any nesting: the one
    that closes the call's object.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.pending = ""  # text not yet consumed
        self.in_arguments = False
        self.leading = False  # no character of the open call's arguments seen yet
        self.index: int | None = None  # the open call (None: dropped past max_calls)
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> Parsed:
        self.pending += text
        parsed = Parsed()
        while self.pending:
            if not self.in_arguments:
                head = CALL_HEAD.match(self.pending)
                if head is None:
                    break  # incomplete (or the closing "]"): wait for more
                self.pending = self.pending[head.end():]
                piece = self._open(head.group(1), "")
                self.index = None if piece is None else piece.index
                if piece is not None:
                    parsed.calls.append(piece)
                self.in_arguments, self.leading = True, True
            end = self._arguments_end()
            # Spaces outside strings may be the last before the call's "}": held back
            # until more text shows (rescanning them changes no state).
            taken = self.pending if end is None else self.pending[:end]
            held = "" if self.in_string and end is None else taken[len(taken.rstrip()):]
            taken = taken[:len(taken) - len(held)]
            if self.leading:  # the space after "arguments": is the separator's, not theirs
                taken = taken.lstrip()
                self.leading = not taken
            if taken and self.index is not None:
                parsed.calls.append(CallPiece(self.index, taken))
            if end is None:
                self.pending = held
                break
            self.pending = self.pending[end + 1:]  # past the call's closing "}"
            self.in_arguments = False
        return parsed

    def finish(self) -> Parsed:
        # Cut short (max_tokens) before the first call's name was complete: the
        # text is all there is, so it is returned as content rather than lost.
        text, self.pending = self.pending, ""
        return Parsed(content=text if self.calls == 0 else "")

    def _arguments_end(self) -> int | None:
        """Where in `pending` the arguments end (the call's "}"), or None: not yet."""
        for i, char in enumerate(self.pending):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:
                    return i
                self.depth -= 1
        return None


class HermesParser(ToolCallParser):
    """Content, with calls as <tool_call>{json}</tool_call> anywhere in it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.pending = ""
        self.inside = False

    def feed(self, text: str) -> Parsed:
        self.pending += text
        parsed = Parsed()
        while True:
            if self.inside:
                end = self.pending.find(self.CLOSE)
                if end < 0:
                    return parsed
                parsed.add(self._call(self.pending[:end]))
                self.pending = self.pending[end + len(self.CLOSE):]
                self.inside = False
                continue
            start = self.pending.find(self.OPEN)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>".
                keep = _partial_suffix(self.pending, self.OPEN)
                parsed.content += self._content(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return parsed
            parsed.content += self._content(self.pending[:start])
            self.pending = self.pending[start + len(self.OPEN):]
            self.inside = True

    def finish(self) -> Parsed:
        text, self.pending = self.pending, ""
        if self.inside:  # the reply ended before "</tool_call>": a call if it parses
            return self._call(text)
        return Parsed(content=self._content(text))

    def _content(self, text: str) -> str:
        # Between and after calls, the newlines the format puts around them are not content.
        return text if self.calls == 0 or text.strip() else ""

    def _call(self, body: str) -> Parsed:
        call = _json_call(body)
        if call is None:
            return Parsed(content=f"{self.OPEN}{body}{self.CLOSE}")
        piece = self._open(*call)
        return Parsed(calls=[piece] if piece else [])


class Llama3JsonParser(ToolCallParser):
    """A reply that is JSON call(s) is tool calls; any other reply is content."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.pending = ""
        self.mode: str | None = None  # "calls" or "content", decided by the first character

    def feed(self, text: str) -> Parsed:
        if self.mode == "content":
            return Parsed(content=text)
        self.pending += text
        start = self.pending.lstrip()
        if self.mode is None and start:
            if start.startswith("{") or start.startswith(self.TAG):
                self.mode = "calls"
            elif not self.TAG.startswith(start):
                self.mode = "content"
                text, self.pending = self.pending, ""
                return Parsed(content=text)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.pending = self.pending, ""
        calls = _json_calls(text.strip().removeprefix(self.TAG)) if self.mode == "calls" else None
        if calls is None:
            return Parsed(content=text)
        pieces = [self._open(*call) for call in calls]
        return Parsed(calls=[p for p in pieces if p is not None])


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """Calls written one after another, separated by ";": all of them, or None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of(value)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def _json_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) from '{"name": ..., "arguments"|"parameters": {...}}'."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    return _call_of(call)


def _call_of(call) -> tuple[str, str] | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def auto_parser(name: str, max_calls: int | None) -> ToolCallParser:
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name](max_calls)


def detect_parser(chat_template: str, configured: str) -> str | None:
    """The tool-call format for tool_choice "auto": the configured one, or the template's.

    "auto" reads the template: Hermes-style templates write "<tool_call>",
    Llama 3's write "<|python_tag|>". None: no known format, so "auto" is refused.
    """
    if configured == "none":
        return None
    if configured in PARSERS:
        return configured
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template:
        return "llama3_json"
    return None
