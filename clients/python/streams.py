"""A streamed answer as text deltas: server-sent events, parsed by httpx-sse.

    data: {"choices": [{"delta": {"content": "Hel"}}], ...}     -> "Hel"
    : ping                                                       (a comment: skipped)
    data: {"error": {"message": ..., "code": ...}}               -> raises StreamError
    data: [DONE]                                                 -> the end

httpx-sse reassembles events however the network splits them (a line cut in
two, data over several lines) and drops comments, which the server sends as
keep-alives during long prefills. The last chunk carries the usage; read it
from `.usage` once the iteration ends, and a thinking model's thought
(reasoning deltas, with the server's --reasoning-parser) from `.thought`.
"""

from __future__ import annotations

import httpx
import msgspec
from httpx_sse import EventSource

from clients.python.errors import StreamError, error_from
from clients.python.types import ChatCompletionChunk, Completion, Usage

DONE = "[DONE]"


class _Reader:
    """What a sync and an async stream share: one event's bookkeeping."""

    def __init__(self, response: httpx.Response, chat: bool) -> None:
        self.response = response
        self.chat = chat
        self.id: str | None = None
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.thought = ""  # the first choice's reasoning deltas, joined
        self.done = False  # [DONE] arrived: the server ended the stream cleanly

    def take(self, data: str) -> str | None:
        """The first choice's new text in one event (None at [DONE]); errors raise StreamError."""
        if data == DONE:
            self.done = True
            return None
        payload = msgspec.json.decode(data)
        if isinstance(payload, dict) and "error" in payload:
            raise error_from(200, data.encode(), StreamError)
        chunk = msgspec.convert(payload, ChatCompletionChunk if self.chat else Completion)
        self.id = chunk.id
        self.usage = chunk.usage or self.usage
        text = ""
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            if self.chat:
                text = choice.delta.content or ""
                self.thought += choice.delta.reasoning_content or choice.delta.reasoning or ""
            else:
                text = choice.text
            self.finish_reason = choice.finish_reason or self.finish_reason
        return text


class TextStream(_Reader):
    """Iterate for text deltas; closing it (or leaving the loop early) aborts
    the request on the server."""

    def __iter__(self):
        try:
            for event in EventSource(self.response).iter_sse():
                text = self.take(event.data)
                if text is None:
                    return
                if text:
                    yield text
        finally:
            self.close()

    def text(self) -> str:
        """Read the whole answer."""
        return "".join(self)

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTextStream(_Reader):
    async def __aiter__(self):
        try:
            async for event in EventSource(self.response).aiter_sse():
                text = self.take(event.data)
                if text is None:
                    return
                if text:
                    yield text
        finally:
            await self.aclose()

    async def text(self) -> str:
        return "".join([piece async for piece in self])

    async def aclose(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> "AsyncTextStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
