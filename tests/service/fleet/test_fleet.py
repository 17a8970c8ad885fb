"""The fleet on real servers (tiny model) and a real Redis: recording, warm-up
before ready, tenants, presence, and Redis failing at start and mid-run."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from engine.frontend.async_engine import Command
from live_server import LiveServer, run_server, tiny_config, wait_until
from redis_server import start_redis
from service.config import FleetConfig
from service.fleet.presence import fleet_report, replicas
from service.fleet.registry import connect

ONE_OFF = "A one-off system prompt that nobody repeats, about the weather in Lisbon. " * 3
SYSTEM = ("You are the help desk of a bicycle shop. Answer in two sentences, name the part, "
          "give its price in euros, and never recommend another shop. " * 3)


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.kill()


def fleet_config(model_path, redis_url: str, replica: str, **engine_and_service):
    fleet = FleetConfig(redis_url=redis_url, replica_id=replica, heartbeat_seconds=0.2,
                        refresh_seconds=0.5, warm_timeout_seconds=30)
    return tiny_config(model_path, fleet=fleet, **engine_and_service)


def chat(live: LiveServer, system: str | None, user: str, key: str | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{live.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def system_blocks(live: LiveServer, system: str = SYSTEM) -> int:
    """Full blocks of the system turn, as the replica's own template renders it."""
    tokenizer = live.state.tokenizer
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                         tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False)) // 16


def test_a_second_replica_warms_the_popular_system_prompt(tiny_llama_path, redis_server):
    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A")) as a:
        assert wait_until(lambda: a.metrics()["pagedserve:redis_up"] == 1)
        chat(a, SYSTEM, "How much is a chain?")
        chat(a, SYSTEM, "Do you sell bells?")
        chat(a, ONE_OFF, "Hello")
        assert wait_until(lambda: a.metrics()[
            "pagedserve:registry_sightings_recorded_total"] == 3)
        with run_server(fleet_config(tiny_llama_path, redis_server.url, "B")) as b:
            assert wait_until(lambda: httpx.get(f"{b.url}/health").status_code == 200, 30)
            blocks = system_blocks(b)
            assert blocks >= 3
            # Only the prompt seen twice was warmed, all of its full blocks.
            assert b.metrics()["pagedserve:prefix_warm_blocks"] == blocks
            assert b.metrics()["pagedserve:prefix_warming"] == 0
            assert b.state.fleet.warm.blocks == blocks and len(b.state.fleet.warm.prefixes) == 1
            answer = chat(b, SYSTEM, "Is the shop open on Sunday?")
            assert cached(answer) >= blocks * 16
            assert cached(chat(b, ONE_OFF, "Hi")) == 0
            fleet = asyncio.run(_replicas(redis_server.url))
            assert sorted(r.id for r in fleet) == ["A", "B"]
            (info,) = [r for r in fleet if r.id == "B"]
            assert info.status == "ok" and info.model == "tiny" and info.url == b.url
            assert info.warm_prefixes == [p.id for p in b.state.fleet.warm.prefixes]
            report = asyncio.run(fleet_report(redis_server.url, 10, 3600.0))
            assert "replicas (2)" in report and b.url in report
        # B left on shutdown (its drain and engine stop can take seconds on a busy CI box)
        assert wait_until(lambda: [r.id for r in asyncio.run(_replicas(redis_server.url))]
                          == ["A"], 30)


def test_the_fleet_hears_ok_before_health_does(tiny_llama_path, redis_server):
    """The end of the warm-up is published at once, not at the next heartbeat
    (a minute away here): a replica answering 200 is never listed as warming."""
    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A")) as a:
        for user in ("one", "two"):
            chat(a, SYSTEM, user)
        assert wait_until(lambda: a.metrics()[
            "pagedserve:registry_sightings_recorded_total"] == 2)
    slow = FleetConfig(redis_url=redis_server.url, replica_id="B", heartbeat_seconds=60)
    with run_server(tiny_config(tiny_llama_path, fleet=slow)) as b:
        assert wait_until(lambda: httpx.get(f"{b.url}/health").status_code == 200, 30)
        assert b.state.fleet.warm.blocks == system_blocks(b)  # it did warm something
        (info,) = asyncio.run(_replicas(redis_server.url))
        assert info.id == "B" and info.status == "ok"
        assert info.warm_prefixes == [p.id for p in b.state.fleet.warm.prefixes]


