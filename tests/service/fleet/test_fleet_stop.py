"""Fleet.stop is bounded: a task that outlives its cancel, or a Redis that does
not answer, never holds a server's shutdown (and so its engine) for long."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from service.fleet import replica
from service.fleet.replica import Fleet


async def _stubborn(started: asyncio.Event) -> None:
    """Swallows its first cancel, as a task deep in a library call may."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(3600)


def test_stop_gives_up_on_a_task_that_outlives_its_cancel(monkeypatch, caplog):
    monkeypatch.setattr(replica, "STOP_SECONDS", 0.5)

    async def scenario():
        fleet = Fleet.__new__(Fleet)  # only what stop() reads
        started = asyncio.Event()
        stubborn = asyncio.create_task(_stubborn(started))
        await started.wait()
        fleet._tasks = {stubborn}
        fleet.replica_id = "r1"
        # A client of a port nobody listens on: leave() fails at once, as a dead Redis does.
        fleet.client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
        begun = time.monotonic()
        await asyncio.wait_for(fleet.stop(), 20)  # an unbounded stop fails here, not hangs
        took = time.monotonic() - begun
        stubborn.cancel()
        return took

    took = asyncio.run(scenario())
    assert took < 3.0
    assert "still running" in caplog.text and "_stubborn" in caplog.text
