"""An admitted request: its engine streams, read as changed choices, closed once.

    admit() ──► Admission(request_id, [TimedStream per prompt], model, lora)
                    │
                    ├── updates()   each engine output's changed choices (streaming)
                    ├── collect()   the final outputs, or None if the client left
                    │               first (non-streaming)
                    └── close()     aborts whatever still runs (safe to repeat);
                                    collect() and streaming.sse_response() call it

A chat request has one prompt; a completions request may carry a batch, each
prompt its own engine request, their outputs interleaved as they come. A
streamed request asks the engine for DELTA outputs, which hold only the choices
that changed and only what each one added; a non-streamed one asks for
FINAL_ONLY, one whole output per prompt (service/serving/state.py). So no output
holds a stream's cumulative tokens: the completion tokens are counted here as
they come (`num_completion_tokens`), for usage.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from engine.frontend.async_engine import EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput
from engine.frontend.request_stream import RequestStream
from engine.model.lora.request import LoRARequest
from service.errors import APIError
from service.metrics import RequestTimer


class TimedStream:
    """A RequestStream that records latency metrics and reports a dead engine as 503."""

    def __init__(self, stream: RequestStream, timer: RequestTimer, choices: int = 1) -> None:
        self.stream = stream
        self.timer = timer
        self.num_tokens = 0  # completion tokens received so far, over all choices
        self.choices = choices  # the request's n
        self._ended: set[int] = set()  # choices whose end was counted (metrics)

    def __aiter__(self) -> "TimedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self.stream.__anext__()
        except EngineDeadError as exc:
            self._end_open("error")
            raise APIError(503, str(exc), code="engine_dead") from None
        except APIError:  # the server ended it (shutdown's grace is over)
            self._end_open("error")
            raise
        for c in output.outputs:
            if c.finish_reason is not None and c.index not in self._ended:
                self._ended.add(c.index)
                self.timer.ended(c.finish_reason)
        # `delta_token_ids` is what this output adds (the service asks DELTA
        # for every request, so each token is timed as it arrives).
        count = sum(len(c.delta_token_ids) for c in output.outputs)
        self.num_tokens += count
        self.timer.tokens(count)
        if output.finished:
            self.timer.finished()
        return output

    def close(self) -> None:
        """Abort the request if it still runs; its open choices count as aborted."""
        self._end_open("abort")
        self.stream.close()

    def _end_open(self, reason: str) -> None:
        self.timer.ended(reason, self.choices - len(self._ended))
        self._ended.update(range(self.choices))


@dataclass(frozen=True)
class Update:
    """One engine output of prompt `prompt_index`, with the choices it changed."""

    prompt_index: int
    output: RequestOutput
    choices: list[CompletionOutput]


@dataclass(eq=False)
class Admission:
    request_id: str
    streams: list[TimedStream]
    model: str  # what the answer calls the model: the request's adapter, or the base
    lora: LoRARequest | None = None  # the LoRA adapter it runs under
    # Each prompt's DELTA outputs folded into one: a non-streamed request's
    # whole answer, and the prompt and cached tokens that usage counts.
    latest: list[RequestOutput | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.latest = [None] * len(self.streams)

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens received so far, over every prompt and choice."""
        return sum(stream.num_tokens for stream in self.streams)

    async def updates(self) -> AsyncIterator[Update]:
        """Changed choices as the engine reports them, until every prompt finished."""
        async for index, output in merge(self.streams):
            whole = self.latest[index]
            if whole is None:
                self.latest[index] = copy.deepcopy(output)
            else:
                whole.add(output)
            changed = [c for c in output.outputs if c.changed]
            if changed:
                yield Update(index, output, changed)

    async def collect(self, request: Request) -> list[RequestOutput] | None:
        """Every prompt's final output, or None if the client disconnects first.

        A non-streaming client that leaves would otherwise keep its request
        generating until max_tokens; uvicorn reports the disconnect as a
        message on `receive`, which is all this watches for.
        """

        async def drain() -> None:
            async for _ in self.updates():
                pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                return None  # the client is gone; the finally below aborts its requests
            work.result()  # re-raises an engine error as its APIError
            return list(self.latest)
        finally:
            for task in (work, watcher):
                task.cancel()
            self.close()

    def close(self) -> None:
        """Abort every prompt that has not finished; safe to call again."""
        for stream in self.streams:
            stream.close()


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as items arrive: yields (which, item).

    Closing the merge (client gone) cancels every reader; the caller's close()
    then aborts every request.
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
