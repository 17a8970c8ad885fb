"""AsyncEngine, the bridge between the asyncio service and the engine thread.

A real LLMEngine on the tiny random Llama runs behind every test; each test
drives the bridge from its own event loop (`asyncio.run`), with a timeout on
every await so that a bridge that loses a wake-up fails the test instead of
hanging it. What is checked:

  * outputs arrive in order, one token per step, and the last is finished;
  * an idle engine thread sleeps (its CPU time, read from /proc, stays ~0);
  * closing a stream, iterated or not, aborts the request: every KV block is
    free again after at most one more step;
  * call(fn) runs fn on the engine thread and hands back its result or error;
  * launch() builds the engine on the thread that then steps it, passes a
    build error on, and stops an engine whose launch was cancelled;
  * back-pressure: QueueFullError once max_waiting_requests are waiting;
  * a fault in a step kills the engine cleanly: open streams, pending calls
    and new requests all get EngineDeadError, nothing hangs;
  * shutdown() stops the thread and fails what is still open.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from engine.frontend.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from engine.frontend.request_stream import RequestStream
from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
TIMEOUT = 60  # seconds for any single await: a lost wake-up fails, it does not hang


def long_params(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


@pytest.fixture
def llm_engine(tiny_llama_path) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(tiny_llama_path), max_model_len=256, kv_cache_memory_bytes=64 << 20, dtype="float32",
    ))


def run(coro, timeout: float = TIMEOUT):
    """Run one test body on a fresh loop, failing (not hanging) past `timeout`."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


@asynccontextmanager
async def started(engine: LLMEngine, **kwargs):
    bridge = AsyncEngine(engine, **kwargs)
    bridge.start()
    try:
        yield bridge
    finally:
        bridge.shutdown(timeout=30)
        assert not bridge._thread.is_alive(), "the engine thread outlived shutdown()"


async def collect(stream: RequestStream) -> list:
    return [output async for output in stream]


async def engine_view(bridge: AsyncEngine) -> dict:
    """What the engine holds, read on the engine thread (its state is not thread-safe)."""
    def read(engine: LLMEngine) -> dict:
        manager = engine.block_manager
        return {
            "free": manager.num_free_blocks,
            "usable": manager.num_usable_blocks,
            "tables": len(manager.block_tables),
            "requests": len(engine.requests),
            "unfinished": engine.has_unfinished_requests(),
        }
    return await bridge.call(read)


