"""The Python client against real servers: answers typed, streams equal to
whole answers, the server's errors as typed exceptions, 429 retried after
Retry-After, and a closed stream aborted on the server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from clients.python import (
    AsyncClient, AuthenticationError, BadRequestError, Client, ConnectionError, NotFoundError,
    RateLimitError,
)
from engine.frontend.async_engine import Command
from engine.config import EngineConfig
from live_server import free_port, run_server, tiny_config, wait_until
from service.config import ServiceConfig

HELLO = [{"role": "user", "content": "Write about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, api_keys=("key",))) as live:
        yield live


@pytest.fixture
def client(server):
    with Client(server.url, api_key="key") as client:
        yield client


def test_chat_and_its_stream_say_the_same(client):
    whole = client.chat(HELLO, max_tokens=16, temperature=0)
    stream = client.chat_stream(HELLO, max_tokens=16, temperature=0)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert whole.usage.completion_tokens == stream.usage.completion_tokens == 16
    assert stream.usage.prompt_tokens == whole.usage.prompt_tokens
    assert stream.usage.cached_tokens == 32  # the second time: two blocks of 16 cached
    assert stream.finish_reason == whole.choices[0].finish_reason == "length"
    assert stream.done and stream.id.startswith("chatcmpl-")


def test_tool_calls_are_typed(client):
    unit = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"], "additionalProperties": False}
    answer = client.chat(HELLO, max_tokens=30, tools=[
        {"type": "function", "function": {"name": "set_unit", "parameters": unit}}],
        tool_choice={"type": "function", "function": {"name": "set_unit"}})
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "set_unit" and call.id.startswith("call_")
    assert call.function.parsed_arguments()["unit"] in ("celsius", "fahrenheit")
    assert answer.choices[0].message.content is None and answer.text == ""


def test_completions_models_and_health(client, server):
    whole = client.complete("The sea is", max_tokens=8, temperature=0)
    assert client.complete_stream("The sea is", max_tokens=8, temperature=0).text() == whole.text
    assert [m.id for m in client.models()] == ["tiny"]
    assert client.health().ok and client.health().status == "ok"


def test_errors_are_typed_with_the_servers_message(client, server):
    with pytest.raises(BadRequestError) as caught:
        client.chat(HELLO, max_tokens=100_000)
    assert "maximum context length" in caught.value.message
    assert caught.value.param == "max_tokens" and caught.value.status == 400
    with pytest.raises(NotFoundError) as caught:
        client.chat(HELLO, model="no-such-model")
    assert caught.value.code == "model_not_found"
    with pytest.raises(AuthenticationError):
        Client(server.url, api_key="wrong").chat(HELLO)
    with pytest.raises(BadRequestError):  # refused before any event: raised at the call
        client.chat_stream(HELLO, temperature=-1)


def test_unreachable_server_is_a_connection_error():
    with pytest.raises(ConnectionError):
        Client(f"http://127.0.0.1:{free_port()}", max_retries=1).chat(HELLO)


def test_429_is_retried_after_retry_after(tiny_llama_path):
    """One seat and one waiting place; the engine thread held so nothing moves."""
    config = tiny_config(tiny_llama_path, engine={"max_num_seqs": 1}, max_waiting_requests=1)
    with run_server(config) as live:
        gate = threading.Event()
        live.state.engine._submit(Command(lambda: gate.wait(30)))
        fillers = [threading.Thread(target=httpx.post, args=(
            f"{live.url}/v1/chat/completions",), kwargs={"json": {
                "messages": HELLO, "max_tokens": 2}, "timeout": 60}) for _ in range(2)]
        for thread in fillers:
            thread.start()
        assert wait_until(lambda: live.state.engine.num_waiting >= 1)
        with Client(live.url, max_retries=0) as impatient:
            with pytest.raises(RateLimitError) as caught:
                impatient.chat(HELLO, max_tokens=2)
        assert caught.value.code == "queue_full"
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        with Client(live.url, max_retries=5) as patient:
            answer = patient.chat(HELLO, max_tokens=2)
            assert patient.retries >= 1
        assert answer.usage.completion_tokens == 2
        assert time.monotonic() - started >= 1.0  # the server's Retry-After: 1 s
        for thread in fillers:
            thread.join(60)


def test_closing_a_stream_aborts_it_on_the_server(smollm2_path):
    engine = EngineConfig(model="smollm2-135m-instruct", max_model_len=2048,
                          kv_cache_memory_bytes=128 << 20)
    with run_server(ServiceConfig(engine=engine)) as live, Client(live.url) as client:
        stream = client.chat_stream(HELLO, max_tokens=1000, ignore_eos=True)
        pieces = iter(stream)
        first = [next(pieces) for _ in range(3)]
        assert all(first)
        assert live.state.engine.stats.counters["num_requests_running"] == 1
        stream.close()  # what leaving the loop early does too
        assert wait_until(lambda: live.state.engine.stats.counters["num_requests_running"]
                          == 0 and live.state.engine.num_open == 0, 10)
        assert live.state.engine.stats.counters["generation_tokens"] < 1000


def test_async_client(server):
    async def run():
        async with AsyncClient(server.url, api_key="key") as client:
            whole = await client.chat(HELLO, max_tokens=8, temperature=0)
            stream = await client.chat_stream(HELLO, max_tokens=8, temperature=0)
            assert await stream.text() == whole.text
            assert stream.usage.completion_tokens == whole.usage.completion_tokens
            assert (await client.health()).ok and [m.id for m in await client.models()]
            with pytest.raises(BadRequestError):
                await client.chat(HELLO, max_tokens=100_000)
            streams = await asyncio.gather(*(client.chat_stream(HELLO, max_tokens=4)
                                             for _ in range(4)))
            texts = await asyncio.gather(*(s.text() for s in streams))
            assert all(texts)

    asyncio.run(run())
