"""One request's preparation never holds up another's (issue 38, row 1).

Before a request reaches the engine its chat template is rendered, its text
tokenized and its constraint compiled (service/serving/lanes.py). All of it once
shared one thread, so a hostile JSON schema compiling for 100 s stalled
every new request, and went on compiling after its client had left. Here a
compile or a render is made slow on purpose (a sleep, which like xgrammar's
compile holds no GIL), so the timings are the test's own, not the machine's;
the server is real and so is HTTP.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

import service.serving.chat as chat_route
from live_server import LiveServer, run_server, tiny_config, wait_until
from service.serving.lanes import LOWEST_PRIORITY, Lane

CHAT = "/v1/chat/completions"
PLAIN = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
         "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as live:
        yield live


class SlowCompiles:
    """The engine's compile made `seconds` slower the first time it meets a regex
    that starts with "slow"; later calls are quick, as xgrammar's cache makes them."""

    def __init__(self, live: LiveServer) -> None:
        self.compiler = live.engine.structured_outputs
        self.real = self.compiler.compile
        self.seconds = 0.0
        self.started: list[str] = []  # the slow compiles that began
        self.running = threading.Event()
        self.ended = threading.Event()  # a slow compile's wait is over
        self.compiler.compile = self.compile

    def compile(self, params):
        regex = params.regex or ""
        if regex.startswith("slow") and regex not in self.started:
            self.started.append(regex)
            self.running.set()
            time.sleep(self.seconds)
            self.ended.set()
        return self.real(params)

    def restore(self) -> None:
        del self.compiler.compile  # the instance attribute: the method shows again


@pytest.fixture
def slow(server):
    compiles = SlowCompiles(server)
    yield compiles
    compiles.restore()


def constrained(regex: str) -> dict:
    return {**PLAIN, "structured_outputs": {"regex": regex}}


def post(live: LiveServer, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{live.url}{CHAT}", json=body, timeout=kwargs.pop("timeout", 60),
                      **kwargs)


def idle(live: LiveServer) -> bool:
    m = live.metrics()
    return (m["pagedserve:num_requests_running"] == 0
            and m["pagedserve:num_requests_waiting"] == 0
            and m["pagedserve:kv_cache_usage_perc"] == 0)


def timed(fn, *args) -> tuple[float, object]:
    started = time.monotonic()
    result = fn(*args)
    return time.monotonic() - started, result


def test_a_slow_compile_does_not_hold_up_a_plain_chat(server, slow):
    slow.seconds = 8.0
    answers: list[httpx.Response] = []
    heavy = [threading.Thread(target=lambda i=i: answers.append(
        post(server, constrained(f"slow{i}[a-z]")))) for i in range(2)]
    for thread in heavy:
        thread.start()
    assert slow.running.wait(30), "no slow compile began"
    took, response = timed(post, server, PLAIN)
    assert response.status_code == 200, response.text
    # Answered while the first compile still ran (before: after both, 16 s, behind
    # them on the one prep thread). Against the compile, not the clock: a busy
    # machine slows the chat, not the sleep.
    assert not slow.ended.is_set(), f"a plain chat took {took:.2f} s, longer than a compile"
    for thread in heavy:
        thread.join(60)
    assert [a.status_code for a in answers] == [200, 200]


def test_requests_whose_clients_left_are_dropped_from_the_prep_lanes(server, slow):
    slow.seconds = 3.0

    def leave(i: int) -> None:  # waits half a second for the answer, then hangs up
        with pytest.raises(httpx.ReadTimeout):
            post(server, constrained(f"slow{i}[a-z]"), timeout=httpx.Timeout(30, read=0.5))

    leaving = [threading.Thread(target=leave, args=(i,)) for i in range(3)]
    for thread in leaving:
        thread.start()
    for thread in leaving:
        thread.join(30)
    response = post(server, constrained("fast[a-z]"))
    assert response.status_code == 200, response.text
    # Only the compile that had begun runs on; the two queued behind it never
    # start (before: all three ran, 9 s, and this request waited behind them).
    assert len(slow.started) == 1, slow.started
    assert wait_until(lambda: idle(server), 30), server.metrics()  # none reached the engine


def test_a_slow_render_does_not_hold_up_another_chat(server, monkeypatch):
    real = chat_route.render_chat_text
    began, ended = threading.Event(), threading.Event()

    def render(tokenizer, messages, *args, **kwargs):
        if messages[-1]["content"] == "slow":
            began.set()
            time.sleep(8.0)
            ended.set()
        return real(tokenizer, messages, *args, **kwargs)

    monkeypatch.setattr(chat_route, "render_chat_text", render)
    slow_chat = threading.Thread(target=post, args=(server, {
        **PLAIN, "messages": [{"role": "user", "content": "slow"}]}))
    slow_chat.start()
    assert began.wait(30)
    took, response = timed(post, server, PLAIN)
    assert response.status_code == 200, response.text
    assert not ended.is_set(), f"a plain chat took {took:.2f} s, behind a slow render"
    slow_chat.join(60)


def tool(i: int, description: str = "") -> dict:
    return {"type": "function", "function": {
        "name": f"lookup_{i}", "description": description,
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}


@pytest.mark.parametrize("tools, message", [
    ([tool(i) for i in range(3000)], "at most 128 tools"),
    ([tool(i, "Looks one entry up. " * 100) for i in range(100)], "characters"),
], ids=["3000-tools", "200KB-of-tools"])
def test_too_many_or_too_large_tools_are_refused_before_rendering(server, monkeypatch, tools,
                                                                   message):
    renders = []
    real = chat_route.render_chat_text
    monkeypatch.setattr(chat_route, "render_chat_text",
                        lambda *args, **kwargs: renders.append(1) or real(*args, **kwargs))
    response = post(server, {**PLAIN, "tools": tools, "tool_choice": "required"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and message in error["message"], error
    assert not renders, "the chat template ran before the size check"


def test_messages_too_large_to_fit_are_refused_before_rendering(server, monkeypatch):
    renders = []
    real = chat_route.render_chat_text
    monkeypatch.setattr(chat_route, "render_chat_text",
                        lambda *args, **kwargs: renders.append(1) or real(*args, **kwargs))
    parts = [{"type": "text", "text": "word " * 20_000}]
    response = post(server, {**PLAIN, "messages": [
        {"role": "system", "content": "a" * 10}, {"role": "user", "content": parts}]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    assert not renders, "the chat template ran before the size check"


def test_a_compile_past_its_time_goes_on_at_the_lowest_priority_on_a_thread_that_retires():
    def priority() -> tuple[int, str]:
        return (os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                threading.current_thread().name)

    def slow() -> tuple[int, str]:
        time.sleep(0.5)
        return priority()

    async def run() -> list[tuple[int, str]]:
        lane = Lane("test-compile", 1, demote_after=0.2)
        try:
            return [await lane.run(priority), await lane.run(slow), await lane.run(priority)]
        finally:
            lane.close()

    quick, demoted, after = asyncio.run(run())
    assert quick[0] < LOWEST_PRIORITY and demoted == (LOWEST_PRIORITY, quick[1])
    assert after[0] == quick[0] and after[1] != quick[1]  # a fresh thread, as it was
