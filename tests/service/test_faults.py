"""Overload, a dying engine, and clients that leave: the server must stay sane.

All against a real uvicorn server on the tiny random Llama, each test with a
server of its own (a dead engine or a tiny queue would spoil a shared one):

- a full queue answers 429 with Retry-After, and the accepted requests finish;
- a fault in the model runner kills the engine thread: open streams get an
  in-band error event and then [DONE], a waiting non-streaming request gets
  503, /health and new requests get 503, and the HTTP side keeps answering;
- clients that disconnect (streaming or not) have their requests aborted and
  every KV block back in the pool by the engine's next step. That is counted
  in engine steps, not seconds, so it means the same on a busy CI machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from engine.frontend.async_engine import Command
from live_server import LiveServer, is_error_event, run_server, tiny_config, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_MODEL_LEN = 1024  # the tiny model's max_position_embeddings: long generations


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    return error


def stats(live: LiveServer) -> dict[str, int]:
    """The engine thread's latest snapshot (what /metrics reports)."""
    return live.state.engine.stats.counters


def steps(live: LiveServer) -> int:
    """Engine steps run so far."""
    return live.state.engine.stats.num_steps


def step_when_released(live: LiveServer, still_open: int = 0) -> int:
    """The engine step count once the server has let go of the dropped requests.

    Seeing a disconnect is uvicorn's part and takes as long as the loop takes;
    from then on the engine's part is counted in steps.
    """
    assert wait_until(lambda: live.state.engine.num_open <= still_open, 30), (
        live.state.engine.num_open)
    return steps(live)


# An abort is a command the engine thread runs before its next step: the step
# under way when a client leaves, then the one that frees its blocks.
MAX_STEPS_TO_RELEASE = 2


def assert_all_released(live: LiveServer, since_step: int | None = None,
                        timeout: float = 30) -> None:
    """No request running or waiting and every KV block free, per /metrics; with
    `since_step`, within MAX_STEPS_TO_RELEASE engine steps of it (the timeout only
    keeps a failing test from hanging)."""
    def released() -> bool:
        m = live.metrics()
        return (m["pagedserve:num_requests_running"] == 0
                and m["pagedserve:num_requests_waiting"] == 0
                and m["pagedserve:kv_blocks_free"] == m["pagedserve:kv_blocks_total"])

    assert wait_until(released, timeout, interval=0.01), live.metrics()
    if since_step is not None:
        taken = steps(live) - since_step
        assert taken <= MAX_STEPS_TO_RELEASE, f"released only after {taken} engine steps"
    # The engine is idle now, so its own bookkeeping can be read directly.
    engine = live.engine
    assert wait_until(lambda: not engine.has_unfinished_requests(), 1)
    assert engine.block_manager.block_tables == {}
    engine.block_manager.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert wait_until(lambda: live.state.engine._streams == {}, 1), live.state.engine._streams


