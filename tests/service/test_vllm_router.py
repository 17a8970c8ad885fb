"""vLLM's own router (PyPI vllm-router, the Rust binary from its wheel) in front
of a real server, on loopback: with --policy kv_aware it connects to the
server's bound KV event endpoint and subscribes; it ingests the live stream,
and on its first batch (not number 0) asks the replay endpoint for what it
missed: a batch published before the router existed comes back by replay; and
a request sent through it reaches the server. What the router did is read from its own debug log.

Routing by prefix needs the render endpoints (issue 39, part 1); this module
checks the event plumbing only.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import pytest

from live_server import LiveServer, free_port, run_server, tiny_config
from router_process import RouterProcess

pytestmark = pytest.mark.usefixtures("single_thread")

def start_router(live: LiveServer, events: str, replay: str,
                 log: Path) -> tuple[RouterProcess, str]:
    port = free_port()
    router = RouterProcess([
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", live.url, "--policy", "kv_aware",
        "--kv-event-source", f"{live.url}={events}",
        "--kv-event-replay-source", f"{live.url}={replay}",
        "--kv-event-model", "tiny", "--kv-event-block-size", "16",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "debug",
    ], log)
    return router, f"http://127.0.0.1:{port}"


def complete(url: str, rng: random.Random) -> httpx.Response:
    """A completion of a new prompt: two full blocks the server has not cached, one batch."""
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})


def test_kv_aware_router_subscribes_replays_and_routes(tiny_llama_path, tmp_path):
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    config = tiny_config(tiny_llama_path, engine={"kv_events_endpoint": events,
                                                  "kv_events_replay_endpoint": replay})
    rng = random.Random(39)
    with run_server(config) as live:
        assert live.engine.kv_events.bound == events  # bound on loopback, as given
        assert complete(live.url, rng).status_code == 200  # batch 0: before any router
        router, router_url = start_router(live, events, replay, tmp_path / "router.log")
        try:
            source = re.escape(live.url)
            router.wait_for(rf"kv_index subscriber for {source} rank0 on {re.escape(events)}")
            # Live batches arrive once the subscription has reached the server.
            router.wait_for(rf"kv_index live sequence advanced source={source} rank=0 seq=\d+",
                            poke=lambda: complete(live.url, rng))
            # The first live batch it saw was not number 0: it asked the replay
            # endpoint for the batches before, and batch 0, sent to no subscriber
            # at all, came back from the replay buffer.
            router.wait_for(rf"kv_index replay sequence advanced source={source} rank=0 seq=0")
            router.wait_for(r"Router ready")
            response = complete(router_url, rng)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == 40
            assert "KV prefix decision" in router.text()  # kv_aware chose the worker
        finally:
            router.stop()
