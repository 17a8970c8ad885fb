"""Generated text -> tool calls, incrementally, so a stream can carry them as deltas.

A parser is fed the text of one choice piece by piece (each engine update's
delta) and answers what of it is plain content and what belongs to tool calls:

    feed('[{"name": "get_w')              -> nothing yet (the name is not complete)
    feed('eather", "arguments": {"ci')    -> call 0 opens: id, name "get_weather", '{"ci'
    feed('ty": "Paris"}}]')               -> call 0 arguments '{"ci' ... 'ty": "Paris"}'
    finish()                              -> whatever was held back

The same parser reads a whole response at once (`parse_text`), so a streamed
and an unstreamed answer cannot disagree.

Five formats:
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
  MistralParser    tool_choice "auto" for Mistral templates: content, then
                   [TOOL_CALLS] and a JSON list of calls (or name[ARGS]{...}).
The "auto" formats are the model's own and unconstrained: a call whose JSON
does not parse is returned as content, never dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string

from service.tool_call_base import (  # noqa: F401 (parse_text: its users import it from here)
    CallPiece, Parsed, ToolCallParser, call_of, json_call, json_calls, parse_text, partial_suffix,
)


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


class MarkedCalls(ToolCallParser):
    """Content with calls after a marker (Hermes, Mistral): the content side of both.

    Content goes out as it comes, less a tail that may begin the marker and,
    after a call, spaces that may be all there is before the next call or the
    end: the format's, not content (held until a character shows which).
    """

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.pending = ""
        self.blank = False  # nothing but spaces since the last call

    def _content_until(self, marker: str) -> tuple[str, bool]:
        """Consume `pending` up to and past `marker`: the content before it, and whether it came."""
        start = self.pending.find(marker)
        end = start if start >= 0 else len(self.pending) - partial_suffix(self.pending, marker)
        if start < 0 and self.blank and not self.pending[:end].strip():
            return "", False
        text = self.pending[:end]
        self.pending = self.pending[end + len(marker):] if start >= 0 else self.pending[end:]
        return self._content(text), start >= 0

    def _content(self, text: str) -> str:
        if text.strip():
            self.blank = False
        return "" if self.blank else text

    def _called(self, call: tuple[str, str]) -> Parsed:
        piece = self._open(*call)
        self.blank = True
        return Parsed(calls=[piece] if piece else [])


class HermesParser(MarkedCalls):
    """Content, with calls as <tool_call>{json}</tool_call> anywhere in it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
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
            content, self.inside = self._content_until(self.OPEN)
            parsed.content += content
            if not self.inside:
                return parsed

    def finish(self) -> Parsed:
        text, self.pending = self.pending, ""
        if self.inside:  # the reply ended before "</tool_call>": a call if it parses
            return self._call(text)
        return Parsed(content=self._content(text))

    def _call(self, body: str) -> Parsed:
        call = json_call(body)
        if call is None:
            return Parsed(content=self._content(f"{self.OPEN}{body}{self.CLOSE}"))
        return self._called(call)


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
        calls = json_calls(text.strip().removeprefix(self.TAG)) if self.mode == "calls" else None
        if calls is None:
            return Parsed(content=text)
        pieces = [self._open(*call) for call in calls]
        return Parsed(calls=[p for p in pieces if p is not None])