def assert_all_free(view: dict) -> None:
    assert view["tables"] == 0 and view["requests"] == 0 and not view["unfinished"], view
    assert view["free"] == view["usable"], view


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU time of one thread of this process (Linux /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        # The command name (field 2) may hold spaces; count fields after its ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


# -- outputs -----------------------------------------------------------------------------
def test_outputs_arrive_in_order_and_the_last_is_finished(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            stream = bridge.generate("r1", PROMPT, long_params(24))
            outputs = await collect(stream)
            # The stream ends by itself after the finished output, and stays ended.
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            return outputs

    outputs = run(body())
    assert len(outputs) == 24  # one output per step, one token each
    for i, output in enumerate(outputs):
        assert output.request_id == "r1"
        assert output.prompt_token_ids == PROMPT
        (completion,) = output.outputs
        assert len(completion.token_ids) == i + 1
        assert completion.delta_token_ids == completion.token_ids[-1:]
        assert output.finished == (i == 23)
    assert outputs[-1].outputs[0].finish_reason == "length"
    # Cumulative and in order: each output extends the one before.
    for before, after in zip(outputs, outputs[1:]):
        assert after.outputs[0].token_ids[:-1] == before.outputs[0].token_ids


def test_concurrent_streams_each_get_their_own_outputs(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            streams = [bridge.generate(f"r{i}", PROMPT[: i + 2], long_params(10 + i))
                       for i in range(4)]
            results = await asyncio.gather(*(collect(s) for s in streams))
            return results, await engine_view(bridge)

    results, view = run(body())
    for i, outputs in enumerate(results):
        assert {o.request_id for o in outputs} == {f"r{i}"}
        assert len(outputs[-1].outputs[0].token_ids) == 10 + i and outputs[-1].finished
        assert not any(o.finished for o in outputs[:-1])
    assert_all_free(view)


def test_a_bad_request_fails_its_stream_only(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            bad = bridge.generate("bad", [llm_engine.vocab_size + 5], long_params(4))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await collect(bad)
            good = await collect(bridge.generate("good", PROMPT, long_params(3)))
            assert good[-1].finished and bridge.is_alive
            dup = bridge.generate("dup", PROMPT, long_params(50))
            with pytest.raises(ValueError, match="already in use"):
                bridge.generate("dup", PROMPT, long_params(50))
            dup.close()
            assert_all_free(await engine_view(bridge))

    run(body())


# -- idle --------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_idle_engine_thread_does_not_spin(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            native_id = bridge._thread.native_id
            # The measurement works: generating costs the thread visible CPU time.
            before = thread_cpu_seconds(native_id)
            await collect(bridge.generate("warm", PROMPT, long_params(100)))
            busy = thread_cpu_seconds(native_id) - before
            # Now idle (nothing queued, nothing running) for a second.
            await asyncio.sleep(0.2)
            before = thread_cpu_seconds(native_id)
            await asyncio.sleep(1.0)
            idle = thread_cpu_seconds(native_id) - before
            # And it still wakes up for new work after sleeping.
            woke = await collect(bridge.generate("after", PROMPT, long_params(3)))
            return busy, idle, woke

    busy, idle, woke = run(body())
    assert busy >= 0.02, f"the engine thread used {busy:.3f}s generating 100 tokens?"
    assert idle <= 0.03, f"the idle engine thread used {idle:.3f}s of CPU in 1 s (spinning)"
    assert woke[-1].finished



def test_an_engine_gone_idle_gives_its_freed_memory_back_once(llm_engine, monkeypatch):
    """The heap is trimmed when the last running request ends, not while any
    still runs, and not again on the idle wake-ups after it."""
    calls = []
    release = llm_engine.release_idle_memory
    monkeypatch.setattr(llm_engine, "release_idle_memory",
                        lambda: (calls.append(llm_engine.has_unfinished_requests()), release()))

    async def body():
        async with started(llm_engine) as bridge:
            await asyncio.gather(collect(bridge.generate("short", PROMPT, long_params(3))),
                                 collect(bridge.generate("long", PROMPT, long_params(30))))
            # A call runs on the engine thread after the step that ended them
            # (and its trim), and wakes it without a step: no second trim.
            await engine_view(bridge)
            first = list(calls)
            await engine_view(bridge)
            await collect(bridge.generate("again", PROMPT, long_params(2)))
            await engine_view(bridge)
            return first

    first = run(body())
    assert first == [False]
    assert calls == [False, False]


# -- abort -------------------------------------------------------------------------------
def test_closing_a_stream_mid_generation_frees_its_blocks_within_one_step(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            stream = bridge.generate("r1", PROMPT, long_params(200))
            seen = [await stream.__anext__() for _ in range(3)]
            holding = await engine_view(bridge)
            stream.close()
            # Read after close(): every step that starts from here on runs the abort first.
            steps_at_close = bridge.stats.num_steps
            after = await engine_view(bridge)  # queued behind the abort: runs after it
            steps_after = bridge.stats.num_steps
            # The closed stream yields nothing more; a second close is harmless.
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            stream.close()
            await stream.aclose()
            await asyncio.sleep(0.2)
            idle = await engine_view(bridge)
            return seen, holding, after, steps_after - steps_at_close, idle, bridge

    seen, holding, after, steps, idle, bridge = run(body())
    assert not any(o.finished for o in seen)
    assert holding["tables"] == 1 and holding["free"] < holding["usable"], holding
    assert_all_free(after)
    # At most the step that was in flight when close() ran.
    assert steps <= 1, f"{steps} steps ran between close() and the blocks coming back"
    assert_all_free(idle)
    assert not bridge._streams


def test_closing_a_never_iterated_stream_aborts_it(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            # Closed at once, most likely before the engine thread even took the request.
            bridge.generate("early", PROMPT, long_params(200)).close()
            first = await engine_view(bridge)
            # Closed once the engine is running it.
            stream = bridge.generate("running", PROMPT, long_params(200))
            running = await engine_view(bridge)
            await asyncio.sleep(0.05)  # a few steps
            stream.close()
            second = await engine_view(bridge)
            generated = llm_engine.num_generation_tokens
            await asyncio.sleep(0.3)
            return first, running, second, generated, llm_engine.num_generation_tokens

    first, running, second, generated, generated_later = run(body())
    assert_all_free(first)
    assert running["requests"] == 1 and running["unfinished"], running
    assert_all_free(second)
    assert generated < 200 and generated == generated_later, "the aborted request kept going"


def test_cancelling_the_consumer_task_and_closing_aborts(llm_engine):
    async def body():
        async with started(llm_engine) as bridge:
            stream = bridge.generate("r1", PROMPT, long_params(200))

            async def consume():
                try:
                    async for _ in stream:
                        pass
                finally:
                    stream.close()  # what a route handler does when its client leaves

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await engine_view(bridge)

    assert_all_free(run(body()))


# -- call ----------------------------------------------------------------------------
def test_call_runs_on_the_engine_thread_and_returns_or_raises(llm_engine):
    class Boom(Exception):
        pass

    def fail(engine):
        raise Boom("from the engine thread")

    async def body():
        async with started(llm_engine) as bridge:
            name = await bridge.call(lambda engine: threading.current_thread().name)
            same = await bridge.call(lambda engine: engine is llm_engine)
            with pytest.raises(Boom, match="from the engine thread"):
                await bridge.call(fail)
            # A failing call is the caller's problem, not a dead engine.
            assert bridge.is_alive and bridge.error is None
            outputs = await collect(bridge.generate("r1", PROMPT, long_params(3)))
            # Calls interleave with generation, between steps.
            stream = bridge.generate("r2", PROMPT, long_params(30))
            counts = [await bridge.call(lambda e: len(e.requests)) for _ in range(3)]
            rest = await collect(stream)
            return name, same, outputs, counts, rest

    name, same, outputs, counts, rest = run(body())
    assert name == "engine" and name != threading.current_thread().name
    assert same is True
    assert outputs[-1].finished
    assert counts == [1, 1, 1]
    assert rest[-1].finished


def engine_config(model_path) -> EngineConfig:
    return EngineConfig(model=str(model_path), max_model_len=256,
                        kv_cache_memory_bytes=64 << 20, dtype="float32")


def test_launch_builds_the_engine_on_the_thread_that_steps_it(tiny_llama_path):
    built_on = {}

    def build() -> LLMEngine:
        built_on["thread"] = threading.current_thread()
        return LLMEngine(engine_config(tiny_llama_path))

    async def body():
        bridge = await AsyncEngine.launch(build, max_waiting_requests=8)
        try:
            stepping = await bridge.call(lambda engine: threading.current_thread())
            outputs = await collect(bridge.generate("r1", PROMPT, long_params(3)))
            return bridge, stepping, outputs
        finally:
            bridge.shutdown(timeout=30)

    bridge, stepping, outputs = run(body())
    assert stepping is built_on["thread"] and stepping is not threading.current_thread()
    assert bridge.max_waiting_requests == 8 and outputs[-1].finished
    assert not stepping.is_alive(), "the engine thread outlived shutdown()"


def test_launch_passes_a_build_error_on(tiny_llama_path):
    def build() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        run(AsyncEngine.launch(build))


def test_a_cancelled_launch_stops_the_engine_it_built(tiny_llama_path):
    built_on = {}

    def build() -> LLMEngine:
        built_on["thread"] = threading.current_thread()
        time.sleep(0.5)  # still loading when the caller gives up
        return LLMEngine(engine_config(tiny_llama_path))

    async def body():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(AsyncEngine.launch(build), 0.1)
        await asyncio.sleep(0)

    run(body())
    built_on["thread"].join(timeout=60)
    assert not built_on["thread"].is_alive(), "a cancelled launch left its engine running"


# -- back-pressure -------------------------------------------------------------------------
def test_queue_full_once_max_waiting_requests_are_waiting(tiny_llama_path):
    # One seat: the first request runs, the next ones wait.
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_path), max_model_len=256, kv_cache_memory_bytes=64 << 20, dtype="float32",
        max_num_seqs=1,
    ))

    async def wait_for_waiting(bridge, count):
        deadline = time.monotonic() + 10
        while bridge.num_waiting != count:
            assert time.monotonic() < deadline, f"num_waiting={bridge.num_waiting}"
            await asyncio.sleep(0.01)

    async def body():
        async with started(engine, max_waiting_requests=2) as bridge:
            streams = [bridge.generate("running", PROMPT, long_params(200))]
            await wait_for_waiting(bridge, 0)
            streams.append(bridge.generate("w1", PROMPT, long_params(5)))
            streams.append(bridge.generate("w2", PROMPT, long_params(5)))
            await wait_for_waiting(bridge, 2)
            with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
                bridge.generate("w3", PROMPT, long_params(5))
            # The refused request left no trace; the bridge still serves.
            assert "w3" not in bridge._streams
            streams[0].close()  # the running one goes: the waiting ones get the seat
            results = await asyncio.gather(*(collect(s) for s in streams[1:]))
            await wait_for_waiting(bridge, 0)
            again = await collect(bridge.generate("w3", PROMPT, long_params(2)))
            return results, again, await engine_view(bridge)

    results, again, view = run(body())
    assert all(r[-1].finished for r in results) and again[-1].finished
    assert_all_free(view)


def test_requests_taken_by_the_thread_still_count_as_waiting(tiny_llama_path, monkeypatch):
    """Between the thread taking queued adds and the next stats snapshot, they still count.

    Otherwise a burst that arrives while a step runs would see num_waiting drop
    to what the previous snapshot said, and back-pressure would let it all in.
    """
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_path), max_model_len=256, kv_cache_memory_bytes=64 << 20, dtype="float32",
        max_num_seqs=1,
    ))
    real_execute = engine.runner.execute
    entered = threading.Semaphore(0)  # released as each step starts
    gate = threading.Semaphore(0)  # each release lets one step run
    opened = threading.Event()

    def gated(scheduled):
        entered.release()
        if not opened.is_set():
            assert gate.acquire(timeout=30)
        return real_execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", gated)

    async def step_started():
        assert await asyncio.to_thread(entered.acquire, True, 10), "no step started"

    async def body():
        async with started(engine, max_waiting_requests=2) as bridge:
            streams = [bridge.generate("running", PROMPT, long_params(50))]
            try:
                await step_started()  # step 1: the prefill of "running"
                gate.release()
                await step_started()  # step 2: "running" decodes, the snapshot says so
                assert bridge.num_waiting == 0
                streams += [bridge.generate(f"w{i}", PROMPT, long_params(3)) for i in (1, 2)]
                queued = bridge.num_waiting
                gate.release()  # step 2 ends; the thread takes w1, w2 and starts step 3
                await step_started()
                taken = bridge.num_waiting  # w1, w2 wait in the scheduler now
                with pytest.raises(QueueFullError):
                    streams.append(bridge.generate("w3", PROMPT, long_params(3)))
            finally:
                opened.set()
                gate.release()
            streams[0].close()
            results = await asyncio.gather(*(collect(s) for s in streams[1:]))
            return queued, taken, results

    queued, taken, results = run(body())
    assert queued == 2 and taken == 2, (queued, taken)
    assert len(results) == 2 and all(r[-1].finished for r in results)


