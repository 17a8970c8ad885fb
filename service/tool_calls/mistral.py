"""tool_choice "auto" for Mistral templates: content, then [TOOL_CALLS] and a JSON list
of calls (or name[ARGS]{...}); and the 9-character call ids its templates take."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string

from service.tool_calls.base import Parsed, call_of
from service.tool_calls.marked_calls import MarkedCalls


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