def mistral_call_id() -> str:
    """Mistral's templates refuse any id but 9 letters and digits (vLLM's ids for it too)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_history_id(call_id: str) -> str:
    """A history's call id in the 9-letter form Mistral's templates take.

    Ids another server made (OpenAI's "call_..." ones) would make the template
    raise; vLLM cuts them to their last 9 characters. Here a foreign id maps
    to 9 letters and digits of its SHA-256 instead: the same id always gives
    the same one, so a call and the tool message answering it still pair up,
    and two ids that end alike do not collide."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    alphabet = string.ascii_letters + string.digits
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(alphabet[(number // len(alphabet) ** i) % len(alphabet)] for i in range(9))


# After "[TOOL_CALLS]": a name (newer templates), "[ARGS]" after it or not, then "{" or "[".
NAMED = re.compile(r"\s*([A-Za-z0-9_-]*)(\[ARGS\])?")


class MistralParser(MarkedCalls):
    """Content, then "[TOOL_CALLS]" and calls, in either of the forms vLLM's parser reads:

        [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]    Mistral 7B v0.3, Mixtral 8x22B
        [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g{...}              newer templates (tokenizer v11+)

    A call goes out once its JSON object is complete. From where the text after
    a marker stops fitting (or at the end, unfinished), it is content, marker too.
    """

    MARKER = "[TOOL_CALLS]"
    new_id = staticmethod(mistral_call_id)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.state = "content"  # past a marker: "start", then in a list "item" / "next"
        self.raw = ""  # the text past the marker not (yet) a call: content should it fail
        self.tried = 0  # how far into `pending` an object last failed to decode

    def feed(self, text: str) -> Parsed:
        self.pending += text
        parsed = Parsed()
        while True:
            if self.state == "content":
                content, found = self._content_until(self.MARKER)
                parsed.content += content
                if not found:
                    return parsed
                self.state, self.raw, self.tried = "start", self.MARKER, 0
                continue
            step = self._start() if self.state == "start" else self._in_list()
            if step is None:
                return parsed
            parsed.add(step)

    def finish(self) -> Parsed:
        text, self.raw, self.pending, self.state = self.raw + self.pending, "", "", "content"
        return Parsed(content=self._content(text))

    def _start(self) -> Parsed | None:
        """Just past a marker: a list's "[", or name[ARGS]{...}. None: wait for more."""
        head = NAMED.match(self.pending)
        name, rest = head.group(1), self.pending[head.end():]
        if rest.startswith("{"):  # without a name, the object is {"name", "arguments"}
            return self._call(head.end(), name)
        if not name and rest.startswith("["):
            self._take(head.end() + 1)
            self.state = "item"
            return Parsed()
        if not rest or (name and not head.group(2) and "[ARGS]".startswith(rest)):
            return None
        return self._fail()

    def _in_list(self) -> Parsed | None:
        """In a list: a call's object ("item"), or after one, "," or the closing "]"."""
        text = self.pending.lstrip()
        at = len(self.pending) - len(text)
        if not text:
            return None
        if self.state == "item" and text[0] == "{":
            return self._call(at, "")
        if self.state == "next" and text[0] in ",]":
            self._take(at + 1)
            if text[0] == "]":  # the list is done: what follows is content again
                self.raw, self.state = "", "content"
            else:
                self.state = "item"
            return Parsed()
        return self._fail()

    def _call(self, at: int, name: str) -> Parsed | None:
        """The call whose JSON object begins at `at`; None: the object is not complete."""
        if "}" not in self.pending[max(at, self.tried):]:
            return None  # an object ends with "}": no need to try before one comes
        try:
            value, end = json.JSONDecoder().raw_decode(self.pending, at)
        except ValueError:  # incomplete (or never valid: content at the end)
            self.tried = len(self.pending)
            return None
        call = call_of({"name": name, "arguments": value} if name else value)
        if call is None:
            return self._fail()
        self._take(end)
        self.raw, self.state = "", "next" if self.state == "item" else "content"
        return self._called(call)

    def _take(self, size: int) -> None:
        self.raw += self.pending[:size]
        self.pending, self.tried = self.pending[size:], 0

    def _fail(self) -> Parsed:
        """Not calls after all: the marker and what followed it are content."""
        text, self.raw, self.state = self.raw, "", "content"
        return Parsed(content=self._content(text))


# The model's own formats, for tool_choice "auto", by the names --tool-call-parser takes.
FORMATS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
PARSERS = tuple(FORMATS)


def auto_parser(name: str, max_calls: int | None) -> ToolCallParser:
    return FORMATS[name](max_calls)


def detect_parser(chat_template: str, configured: str) -> str | None:
    """The tool-call format for tool_choice "auto": the configured one, or the template's.

    "auto" reads the template: Hermes-style templates write "<tool_call>",
    Llama 3's "<|python_tag|>", Mistral's "[TOOL_CALLS]". None: no known format,
    so "auto" is refused.
    """
    if configured == "none":
        return None
    if configured in PARSERS:
        return configured
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template:
        return "llama3_json"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    return None
