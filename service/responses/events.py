"""A streamed response: the engine's deltas as the Responses API's events, in the SDK's order.

    response.created, response.in_progress             (with the first token)
    per output item, in order:
      reasoning   output_item.added, content_part.added, reasoning_text.delta ...,
                  reasoning_text.done, content_part.done, output_item.done
      message     output_item.added, content_part.added, output_text.delta ...,
                  output_text.done, content_part.done, output_item.done
      call        output_item.added, function_call_arguments.delta ...,
                  function_call_arguments.done, output_item.done
    response.completed (or response.incomplete: max_output_tokens cut it)

Each event is `event: <type>` and `data: {...}` with a `sequence_number`;
there is no [DONE]. The text is read as chat's stream reads it (the same
reasoning and tool-call parsers): a new kind of text, or a new call, closes
the open item and opens the next. A failure after the start is an `error`
event, then response.failed. As for chat, the first event leaves with the
first token, so a client that times it times the first token.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from msgspec.structs import replace

from service.errors import APIError
from service.protocol.replies import Delta, encoder
from service.responses.protocol import (
    FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage, OutputTextPart,
    OutputTokensDetails, ReasoningItem, ReasoningTextPart, ResponseError, ResponseObject,
    ResponseUsage,
)
from service.serving.admitted import Admission
from service.serving.chat_answer import choice_delta
from service.serving.reasoning import THINK_END, ReasoningPlan
from service.serving.usage import usage
from service.tool_calls.plan import ToolPlan

logger = logging.getLogger(__name__)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def finished(state, template: ResponseObject, admission: Admission, items: list,
             finish_reason: str | None) -> ResponseObject:
    """The response once its output is whole: status, output, usage."""
    thought = any(isinstance(item, ReasoningItem) for item in items)
    cut = finish_reason == "length"
    return replace(
        template, status="incomplete" if cut else "completed", output=items,
        usage=response_usage(state, admission, thought),
        incomplete_details=IncompleteDetails("max_output_tokens") if cut else None,
        completed_at=None if cut else int(time.time()))


def response_usage(state, admission: Admission, thought: bool) -> ResponseUsage:
    """Usage in the Responses shape; the thought's tokens are those up to `</think>`
    (an added token of its own: service/serving/reasoning.py check_tokenizer)."""
    counted = usage(admission)
    reasoning = 0
    if thought:
        token_ids = admission.latest[0].outputs[0].token_ids
        end = state.tokenizer.convert_tokens_to_ids(THINK_END)
        reasoning = token_ids.index(end) + 1 if end in token_ids else len(token_ids)
    return ResponseUsage(
        counted.prompt_tokens, InputTokensDetails(counted.prompt_tokens_details.cached_tokens),
        counted.completion_tokens, OutputTokensDetails(reasoning), counted.total_tokens)


class EventWriter:
    """One response's events, numbered; the output items as they open and close."""

    def __init__(self, template: ResponseObject) -> None:
        self.template = template
        self.sequence = 0
        self.items: list = []  # closed items, in output order
        self.open: OutputMessage | ReasoningItem | FunctionCallItem | None = None
        self.text = ""  # the open item's text, thought or arguments so far

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(payload) + b"\n\n"

    def _item_event(self, kind: str, **fields) -> bytes:
        return self.event(kind, item_id=self.open.id, output_index=len(self.items), **fields)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.template),
                self.event("response.in_progress", response=self.template)]

    def delta(self, delta: Delta) -> list[bytes]:
        """A chat delta's pieces: thought, answer, then call pieces."""
        events = []
        if delta.reasoning_content:
            if not isinstance(self.open, ReasoningItem):
                events += self._open(ReasoningItem(item_id("rs"), [], "in_progress"),
                                     ReasoningTextPart(""))
            events += self._text("response.reasoning_text.delta", delta.reasoning_content)
        if delta.content:
            if not isinstance(self.open, OutputMessage):
                events += self._open(OutputMessage(item_id("msg"), "in_progress", []),
                                     OutputTextPart(""))
            events += self._text("response.output_text.delta", delta.content, logprobs=[])
        for piece in delta.tool_calls or ():
            if piece.id is not None:  # a call's first piece: its id and name
                events += self._open(FunctionCallItem(item_id("fc"), piece.id,
                                                      piece.function.name, "", "in_progress"))
            arguments = piece.function.arguments if piece.function is not None else None
            if arguments and isinstance(self.open, FunctionCallItem):
                events += self._text("response.function_call_arguments.delta", arguments)
        return events

    def _open(self, item, part=None) -> list[bytes]:
        events = self.close("completed")
        self.open, self.text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.items),
                                 item=item))
        if part is not None:
            events.append(self._item_event("response.content_part.added", content_index=0,
                                           part=part))
        return events

    def _text(self, kind: str, text: str, **fields) -> list[bytes]:
        self.text += text
        extra = {} if kind.startswith("response.function_call") else {"content_index": 0}
        return [self._item_event(kind, delta=text, **extra, **fields)]

    def close(self, status: str) -> list[bytes]:
        """The open item's done events, with `status`; it joins the output."""
        item, text = self.open, self.text
        if item is None:
            return []
        if isinstance(item, FunctionCallItem):
            events = [self._item_event("response.function_call_arguments.done", arguments=text)]
            done = FunctionCallItem(item.id, item.call_id, item.name, text, status)
        else:
            if isinstance(item, OutputMessage):
                part = OutputTextPart(text)
                events = [self._item_event("response.output_text.done", content_index=0,
                                           text=text, logprobs=[])]
                done = OutputMessage(item.id, status, [part])
            else:
                part = ReasoningTextPart(text)
                events = [self._item_event("response.reasoning_text.done", content_index=0,
                                           text=text)]
                done = ReasoningItem(item.id, [part], status)
            events.append(self._item_event("response.content_part.done", content_index=0,
                                           part=part))
        events.append(self._item_event("response.output_item.done", item=done))
        self.items.append(done)
        self.open = None
        return events

    def finish(self, response: ResponseObject) -> list[bytes]:
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return [self.event(kind, response=response)]

    def fail(self, error: APIError) -> list[bytes]:
        """An `error` event, then response.failed (the SDK's two ways of hearing it)."""
        code = error.code or error.body().error.type
        return [self.event("error", code=code, message=error.message, param=error.param),
                self.event("response.failed", response=replace(
                    self.template, status="failed", output=self.items,
                    error=ResponseError(code, error.message)))]