def test_a_draining_replica_is_listed_as_draining_at_once(tiny_llama_path, redis_server):
    slow = FleetConfig(redis_url=redis_server.url, replica_id="A", heartbeat_seconds=60)
    with run_server(tiny_config(tiny_llama_path, fleet=slow)) as a:
        assert wait_until(lambda: httpx.get(f"{a.url}/health").status_code == 200, 30)
        # What SIGTERM starts (tests/service/test_shutdown.py sends the real signal).
        asyncio.run_coroutine_threadsafe(a.state.drain(0.0), a.state.engine._loop).result(30)
        assert httpx.get(f"{a.url}/health").status_code == 503
        assert wait_until(lambda: [r.status for r in asyncio.run(_replicas(redis_server.url))]
                          == ["draining"], 5)


async def _replicas(url: str):
    client = connect(url)
    try:
        return await replicas(client)
    finally:
        await client.aclose()


def test_unreachable_redis_at_start_serves_at_once(tiny_llama_path, tmp_path):
    """Ready in the time a server without Redis takes (plus at most the connect timeout)."""
    dead = start_redis(tmp_path)
    dead.kill()  # a port where nothing listens
    plain = time_to_ready(tiny_config(tiny_llama_path))
    with run_server(fleet_config(tiny_llama_path, dead.url, "A")) as a:
        assert wait_until(lambda: httpx.get(f"{a.url}/health").status_code == 200, 10)
        assert a.metrics()["pagedserve:redis_up"] == 0
        assert cached(chat(a, SYSTEM, "hello")) == 0
        assert httpx.get(f"{a.url}/live").status_code == 200
    assert time_to_ready(fleet_config(tiny_llama_path, dead.url, "A")) < plain + 2.0


def time_to_ready(config) -> float:
    began = time.monotonic()
    with run_server(config) as live:
        assert wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 200, 30)
        return time.monotonic() - began


def test_idle_replica_warms_newly_popular_prompts(tiny_llama_path, redis_server):
    later = "You are the workshop's scheduler. Book repairs in slots of half an hour. " * 3
    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A")) as a, \
            run_server(fleet_config(tiny_llama_path, redis_server.url, "B")) as b:
        assert wait_until(lambda: httpx.get(f"{b.url}/health").status_code == 200, 30)
        assert b.metrics()["pagedserve:prefix_warm_blocks"] == 0  # nothing popular yet
        for user in ("one", "two"):
            chat(a, later, user)
        # B is idle: its refresh (every 0.5 s here) picks the prompt up.
        assert wait_until(lambda: b.metrics()["pagedserve:prefix_warm_blocks"]
                          == system_blocks(b, later), 15)
        assert cached(chat(b, later, "three")) >= system_blocks(b, later) * 16
        # An open request means not idle: the refresh waits for it. The engine
        # thread is held in a command meanwhile, so the request cannot finish
        # before the check (the tiny model would otherwise beat it).
        gate = threading.Event()
        b.state.engine._submit(Command(lambda: gate.wait(30)))
        try:
            with httpx.stream("POST", f"{b.url}/v1/chat/completions", timeout=60, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "count"}],
                    "max_tokens": 20, "stream": True}) as response:
                lines = response.iter_lines()  # one iterator: dropping it closes the stream
                next(lines)  # the role chunk: the request is open
                assert not b.state.fleet.idle()
                gate.set()
                chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
                assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        finally:
            gate.set()
        assert wait_until(b.state.fleet.idle, 10)