def test_max_waiting_requests_must_be_positive(llm_engine):
    with pytest.raises(ValueError):
        AsyncEngine(llm_engine, max_waiting_requests=0)


# -- faults ------------------------------------------------------------------------------
def test_a_fault_in_a_step_kills_the_engine_without_hanging(llm_engine, monkeypatch):
    real_execute = llm_engine.runner.execute
    calls = 0

    def flaky_execute(scheduled):
        nonlocal calls
        calls += 1
        if calls > 5:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_execute(scheduled)

    monkeypatch.setattr(llm_engine.runner, "execute", flaky_execute)

    async def body():
        async with started(llm_engine) as bridge:
            streams = [bridge.generate(f"r{i}", PROMPT, long_params(100)) for i in range(3)]
            received = [[] for _ in streams]

            async def drain(i, stream):
                async for output in stream:
                    received[i].append(output)

            errors = await asyncio.gather(*(drain(i, s) for i, s in enumerate(streams)),
                                          return_exceptions=True)
            # The thread is gone and says why.
            deadline = time.monotonic() + 10
            while bridge._thread.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            state = (bridge.is_alive, bridge._thread.is_alive(), bridge.error)
            with pytest.raises(EngineDeadError, match="illegal memory access"):
                bridge.generate("late", PROMPT, long_params(5))
            with pytest.raises(EngineDeadError):
                await bridge.call(lambda engine: None)
            return errors, received, state

    errors, received, (alive, thread_alive, error) = run(body())
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    assert all("illegal memory access" in str(e) for e in errors)
    assert all(0 < len(r) < 100 for r in received)  # they were mid-stream
    assert alive is False and thread_alive is False
    assert isinstance(error, RuntimeError)