async def response_events(state, admission: Admission, template: ResponseObject,
                          plan: ToolPlan | None,
                          thinking: ReasoningPlan | None) -> AsyncIterator[bytes]:
    """The events of one streamed response (sse_response sends them as they come)."""
    writer = EventWriter(template)
    parser = plan.new_parser() if plan is not None else None
    thinker = thinking.new_parser() if thinking is not None else None
    started, finish_reason = False, None
    try:
        async for update in admission.updates():
            if not started:
                started = True
                for chunk in writer.start():
                    yield chunk
            for choice in update.choices:
                finish_reason = choice.finish_reason or finish_reason
                delta, _ = choice_delta(choice, thinker, parser, plan)
                for chunk in writer.delta(delta):
                    yield chunk
        if not started:
            started = True
            for chunk in writer.start():
                yield chunk
        status = "incomplete" if finish_reason == "length" else "completed"
        events = writer.close(status)
        if not writer.items:  # nothing was written: an empty answer
            events += writer._open(OutputMessage(item_id("msg"), "in_progress", []),
                                   OutputTextPart("")) + writer.close(status)
        events += writer.finish(finished(state, template, admission, writer.items,
                                         finish_reason))
        for chunk in events:
            yield chunk
    except Exception as exc:  # never cut a stream without telling the client why
        if not isinstance(exc, APIError):
            logger.exception("stream failed")
            exc = APIError(500, f"internal error: {type(exc).__name__}")
        events = [] if started else writer.start()
        for chunk in events + writer.fail(exc):
            yield chunk
