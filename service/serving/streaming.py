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
aborts the request in the engine: sse_response() closes the admission then,
whether or not the event generator had started.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse

from service.errors import APIError
from service.protocol.replies import encoder
from service.serving.admitted import Admission

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


def sse_response(events: AsyncIterator[bytes], admission: Admission, ping_seconds: float,
                 wrap=with_done) -> EventSourceResponse:
    """Stream `events`, then [DONE]; the admission is closed however the stream ends.

    Ended, failed, cancelled mid-await or closed by sse-starlette after a send
    failed: the body's `finally` runs. A client that disconnects before the
    body first ran would skip it, so the disconnect callback closes it too.
    `wrap=None`: the events as they are, for a stream that reports its own
    errors and has no [DONE] (the Responses API's).
    """

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in (events if wrap is None else wrap(events)):
                yield chunk
        finally:
            admission.close()

    async def on_disconnect(_message) -> None:
        admission.close()

    return EventSourceResponse(
        body(), ping=ping_seconds, client_close_handler_callable=on_disconnect
    )
