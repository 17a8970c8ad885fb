"""tool_choice "auto" for Llama 3.1-3.3 templates: the whole reply is {"name": ...,
"parameters": {...}} (several joined by ";"), optionally after <|python_tag|>."""

from __future__ import annotations

from service.tool_calls.base import Parsed, ToolCallParser, json_calls


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
