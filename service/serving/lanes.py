"""Prep lanes: where a request's preparation runs, and when it is dropped.

Before a request reaches the engine its chat template is rendered, its text
tokenized and its output constraint compiled. None of that may run on the
event loop (a megabyte prompt would stall every stream and /health), and no
request's preparation may hold up another's. So it runs in lanes of threads:

    lane    work                                      threads                priority
    light   chat templates, tokenizing                --prep-threads (4)     normal
    heavy   grammar compiles (serving/constraints.py)  --compile-threads (2)  normal, then
                                                                             lowest after 1 s

A compile can run for a second or so (a constraint priced past that is
refused before it is queued: engine/sampling/compile_price.py,
grammar_checks.py), so compiles have their own lane and a plain request
always finds a light thread. The heavy lane takes its jobs in turn by tenant
(service/serving/fair_queue.py: the API key, else the client's address), one
running compile per tenant: a tenant never waits behind another tenant's
queue, and, while no more tenants compile than there are threads, behind no
other tenant's compile at all. A compile still running after a second (a schema or a tool list takes milliseconds to half
a second) goes on at the lowest CPU priority (Linux: its thread's nice value
19), so on a small CPU it gets what the engine's steps leave over and running
streams keep their pace; its thread then retires, as a thread cannot raise
its priority back without a privilege, and a fresh one takes its place.

A request is given up when its client disconnects while it is prepared
(`unless_gone`, ClientGone: answered quietly). Its jobs still queued are
taken out of the queue and never start; a job already running, which Python
cannot stop (xgrammar compiles in C++, with no way to interrupt it), runs to
its end, bounded by the price check, holding its tenant's place, and its
result is thrown away.

Refused before any of that, by size alone: service/guards/limits.py.

The lanes' threads are daemon threads of their own, not a ThreadPoolExecutor:
the interpreter joins an executor's threads at exit, and a compile that runs
for minutes would hold up the process's exit after SIGTERM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from service.errors import ClientGone
from service.serving.fair_queue import FairQueue

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A compile still running after this long goes on at the lowest CPU priority.
DEMOTE_AFTER_SECONDS = 1.0
LOWEST_PRIORITY = 19  # its nice value
# Compiles of one tenant running at once: the rest of its compiles wait their turn.
COMPILES_PER_TENANT = 1


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # given up meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Lane:
    """`threads` worker threads taking jobs from a queue, in turn by tenant
    (FairQueue: at most `per_tenant` of a tenant's jobs running at once).

    With `demote_after`, a job still running after that many seconds has its
    thread lowered to the lowest CPU priority; that thread retires after the
    job (raising a priority back takes a privilege) and a fresh one takes its place.
    """

    def __init__(self, name: str, threads: int, demote_after: float | None = None,
                 per_tenant: int | None = None) -> None:
        self.name = name
        self.demote_after = demote_after
        self.jobs: FairQueue[_Job] = FairQueue(per_tenant)
        self._numbers = itertools.count()
        self._threads = threads
        for _ in range(threads):
            self._start_worker()

    async def run(self, fn: Callable[..., T], *args: Any, tenant: str = "") -> T:
        """fn(*args) on one of the lane's threads, in `tenant`'s turn; its errors re-raise here.

        Cancelled while it waits (its client left), the job is taken out of the
        queue if it has not started, and its result is thrown away if it has.
        """
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        self.jobs.put(tenant, job)
        try:
            return await job.future
        finally:
            self.jobs.discard(tenant, job)  # done or given up: never started after this

    def close(self) -> None:
        """Stop the threads once the jobs queued before this have started."""
        self.jobs.stop(self._threads)

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name=f"{self.name}-{next(self._numbers)}",
                         daemon=True).start()

    def _work(self) -> None:
        while (taken := self.jobs.take()) is not None:
            tenant, job = taken
            try:
                demoted = self._run(job)
            finally:
                self.jobs.done(tenant)
            if demoted:
                # A thread starts at its creator's priority: the loop's thread
                # starts the replacement, not this one.
                try:
                    job.loop.call_soon_threadsafe(self._start_worker)
                except RuntimeError:  # the loop has closed: the server is stopping
                    pass
                return
            taken = job = None  # hold nothing while waiting for the next job

    def _run(self, job: _Job) -> bool:
        """Run one job and settle it; whether its thread was demoted meanwhile."""
        demoted: list[bool] = []
        timer = None
        if self.demote_after is not None:
            thread_id = threading.get_native_id()
            timer = threading.Timer(self.demote_after, lambda: demoted.append(
                lower_priority(thread_id, LOWEST_PRIORITY)))
            timer.daemon = True
            timer.start()
        try:
            result = job.fn(*job.args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the loop
            job.settle(error=exc)
        else:
            job.settle(result)
        if timer is not None:
            timer.cancel()
            timer.join()  # had it fired, it is done now
        return any(demoted)


def lower_priority(thread_id: int, nice: int) -> bool:
    """Give a thread of this process (Linux: a task of its own) a nice value;
    elsewhere nothing. Whether it took."""
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)
    except (AttributeError, OSError) as exc:
        logger.debug("cannot lower the priority of thread %d: %s", thread_id, exc)
        return False
    return True


@dataclass(eq=False)
class Prep:
    """The server's two lanes: the light one first come, first served; the heavy
    one in turn by tenant, one running compile per tenant."""

    light_threads: int = 4
    heavy_threads: int = 2
    light: Lane = field(init=False)
    heavy: Lane = field(init=False)

    def __post_init__(self) -> None:
        self.light = Lane("prep", self.light_threads)
        self.heavy = Lane("prep-compile", self.heavy_threads, demote_after=DEMOTE_AFTER_SECONDS,
                          per_tenant=COMPILES_PER_TENANT)

    def close(self) -> None:
        self.light.close()
        self.heavy.close()


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone as soon as the client disconnects.

    `work` is then cancelled: its lane jobs are dropped or their results
    thrown away, and it never reaches the engine. Only for a request whose
    body has been read: what `receive` gives after that is the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let it unwind; drop its error
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
