"""tool_choice "auto" for Hermes-style templates (Qwen2.5 and Qwen3, Hermes 2 and 3,
SmolLM3): free text, with each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

from __future__ import annotations

from service.tool_calls.base import Parsed, json_call
from service.tool_calls.marked_calls import MarkedCalls


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
