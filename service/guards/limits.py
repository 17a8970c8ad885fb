"""Body limits and deadlines: what is refused by size alone, before any work.

    request body  more bytes than --max-request-body-bytes (Content-Length, then as
                  they arrive): 413; not complete within --body-timeout-seconds: 408
                  (`limited`, the guard of service/guards/auth.py)
    chat body     more messages than tokens, more tools than OpenAI takes (128)
                  or tools whose JSON cannot fit the context, read from the raw
                  body before it is decoded (`check_chat_body`: 3,000 tools take
                  28 ms to decode, holding the interpreter, and 0.3 ms to count);
                  then messages whose text cannot fit (`check_chat_size`), before
                  the chat template runs. 3,000 tools once spent 15 s in the chat
                  template before the rendered prompt was found too long.
"""

from __future__ import annotations

import asyncio

import msgspec
from starlette.types import Message, Receive

from service.errors import APIError, bad_request

MAX_TOOLS = 128  # OpenAI's own limit on functions in one request


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than the limit of {limit} bytes",
        code="request_too_large",
    )


def limited(receive: Receive, limit: int, timeout: float) -> Receive:
    """`receive` that guards the body while it arrives.

    More than `limit` bytes (a chunked body has no Content-Length to check
    first): 413. Not complete `timeout` seconds after the headers were (a
    Content-Length larger than what is sent, a stalled upload, or a byte
    every few seconds): 408, so such a client cannot hold a connection and a
    handler for long. The deadline is one for the whole body, not per gap:
    a byte now and then does not extend it. Once the body is complete,
    receive() only waits for the disconnect, untimed.
    """
    received = 0
    complete = False
    deadline = asyncio.get_running_loop().time() + timeout

    async def wrapped() -> Message:
        nonlocal received, complete
        if complete:
            return await receive()
        try:
            left = deadline - asyncio.get_running_loop().time()
            message = await asyncio.wait_for(receive(), max(left, 0.0))
        except TimeoutError:
            raise APIError(  # and the connection closed: the rest of the body is unread
                408, f"the request body was not complete within {timeout:g} s of its "
                f"headers", code="request_timeout", headers={"Connection": "close"},
            ) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(limit)
            complete = not message.get("more_body", False)
        return message

    return wrapped


class _ChatShape(msgspec.Struct):
    """What check_chat_body reads of a chat body: its lists, each item left undecoded."""

    messages: list[msgspec.Raw] = []
    tools: list[msgspec.Raw] | None = None


_CHAT_SHAPE = msgspec.json.Decoder(_ChatShape)


def check_chat_body(state, body: bytes) -> None:
    """Refuse a chat body by its counts and sizes, before it is decoded (parse's
    precheck): more messages than tokens, more than MAX_TOOLS tools, tools whose
    JSON cannot fit. A body this cannot read is left to the decoder to refuse."""
    try:
        shape = _CHAT_SHAPE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return
    limit = state.engine.config.max_model_len
    if len(shape.messages) >= limit:  # every message costs at least its role marker
        raise bad_request(
            f"this model's maximum context length is {limit} tokens; the conversation has "
            f"{len(shape.messages)} messages, at least one token each", param="messages")
    if shape.tools:
        if len(shape.tools) > MAX_TOOLS:
            raise bad_request(f"at most {MAX_TOOLS} tools per request, got {len(shape.tools)}",
                              param="tools")
        # The template shows the model every tool's JSON (or the system turn does).
        state.check_text_size(sum(map(len, shape.tools)), "tools")


def check_chat_size(state, body) -> None:
    """Refuse a decoded chat whose messages cannot fit, by the size of their text,
    before the chat template runs (seconds of work for megabytes of messages)."""
    state.check_text_size(sum(map(_content_size, body.messages)), "messages")


def _content_size(message) -> int:
    """Characters of a message's content: text that any chat template writes out."""
    content = message.content
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content)
