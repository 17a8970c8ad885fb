"""tool_choice "required": a JSON list of {"name", "arguments"} objects, held to that
shape by the grammar (service/tool_calls/plan.py)."""

from __future__ import annotations

import re

from service.tool_calls.base import CallPiece, Parsed, ToolCallParser


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
