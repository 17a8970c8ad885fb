"""PoolingJob (service/serving/pooling.py): a request's inputs read together, and
every engine request still running aborted however the request ends (answered,
client gone, one input failed). Fake streams: no engine, no timing."""

from __future__ import annotations

import asyncio

import pytest

from engine.frontend.async_engine import EngineDeadError
from service.errors import APIError
from service.metrics import Metrics
from service.serving.pooling import PoolingJob


class Output:
    def __init__(self, name: str) -> None:
        self.name = name
        self.finished = True


class Stream:
    """One engine request's stream: its output after `delay` seconds, or an error,
    or nothing ever (delay None)."""

    def __init__(self, name: str, delay: float | None = 0.0, error: Exception | None = None):
        self.name, self.delay, self.error = name, delay, error
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return Output(self.name)

    def close(self) -> None:
        self.closed = True


class Request:
    """A client that stays, or one that disconnects after `leaves_after` seconds."""

    def __init__(self, leaves_after: float | None = None) -> None:
        self.leaves_after = leaves_after

    async def receive(self):
        if self.leaves_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.leaves_after)
        return {"type": "http.disconnect"}


def collect(streams, request):
    job = PoolingJob("req", streams, Metrics().timer(), "input")
    return asyncio.run(job.collect(request))


def test_outputs_come_back_in_the_inputs_order():
    streams = [Stream("a", 0.02), Stream("b", 0.0), Stream("c", 0.01)]
    assert [o.name for o in collect(streams, Request())] == ["a", "b", "c"]
    assert all(s.closed for s in streams)


def test_a_client_that_leaves_aborts_every_input():
    streams = [Stream("done"), Stream("running", None), Stream("queued", None)]
    assert collect(streams, Request(leaves_after=0.01)) is None
    assert all(s.closed for s in streams)


def test_one_failed_input_fails_the_request_and_aborts_the_rest():
    streams = [Stream("a", None), Stream("b", error=EngineDeadError("the engine died"))]
    with pytest.raises(APIError) as caught:
        collect(streams, Request())
    assert caught.value.status == 503 and caught.value.code == "engine_dead"
    assert all(s.closed for s in streams)
