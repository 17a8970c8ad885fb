"""`priority` over HTTP: refused by name unless the server schedules by priority;
with --scheduling-policy priority, a high-priority request sent while
low-priority streams fill every seat gets its first token without waiting for
them to finish, and the same greedy tokens it gets alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from live_server import run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")


def test_priority_needs_the_priority_policy(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as live:
        body = {"prompt": "hello", "max_tokens": 1, "priority": 3}
        refused = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert httpx.post(f"{live.url}/v1/completions", json={**body, "priority": 0},
                          timeout=30).status_code == 200


def test_a_high_priority_request_overtakes_a_full_engine(tiny_llama_path):
    # A long context, so the batch is still decoding whatever this CPU's speed
    # (200 tokens of the tiny model took under half a second on a Zen 5 core).
    config = tiny_config(tiny_llama_path, engine={"scheduling_policy": "priority",
                                                  "max_num_seqs": 2, "max_model_len": 1024})
    urgent = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with run_server(config) as live:
        url = f"{live.url}/v1/completions"
        alone = httpx.post(url, json={**urgent, "priority": -1}, timeout=60).json()

        async def running(client) -> float:
            text = (await client.get(f"{live.url}/metrics")).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("pagedserve:num_requests_running "))

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                batch = [asyncio.create_task(client.post(url, json={
                    "prompt": [100 + i] * 8, "max_tokens": 1000, "ignore_eos": True,
                    "priority": 10})) for i in range(2)]
                for _ in range(500):  # until both seats are the batch's (10 s at most)
                    if await running(client) >= 2:
                        break
                    await asyncio.sleep(0.02)
                first = await client.post(url, json={**urgent, "priority": -1})
                done_before = sum(task.done() for task in batch)
                metrics = (await client.get(f"{live.url}/metrics")).text
                for task in batch:  # not waited for: closing the streams aborts them
                    task.cancel()
                await asyncio.gather(*batch, return_exceptions=True)
                return first.json(), done_before, metrics

        first, done_before, metrics = asyncio.run(scenario())
        by_priority = [line for line in metrics.splitlines()
                       if line.startswith("pagedserve:num_requests_by_priority{")]
        # the batch's two streams, running (or one of them preempted and waiting)
        assert sum(float(line.rsplit(" ", 1)[1]) for line in by_priority
                   if 'priority="10"' in line) == 2
        assert done_before == 0  # it did not wait for a seat to free up
        assert first["choices"][0]["text"] == alone["choices"][0]["text"]
        assert live.engine.scheduler.num_preemptions >= 1
