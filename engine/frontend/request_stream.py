"""RequestStream: one request's outputs, as the service reads them from AsyncEngine."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine


class RequestStream:
    """One request's outputs, in order, as an async iterator (asyncio side only).

    Always close it (`close()` or `aclose()`, safe to repeat) when done with
    it: closing before the request finished is what aborts it. Unlike an
    async generator, a stream that was never iterated can still be closed.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        self._done = True
        self.engine.release(self.request_id)

    async def aclose(self) -> None:
        self.close()
