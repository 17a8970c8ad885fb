"""AsyncEngine: the bridge between the asyncio service and the engine thread.

The engine is synchronous and owns its state alone (scheduler, block manager,
KV cache). The service runs on an asyncio loop and must never block it. So the
engine gets its own thread, and the two sides talk only through two hops:

    asyncio loop                                   engine thread
    ------------                                   -------------
    generate() ──► commands (deque, under a lock) ─► loop {
                   + notify the condition               run queued commands (add / abort / ...)
                                                         outputs = LLMEngine.step()
    per-request   ◄── loop.call_soon_threadsafe ◄──     hand the step's outputs over at once
    asyncio.Queue                                        publish a stats snapshot
                                                       }   (sleeps on the condition when idle)

Every change to engine state happens on the engine thread, as a command run
between two steps; the asyncio side only reads an immutable stats snapshot.
An abort therefore takes effect at the start of the next step, which is when
the request's blocks go back to the pool.

If a step raises, the engine is dead: every in-flight request gets the error,
later requests are refused at once and `/health` reports it. Nothing waits
forever on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.frontend.bridge import Command, EngineDeadError, EngineStats, QueueFullError
from engine.frontend.llm_engine import LLMEngine
from engine.frontend.request_stream import RequestStream
from engine.model.cpu_allocator import one_arena
from engine.model.kv_cache import dtype_name
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 1024,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """`on_step(seconds)` is called on the engine thread after every step that ran."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 1")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._on_step = on_step
        self._commands: deque[Command] = deque()
        self._num_queued_adds = 0
        self._adds_taken = 0  # adds the thread took but no stats snapshot counts yet
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Where each open request's outputs go; touched only on the loop.
        self._streams: dict[str, asyncio.Queue] = {}
        # Futures of call()s not answered yet; failed with the streams if the thread stops.
        self._calls: set[asyncio.Future] = set()
        self.error: BaseException | None = None
        self.stats = EngineStats(counters=engine.stats())

    # -- life cycle --------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        one_arena()  # its steps' activations from the main heap (cpu_allocator says why)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @classmethod
    async def launch(cls, build: Callable[[], LLMEngine], **options: Any) -> AsyncEngine:
        """Build the engine on a new engine thread, then step it there. Not built
        elsewhere and start()ed: libgomp keeps a worker pool per thread that ran
        a parallel region, and with more of them than cores its workers sleep
        between regions; a loader thread's idle pool made one stream decode
        1.5x slower on 2 cores (docs/performance.md, speed log item 25)."""
        loop = asyncio.get_running_loop()
        handed: concurrent.futures.Future = concurrent.futures.Future()

        def main() -> None:
            try:
                bridge = cls(build(), **options)
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                if handed.set_running_or_notify_cancel():
                    handed.set_exception(exc)
                return
            if not handed.set_running_or_notify_cancel():  # the caller gave up meanwhile
                bridge.engine.close()
                return
            bridge._loop, bridge._thread = loop, threading.current_thread()
            handed.set_result(bridge)
            bridge._run()

        one_arena()  # its steps' activations from the main heap (cpu_allocator says why)
        threading.Thread(target=main, name="engine", daemon=True).start()
        try:
            return await asyncio.wrap_future(handed)
        except asyncio.CancelledError:
            if not handed.cancel():  # too late: it was being handed over; stop it
                handed.add_done_callback(_shut_down_unclaimed)
            raise

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved config (max_model_len filled in from the model)."""
        return self.engine.config

    @property
    def fingerprint(self) -> bytes:
        """The model fingerprint in every block hash (fixed at load: safe from the loop)."""
        return self.engine.fingerprint

    @property
    def pooling(self):
        """A pooling model's PoolingInfo (what it answers), None for a generator (fixed at load)."""
        return self.engine.pooling

    @property
    def kv_cache_dtype(self) -> str:
        """The dtype of the KV cache, as a name ("int8"): a block's identity across replicas."""
        return dtype_name(self.engine.runner.kv_cache_dtype)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still open get an error."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()  # after the join: no step publishes into a closed publisher
        self._fail_all(EngineDeadError("the server is shutting down"))

    # -- the asyncio side --------------------------------------------------------------
    def generate(self, request_id: str, prompt: str | list[int], params, *,
                 add_special_tokens: bool = True, cache_salt: str | None = None,
                 priority: int = 0, lora_request=None,
                 token_type_ids: list[int] | None = None) -> "RequestStream":
        """Submit a request now; iterate the returned stream for its outputs.

        Refusals (engine dead, queue full) raise here, before anything is
        streamed, so the caller can still answer with an HTTP status; call
        check_prompt() and check_params() first for what the engine cannot run. Closing
        the stream before its last output (client gone, task cancelled)
        aborts the request, which frees its blocks on the next step. `params`:
        SamplingParams, or PoolingParams on a pooling engine (one PoolingRequestOutput).
        """
        self._check_can_accept()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params,
                                        add_special_tokens=add_special_tokens, cache_salt=cache_salt,
                                        priority=priority, lora_request=lora_request,
                                        token_type_ids=token_type_ids)
            except Exception as exc:  # a bad request, not a broken engine
                self._deliver_soon([(request_id, exc)])

        self._submit(Command(add, adds=request_id))
        return RequestStream(self, request_id, queue)

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raise a ValidationError for a prompt the engine cannot run (safe from the loop)."""
        self.engine.check_prompt(token_ids)

    def check_params(self, params: SamplingParams) -> None:
        """Raise a ValidationError for settings the engine cannot run (safe from the loop)."""
        self.engine.check_params(params)

    def release(self, request_id: str) -> None:
        """The consumer is gone: abort the request unless the engine already finished it."""
        if self._streams.pop(request_id, None) is not None:
            if not self._unqueue_add(request_id):
                self.abort(request_id)

    def _unqueue_add(self, request_id: str) -> bool:
        """Drop a request the thread has not taken yet; True if it was still queued.

        Otherwise it would count as waiting until the thread's next loop, a
        whole step away: a batch refused with 429 after its first prompts were
        queued would turn every other request away meanwhile.
        """
        with self._wakeup:
            for command in self._commands:
                if command.adds == request_id:
                    self._commands.remove(command)
                    self._num_queued_adds -= 1
                    return True
        return False

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the start of the next step."""
        self._submit(Command(lambda: self.engine.abort_request(request_id)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps; return its result."""
        self._check_alive()
        future = self._loop.create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:
                self._loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(Command(command))
        return await future

    async def mark_popular(self, block_hashes: list[bytes]) -> int:
        """LLMEngine.mark_popular, run on the engine thread."""
        return await self.call(lambda engine: engine.mark_popular(block_hashes))

    async def cached_prefix_blocks(self, chains: list[list[bytes]]) -> list[int]:
        """LLMEngine.cached_prefix_blocks, run on the engine thread (which owns the cache)."""
        return await self.call(lambda engine: engine.cached_prefix_blocks(chains))

    @property
    def num_open(self) -> int:
        """Requests with a consumer that the engine has not finished (asyncio side)."""
        return len(self._streams)

    def fail_open(self, error: BaseException) -> None:
        """End every open request now: its consumer gets `error`; the engine aborts it.

        For a shutdown whose grace ran out: each client is told why its
        answer stops instead of seeing its connection cut.
        """
        for request_id in self._streams:
            self.abort(request_id)
        self._end_streams(error)

    @property
    def num_waiting(self) -> int:
        """Requests that truly wait: the scheduler's queue, plus those queued for the
        thread beyond the seats free now (those will run at the next step).

        Counting every queued request would turn an idle server's third
        request away with --max-num-seqs 4 --max-waiting-requests 2.
        """
        counters = self.stats.counters
        waiting = counters.get("num_requests_waiting", 0)
        free_seats = 0
        if not waiting:  # a queue in the scheduler means no seat is free for newcomers
            free_seats = max(0, self.config.max_num_seqs - counters.get("num_requests_running", 0))
        return waiting + max(0, self._num_queued_adds - free_seats)

    @property
    def fault(self) -> str | None:
        """Why the engine broke, which only a restart mends (None: it did not)."""
        if self.error is not None:
            return f"the engine stopped after an error: {self.error!r}"
        if self.engine.failure is not None:  # a worker died, perhaps while the engine idled
            return f"the engine cannot step: {self.engine.failure}"
        return None

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        if self.fault is None and (self._stopping or not self.is_alive):
            return "the engine is not running"
        return self.fault

    def _check_alive(self) -> None:
        reason = self.failure
        if reason is not None:
            raise EngineDeadError(reason)

    def _check_can_accept(self) -> None:
        self._check_alive()
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.max_waiting_requests})"
            )

    def _submit(self, command: Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._num_queued_adds += command.adds is not None
            self._wakeup.notify()

    # -- delivery (runs on the loop) -------------------------------------------------
    def _deliver_soon(self, items: list[tuple[str, Any]]) -> None:
        """From the engine thread: hand a batch of outputs or errors to the loop."""
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            queue = self._streams.get(request_id)
            if queue is None:  # the consumer already left
                continue
            queue.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:  # the queue keeps the unread
                del self._streams[request_id]

    def _end_streams(self, error: BaseException) -> None:
        """Hand every open request's consumer `error` and forget the request."""
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()

    def _fail_all(self, error: BaseException) -> None:
        self._end_streams(error)
        # A call still queued when the thread stopped will never run: answer it now.
        for future in list(self._calls):
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    # -- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    return
                for command in commands:
                    command.run()
                outputs = []
                stepped = engine.has_unfinished_requests()
                if stepped:
                    started = time.perf_counter()
                    outputs = engine.step()
                    elapsed = time.perf_counter() - started
                    self.stats = EngineStats(engine.stats(), engine.offload_stats(), elapsed,
                                             self.stats.num_steps + 1)
                    if self._on_step is not None:
                        self._on_step(elapsed)
                else:
                    self.stats = EngineStats(engine.stats(), engine.offload_stats(),
                                             self.stats.step_seconds, self.stats.num_steps)
                if self._adds_taken:  # the snapshot counts them now: stop counting them twice
                    with self._wakeup:
                        self._num_queued_adds -= self._adds_taken
                        self._adds_taken = 0
                self._deliver_soon([(output.request_id, output) for output in outputs])
                if stepped and not engine.has_unfinished_requests():
                    engine.release_idle_memory()  # the last request just finished: idle now
        except BaseException as exc:  # noqa: BLE001 - any fault kills the engine
            logger.exception("the engine thread failed; the engine is now dead")
            self.error = exc
            dead = EngineDeadError(self.failure)
            self._loop.call_soon_threadsafe(self._fail_all, dead)

    def _wait_for_work(self) -> list[Command] | None:
        """Take the queued commands, sleeping while there is nothing to do."""
        with self._wakeup:
            while not (self._stopping or self._commands
                       or self.engine.has_unfinished_requests()):
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            # Still counted in num_waiting until the next stats snapshot includes them.
            self._adds_taken = self._num_queued_adds
            return commands


def _shut_down_unclaimed(handed: concurrent.futures.Future) -> None:
    """A launched engine nobody awaited any more: stop it (off the loop: shutdown joins)."""
    if handed.exception() is None:
        threading.Thread(target=handed.result().shutdown, daemon=True).start()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