def test_a_call_pending_when_the_engine_dies_fails_instead_of_hanging(llm_engine, monkeypatch):
    """A call queued while the fatal step runs is never run: it must still be answered."""
    in_step = threading.Event()
    release = threading.Event()

    def stuck_then_fail(scheduled):
        in_step.set()
        release.wait(30)
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm_engine.runner, "execute", stuck_then_fail)

    async def body():
        async with started(llm_engine) as bridge:
            stream = bridge.generate("r1", PROMPT, long_params(10))
            assert await asyncio.to_thread(in_step.wait, 10)
            pending = asyncio.ensure_future(bridge.call(lambda engine: "ran"))
            await asyncio.sleep(0.05)
            release.set()
            with pytest.raises(EngineDeadError):
                await collect(stream)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(pending, 10)

    try:
        run(body())
    finally:
        release.set()


def test_shutdown_stops_the_thread_and_fails_open_streams(llm_engine):
    async def body():
        bridge = AsyncEngine(llm_engine)
        bridge.start()
        stream = bridge.generate("r1", PROMPT, long_params(200))
        first = await stream.__anext__()
        untouched = bridge.generate("r2", PROMPT, long_params(200))
        bridge.shutdown(timeout=30)
        thread_alive = bridge._thread.is_alive()
        errors = []
        for s in (stream, untouched):
            try:
                async for _ in s:
                    pass
            except EngineDeadError as exc:
                errors.append(exc)
        with pytest.raises(EngineDeadError):
            bridge.generate("r3", PROMPT, long_params(5))
        with pytest.raises(EngineDeadError):
            await bridge.call(lambda engine: None)
        return first, thread_alive, errors, bridge.is_alive

    first, thread_alive, errors, alive = run(body())
    assert not first.finished
    assert thread_alive is False and alive is False
    assert len(errors) == 2 and all("shutting down" in str(e) for e in errors)


def test_shutdown_answers_a_call_that_was_still_queued(llm_engine, monkeypatch):
    in_step = threading.Event()
    release = threading.Event()
    real_execute = llm_engine.runner.execute

    def slow_execute(scheduled):
        in_step.set()
        release.wait(30)
        return real_execute(scheduled)

    monkeypatch.setattr(llm_engine.runner, "execute", slow_execute)

    async def body():
        bridge = AsyncEngine(llm_engine)
        bridge.start()
        stream = bridge.generate("r1", PROMPT, long_params(10))
        assert await asyncio.to_thread(in_step.wait, 10)
        pending = asyncio.ensure_future(bridge.call(lambda engine: "ran"))
        await asyncio.sleep(0.05)
        # The step in flight ends a moment after shutdown() starts waiting for it.
        threading.Timer(0.2, release.set).start()
        bridge.shutdown(timeout=30)
        assert not bridge._thread.is_alive()
        with pytest.raises(EngineDeadError):
            await collect(stream)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending, 10)

    try:
        run(body())
    finally:
        release.set()