def test_redis_lost_mid_run_then_back(tiny_llama_path, redis_server, caplog):
    """Requests flow without a pause while Redis dies and returns; nothing fails, and
    only the registry's own warning is logged (no pipeline left unclosed)."""
    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A")) as a:
        assert wait_until(lambda: a.metrics()["pagedserve:redis_up"] == 1)
        chat(a, SYSTEM, "before")
        assert wait_until(lambda: a.metrics()[
            "pagedserve:registry_sightings_recorded_total"] == 1)
        load = Load(a)
        load.start()
        try:
            redis_server.kill()
            killed = time.monotonic()
            assert wait_until(lambda: a.metrics()["pagedserve:redis_up"] == 0, 10)
            down_after = time.monotonic() - killed
            served_while_down = load.served
            assert wait_until(lambda: load.served > served_while_down + 3, 30)
            redis_server.start()
            assert wait_until(lambda: a.metrics()["pagedserve:redis_up"] == 1, 15)
            recorded = a.metrics()["pagedserve:registry_sightings_recorded_total"]
            assert wait_until(lambda: a.metrics()[
                "pagedserve:registry_sightings_recorded_total"] > recorded, 15)
            wait_until(lambda: load.served > 5, 30)  # a slow machine serves fewer meanwhile
        finally:
            load.stop()
        assert load.failures == [] and load.served > 5
        assert down_after < 10
        assert a.metrics()["pagedserve:registry_sightings_dropped_total"] == 0
    assert [r.getMessage() for r in caplog.records if "Unclosed" in r.getMessage()] == []


class Load(threading.Thread):
    """Chats with the system prompt, one after another, until stopped."""

    def __init__(self, live: LiveServer) -> None:
        super().__init__(daemon=True)
        self.live = live
        self.served = 0
        self.failures: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                chat(self.live, SYSTEM, f"question {self.served}")
                self.served += 1
            except (AssertionError, httpx.HTTPError) as exc:
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)


def test_tenants_warm_in_their_own_namespace(tiny_llama_path, redis_server):
    keys = {"api_keys": ("key-1", "key-2")}
    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A", **keys)) as a:
        for user in ("one", "two"):
            chat(a, SYSTEM, user, key="key-1")
        assert wait_until(lambda: a.metrics()[
            "pagedserve:registry_sightings_recorded_total"] == 2)
        with run_server(fleet_config(tiny_llama_path, redis_server.url, "B", **keys)) as b:
            assert wait_until(lambda: httpx.get(f"{b.url}/health").status_code == 200, 30)
            blocks = system_blocks(b)
            assert b.metrics()["pagedserve:prefix_warm_blocks"] == blocks
            assert cached(chat(b, SYSTEM, "three", key="key-1")) >= blocks * 16
            assert cached(chat(b, SYSTEM, "three", key="key-2")) == 0  # another tenant


def test_fleet_command_prints_the_fleet(tiny_llama_path, redis_server, capsys):
    from pagedserve.cli import main

    with run_server(fleet_config(tiny_llama_path, redis_server.url, "A")) as a:
        for user in ("one", "two"):
            chat(a, SYSTEM, user)
        assert wait_until(lambda: a.metrics()[
            "pagedserve:registry_sightings_recorded_total"] == 2)
        assert main(["fleet", "--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert "replicas (1)" in out and a.url in out
    assert "prefixes in pagedserve:prefixes:" in out
    redis_server.kill()
    assert main(["fleet", "--redis-url", redis_server.url]) == 1
    assert "cannot read" in capsys.readouterr().out


def test_common_blocks_is_the_shared_head_cut_to_full_blocks():
    from service.fleet.replica import common_blocks

    prompt = list(range(100))
    assert common_blocks(list(range(40)), prompt, 16) == 32
    assert common_blocks(list(range(32)), prompt, 16) == 32
    assert common_blocks(list(range(15)), prompt, 16) == 0
    # a template that renders the system turn differently once more messages follow
    assert common_blocks(list(range(20)) + [-1] * 20, prompt, 4) == 20
    assert common_blocks([7] + list(range(1, 40)), prompt, 16) == 0
    assert common_blocks(list(range(200)), prompt, 16) == 96  # a prompt that is all system