def data_lines(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# -- 429 when the queue is full ----------------------------------------------------------
def test_queue_full_gets_429_with_retry_after(tiny_llama_path):
    config = tiny_config(tiny_llama_path, engine={"max_num_seqs": 1},
                         max_waiting_requests=2, retry_after_seconds=7)
    max_tokens = 40

    async def flood(url: str) -> list[tuple[str, httpx.Response, list[str] | None]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            async def one(i: int):
                kind = ("chat", "completions", "chat-stream", "completions-batch")[i % 4]
                if kind == "chat":
                    path, body = CHAT, {"messages": [{"role": "user", "content": f"hi {i}"}]}
                elif kind == "completions":
                    path, body = COMPLETIONS, {"prompt": [5, 6, i]}
                elif kind == "chat-stream":
                    path, body = CHAT, {"messages": [{"role": "user", "content": f"yo {i}"}],
                                        "stream": True}
                else:  # three engine requests in one
                    path, body = COMPLETIONS, {"prompt": [[1, i], [2, i], [3, i]]}
                body.update(max_tokens=max_tokens, ignore_eos=True)
                if body.get("stream"):
                    async with client.stream("POST", path, json=body) as response:
                        if response.status_code != 200:
                            await response.aread()
                            return kind, response, None
                        lines = [line async for line in response.aiter_lines()]
                        return kind, response, lines
                return kind, await client.post(path, json=body), None

            return await asyncio.gather(*(one(i) for i in range(24)))

    with run_server(config) as live:
        results = asyncio.run(flood(live.url))
        refused = [(kind, r) for kind, r, _ in results if r.status_code == 429]
        accepted = [(kind, r, lines) for kind, r, lines in results if r.status_code == 200]
        assert len(refused) + len(accepted) == len(results), [r.text for _, r, _ in results]
        assert refused, "no request was refused: the queue limit is not enforced"
        # The limit counts engine requests, not HTTP ones: a three-prompt batch that
        # arrives first can fill the queue alone, so count the prompts admitted.
        admitted = sum(1 if lines is not None else len(r.json()["choices"])
                       for _, r, lines in accepted)
        assert admitted >= 2, [r.text for _, r in refused]
        for kind, response in refused:
            error = assert_error(response, 429, code="queue_full")
            assert error["type"] == "rate_limit_error"
            assert response.headers["retry-after"] == "7"
            assert "max_waiting_requests=2" in error["message"]
        for kind, response, lines in accepted:
            if lines is not None:  # a stream that was admitted runs to the end
                payloads = data_lines(lines)
                assert payloads[-1] == "[DONE]"
                assert not any(is_error_event(p) for p in payloads), payloads
                finish = [c["finish_reason"] for p in payloads[:-1]
                          for c in json.loads(p)["choices"]]
                assert finish[-1] == "length"
            else:
                body = response.json()
                assert all(c["finish_reason"] == "length" for c in body["choices"])
                assert body["usage"]["completion_tokens"] == max_tokens * len(body["choices"])
        # The queue drained: a request now succeeds, and nothing leaked (a batch whose
        # later prompts were refused dropped its earlier ones).
        response = httpx.post(live.url + COMPLETIONS, timeout=60,
                              json={"prompt": [9, 9, 9], "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert_all_released(live)
        assert live.metrics()["pagedserve:num_preemptions_total"] == 0


# -- a fault kills the engine thread -------------------------------------------------------
def test_engine_fault_fails_requests_and_keeps_the_server_up(tiny_llama_path, monkeypatch):
    config = tiny_config(tiny_llama_path, engine={"max_model_len": LONG_MODEL_LEN})
    long_run = {"max_tokens": 900, "ignore_eos": True}

    async def scenario(live: LiveServer):
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            streams = [
                await client.send(client.build_request("POST", CHAT, json={
                    "messages": [{"role": "user", "content": "tell me a story"}],
                    "stream": True, **long_run}), stream=True),
                await client.send(client.build_request("POST", COMPLETIONS, json={
                    "prompt": [[1, 2, 3], [4, 5, 6]], "stream": True, "n": 2, **long_run}),
                    stream=True),
            ]
            lines = [s.aiter_lines() for s in streams]
            seen: list[list[str]] = [[], []]
            try:
                for i, stream in enumerate(streams):
                    assert stream.status_code == 200, await stream.aread()
                    # Read until the stream carries generated text: the engine is running it.
                    while True:
                        line = await asyncio.wait_for(anext(lines[i]), 10)
                        seen[i].append(line)
                        if line.startswith("data: ") and len(seen[i]) >= 3:
                            break
                blocking = asyncio.create_task(client.post(COMPLETIONS, json={
                    "prompt": [7, 8, 9], **long_run}))
                # 1 chat + 2 prompts x n=2 + the non-streaming one.
                deadline = time.monotonic() + 10
                while stats(live)["num_requests_running"] < 6:
                    assert time.monotonic() < deadline, stats(live)
                    await asyncio.sleep(0.01)

                def boom(*args, **kwargs):
                    raise RuntimeError("injected fault in the model runner")

                monkeypatch.setattr(live.engine.runner, "execute", boom)
                faulted = time.monotonic()
                for i in range(len(streams)):
                    async def rest(i=i):
                        async for line in lines[i]:
                            seen[i].append(line)
                    await asyncio.wait_for(rest(), 10)  # the stream ends: no hang
                response = await asyncio.wait_for(blocking, 10)
                elapsed = time.monotonic() - faulted
            finally:
                for stream in streams:
                    await stream.aclose()
        return seen, response, elapsed

    with run_server(config) as live:
        seen, response, elapsed = asyncio.run(scenario(live))
        assert elapsed < 5, elapsed
        for lines in seen:
            payloads = data_lines(lines)
            assert payloads[-1] == "[DONE]", payloads[-3:]
            error = json.loads(payloads[-2])
            assert set(error) == {"error"}, error
            assert set(error["error"]) == {"message", "type", "param", "code"}
            assert error["error"]["code"] == "engine_dead"
            assert error["error"]["type"] == "service_unavailable"
            assert "injected fault" in error["error"]["message"]
            # Everything before the error was ordinary output.
            assert all("choices" in json.loads(p) for p in payloads[:-2])
        error = assert_error(response, 503, code="engine_dead")
        assert "injected fault" in error["message"]

        # The HTTP side is alive and quick; the engine is reported dead everywhere.
        assert live.server.started and not live.server.should_exit
        with httpx.Client(base_url=live.url, timeout=5) as client:
            started = time.monotonic()
            health = client.get("/health")
            assert health.status_code == 503, health.text
            assert health.json()["status"] == "dead"
            assert "injected fault" in health.json()["detail"]
            for path, body in ((CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                               (COMPLETIONS, {"prompt": "hi"}),
                               (COMPLETIONS, {"prompt": "hi", "stream": True})):
                assert_error(client.post(path, json=body), 503, code="engine_dead")
            assert_error(client.post("/reset_prefix_cache"), 503, code="engine_dead")
            assert client.get("/v1/models").status_code == 200
            assert client.get("/metrics").status_code == 200
            # Bad input is still told apart from a dead engine.
            assert_error(client.post(CHAT, json={"messages": []}), 400)
            assert time.monotonic() - started < 3
        assert live.state.engine._streams == {}


# -- clients that leave -------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_server(tiny_llama_path):
    """Room for 1000-token generations, so requests are still running when clients leave."""
    with run_server(tiny_config(tiny_llama_path, engine={"max_model_len": LONG_MODEL_LEN})) as live:
        yield live


LONG = {"max_tokens": 900, "ignore_eos": True}


def stream_body(i: int) -> tuple[str, dict, int]:
    """(path, body, engine sequences) of the i-th streaming request: a mix of shapes."""
    shape = i % 4
    if shape == 0:
        return CHAT, {"messages": [{"role": "user", "content": f"story {i}"}], **LONG}, 1
    if shape == 1:
        return CHAT, {"messages": [{"role": "user", "content": f"poem {i}"}], "n": 2, **LONG}, 2
    if shape == 2:
        return COMPLETIONS, {"prompt": [3, 4, 5, i], **LONG}, 1
    return COMPLETIONS, {"prompt": [[6, i], [7, i]], **LONG}, 2  # two engine requests


def test_dropped_streams_are_aborted_and_free_their_blocks(long_server):
    live = long_server
    tokens_before = live.metrics()["pagedserve:generation_tokens_total"]
    num = 20

    async def scenario() -> tuple[float, int]:
        limits = httpx.Limits(max_connections=num + 4)
        async with httpx.AsyncClient(base_url=live.url, timeout=20, limits=limits) as client:
            async def open_one(i: int):
                path, body, _ = stream_body(i)
                request = client.build_request("POST", path, json={**body, "stream": True})
                response = await client.send(request, stream=True)
                assert response.status_code == 200, await response.aread()
                lines = response.aiter_lines()
                chunks = 0
                while chunks < 4:  # a few chunks of generated text, then walk away
                    line = await asyncio.wait_for(anext(lines), 10)
                    chunks += line.startswith("data: ")
                    assert "[DONE]" not in line and not is_error_event(line), line
                # Keep the line iterator alive: dropping it closes the response early.
                return response, lines

            opened = await asyncio.gather(*(open_one(i) for i in range(num)))
            running = stats(live)["num_requests_running"]
            for response, _ in opened:
                await response.aclose()
            return step_when_released(live), running

    closed, running = asyncio.run(scenario())
    expected = sum(stream_body(i)[2] for i in range(num))
    assert running == expected, (running, expected)  # all were mid-generation when dropped
    assert_all_released(live, since_step=closed)
    # They were aborted, not run to the end: far fewer tokens than max_tokens per sequence.
    generated = live.metrics()["pagedserve:generation_tokens_total"] - tokens_before
    assert generated < expected * LONG["max_tokens"] / 2, generated
    # And the server serves on.
    response = httpx.post(live.url + COMPLETIONS, json={"prompt": [1, 2], "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200


@pytest.mark.parametrize("how", ["client-timeout", "task-cancelled"])
def test_abandoned_non_streaming_request_is_aborted(long_server, how):
    live = long_server
    tokens_before = live.metrics()["pagedserve:generation_tokens_total"]
    if how == "client-timeout":
        path, body, seqs = CHAT, {"messages": [{"role": "user", "content": "go"}], **LONG}, 1

        with pytest.raises(httpx.ReadTimeout):
            # The read timeout fires while the server is still generating; httpx then
            # drops the connection, which is all the server sees of it.
            httpx.post(live.url + path, json=body, timeout=httpx.Timeout(20, read=0.5))
        left_at = live.metrics()["pagedserve:generation_tokens_total"]
        closed = step_when_released(live)
    else:
        path, body, seqs = COMPLETIONS, {"prompt": [[1, 2, 3], [4, 5]], "n": 2, **LONG}, 4

        async def scenario() -> float:
            async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
                task = asyncio.create_task(client.post(path, json=body))
                deadline = time.monotonic() + 10
                while stats(live)["num_requests_running"] < seqs:
                    assert time.monotonic() < deadline, stats(live)
                    assert not task.done(), task.result().text
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return live.metrics()["pagedserve:generation_tokens_total"], step_when_released(live)

        left_at, closed = asyncio.run(scenario())
    assert_all_released(live, since_step=closed)
    # Cut short, and let go soon after the client left. Counted from the moment it
    # left, not from the start: how far the tiny model gets in the half second before
    # the read timeout is the machine's speed (475-920 tokens a second), not the
    # server's; 461 of 900 tokens once failed a bound of half from the start.
    total = live.metrics()["pagedserve:generation_tokens_total"]
    assert total - tokens_before < seqs * LONG["max_tokens"], total - tokens_before
    assert total - left_at < seqs * LONG["max_tokens"] / 2, (left_at - tokens_before, total - left_at)


def test_requests_dropped_while_queued_are_aborted(tiny_llama_path):
    """Clients that leave before their request ever ran take it out of the queue."""
    config = tiny_config(tiny_llama_path, engine={"max_model_len": LONG_MODEL_LEN,
                                                  "max_num_seqs": 1})

    async def scenario(live: LiveServer) -> float:
        async with httpx.AsyncClient(base_url=live.url, timeout=20) as client:
            async def open_stream(path: str, body: dict) -> httpx.Response:
                request = client.build_request("POST", path, json={**body, "stream": True})
                response = await client.send(request, stream=True)
                assert response.status_code == 200, await response.aread()
                return response

            first = await open_stream(COMPLETIONS, {"prompt": [1, 2, 3], **LONG})
            assert wait_until(lambda: stats(live)["num_requests_running"] == 1, 10)
            queued = [
                await open_stream(CHAT, {"messages": [{"role": "user", "content": "a"}], **LONG}),
                await open_stream(COMPLETIONS, {"prompt": [[4, 5], [6, 7]], **LONG}),
            ]
            posts = [asyncio.create_task(client.post(COMPLETIONS, json={"prompt": [8, i], **LONG}))
                     for i in range(2)]
            deadline = time.monotonic() + 10
            while stats(live)["num_requests_waiting"] < 5:  # 1 + 2 + 2 engine requests
                assert time.monotonic() < deadline, stats(live)
                await asyncio.sleep(0.01)
            # The engine thread is held while the clients leave, so the step count
            # when the server lets go is exact, and read again by a command that
            # runs behind the aborts: polling from here would count the steps a
            # busy machine takes to wake this thread too.
            held, release = threading.Event(), threading.Event()
            live.state.engine._submit(Command(lambda: (held.set(), release.wait(30))))
            assert held.wait(10)
            for response in queued:
                await response.aclose()
            for task in posts:
                task.cancel()
            await asyncio.gather(*posts, return_exceptions=True)
            closed = step_when_released(live, still_open=1)  # the first one runs on
            seen = []
            live.state.engine._submit(Command(lambda: seen.append(
                (len(live.state.engine.engine.scheduler.waiting), steps(live)))))
            release.set()
            assert wait_until(lambda: seen, 30)
            [(waiting, step)] = seen
            assert waiting == 0 and step - closed <= MAX_STEPS_TO_RELEASE, "left the queue late"
            # The one that runs is untouched and still streaming.
            assert stats(live)["num_requests_running"] == 1
            lines = first.aiter_lines()
            for _ in range(6):
                line = await asyncio.wait_for(anext(lines), 10)
                assert "[DONE]" not in line and not is_error_event(line), line
            await first.aclose()
            return step_when_released(live)

    with run_server(config) as live:
        closed = asyncio.run(scenario(live))
        assert_all_released(live, since_step=closed)
        response = httpx.post(live.url + COMPLETIONS, json={"prompt": [1, 2], "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 200


def test_refused_batch_does_not_hold_queue_slots(tiny_llama_path, monkeypatch):
    """A batch refused with 429 leaves the queue as it found it, even mid-step.

    The engine takes queued commands only between two steps. A batch whose
    later prompts are refused drops its earlier ones at once; those must not
    go on counting as waiting until the engine thread gets round to them, or
    one refused batch turns every request of the next step away.
    """
    config = tiny_config(tiny_llama_path, engine={"max_model_len": LONG_MODEL_LEN,
                                                  "max_num_seqs": 2},
                         max_waiting_requests=2)
    with run_server(config) as live:
        runner = live.engine.runner
        execute = runner.execute

        def slow_execute(*args, **kwargs):  # a big model: each step takes a while
            time.sleep(0.25)
            return execute(*args, **kwargs)

        monkeypatch.setattr(runner, "execute", slow_execute)
        with httpx.Client(base_url=live.url, timeout=30) as client:
            with client.stream("POST", COMPLETIONS, json={
                    "prompt": [1, 2, 3], "stream": True, **LONG}) as first:
                assert first.status_code == 200
                assert wait_until(lambda: stats(live)["num_requests_running"] == 1, 10)
                # One long request runs; a step is under way whenever the next one arrives.
                for _ in range(3):
                    # One seat is free: of four prompts one can run, three would
                    # wait, one more than max_waiting_requests=2.
                    refused = client.post(COMPLETIONS, json={
                        "prompt": [[4, 5], [6, 7], [8, 9], [1, 9]], "max_tokens": 2})
                    assert_error(refused, 429, code="queue_full")
                    accepted = client.post(COMPLETIONS, json={"prompt": [4, 5],
                                                              "max_tokens": 1})
                    assert accepted.status_code == 200, accepted.text
        monkeypatch.setattr(runner, "execute", execute)
        assert_all_released(live)
