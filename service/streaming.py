"""Turning engine outputs into server-sent events.

    data: {"id": "chatcmpl-…", "choices": [{"delta": {"content": "Hel"}, …}]}
    <blank line>
    data: {… "finish_reason": "stop" …}
    <blank line>
    data: [DONE]

Each event is encoded straight to bytes (sse-starlette passes bytes through
untouched). Once the response has started its status is 200 for good, so an
error after that point travels in-band as an event with OpenAI's error
object, followed by [DONE] so clients stop reading. A client that goes away
cancels the generator, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from service.errors import APIError
from service.protocol import encoder

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def event(payload) -> bytes:
    return b"data: " + encoder.encode(payload) + b"\n\n"


async def with_done(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events on, then [DONE]; an error becomes an in-band error event first."""
    try:
        async for chunk in events:
            yield chunk
    except APIError as exc:
        yield event(exc.body())
    except Exception as exc:  # never cut a stream without telling the client why
        logger.exception("stream failed")
        yield event(APIError(500, f"internal error: {type(exc).__name__}").body())
    yield DONE


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as items arrive: yields (which, item).

    Used for a completions request with a batch of prompts: each prompt is
    its own engine request, and their outputs stream back as they come.
    Closing the merge (client gone) cancels every reader, which aborts every
    request.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
        except BaseException as exc:  # re-raised on the consumer's side
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
