"""A named tool_choice: the whole output is that function's arguments (the grammar
allowed nothing else)."""

from __future__ import annotations

from service.tool_calls.base import CallPiece, Parsed, ToolCallParser


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
