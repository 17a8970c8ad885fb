"""Content with calls after a marker: what the Hermes and Mistral formats share."""

from __future__ import annotations

from service.tool_calls.base import Parsed, ToolCallParser, partial_suffix


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
