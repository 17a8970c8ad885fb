"""Refusal pacing (service/guards/pacing.py; issue 38, row 1's flood).

3,000 tools sent again the moment each was refused were answered ~400 times a
second; on 2 cores that took a core from the engine and every stream slowed
3x. Past a burst, a client's refusals now go out at --refusal-rate a second.
The bucket is checked exactly against a fake clock, then over HTTP on a live
server: refusals past the burst wait, answers that succeed and other clients
do not, and /metrics counts the waits.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from live_server import run_server, tiny_config
from service.guards.pacing import MAX_WAIT_SECONDS, RefusalPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_burst_goes_out_at_once_then_the_rate_holds():
    clock = Clock()
    pacer = RefusalPacer(rate=4.0, burst=3, clock=clock)
    assert [pacer.wait_for("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    # Refused together past the burst: each waits a quarter second more than the last.
    assert [pacer.wait_for("a") for _ in range(3)] == [0.25, 0.5, 0.75]
    clock.now += 0.5  # two tokens have come back
    assert pacer.wait_for("a") == 0.5


def test_a_quiet_client_gets_its_burst_back():
    clock = Clock()
    pacer = RefusalPacer(rate=4.0, burst=2, clock=clock)
    for _ in range(5):
        pacer.wait_for("a")
    clock.now += 0.75 + 2 / 4.0  # the debt of three, then a full bucket
    assert [pacer.wait_for("a") for _ in range(3)] == [0.0, 0.0, 0.25]


def test_clients_have_buckets_of_their_own():
    pacer = RefusalPacer(rate=1.0, burst=1, clock=Clock())
    assert pacer.wait_for("a") == 0.0
    assert pacer.wait_for("a") == 1.0
    assert pacer.wait_for("b") == 0.0


def test_the_wait_is_capped_and_the_debt_stops_growing():
    clock = Clock()
    pacer = RefusalPacer(rate=2.0, burst=1, clock=clock)
    waits = [pacer.wait_for("a") for _ in range(100)]
    assert max(waits) == MAX_WAIT_SECONDS and waits[-1] == MAX_WAIT_SECONDS
    clock.now += MAX_WAIT_SECONDS + 0.5  # the capped debt is paid, one token back
    assert pacer.wait_for("a") == 0.0


def test_refilled_buckets_are_forgotten():
    clock = Clock()
    pacer = RefusalPacer(rate=10.0, burst=2, clock=clock)
    for number in range(3000):  # a new peer every 10 ms for 30 s
        pacer.wait_for(f"10.0.{number // 256}.{number % 256}")
        clock.now += 0.01
    # Only peers refused within burst / rate + MAX_WAIT_SECONDS are still held.
    held = (2 / 10.0 + MAX_WAIT_SECONDS) / 0.01
    assert held - 1 <= len(pacer.buckets) <= held + 1


def test_rate_zero_turns_pacing_off():
    pacer = RefusalPacer(rate=0.0, burst=1, clock=Clock())
    assert [pacer.wait_for("a") for _ in range(10)] == [0.0] * 10
    assert not pacer.buckets


def test_only_refusals_are_paced_not_the_servers_own_errors():
    """A 5xx is the server's fault, 408 and 429 have their own meaning: none takes a
    token or waits; only the second 400 past a burst of one does."""
    pacer = RefusalPacer(rate=1000.0, burst=1, clock=Clock())  # a wait is 1 ms
    sent, waited = [], []

    async def answer(status: int) -> None:
        async def send(message):
            sent.append(message["status"])

        paced = pacer.paced_send({"client": ("10.1.2.3", 5000)}, send,
                                 on_wait=lambda: waited.append(status))
        await paced({"type": "http.response.start", "status": status})

    statuses = [500, 503, 504, 408, 429, 500, 400, 503, 400]
    for status in statuses:
        asyncio.run(answer(status))
    assert sent == statuses
    assert waited == [400]


RATE, BURST = 5.0, 3
GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
BAD = {**GOOD, "foo": 1}  # 400: an unknown field


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, refusal_rate=RATE, refusal_burst=BURST)) as live:
        yield live


async def timed_post(http: httpx.AsyncClient, body: dict, headers=None) -> tuple[int, float]:
    started = time.monotonic()
    response = await http.post("/v1/completions", json=body, headers=headers)
    return response.status_code, time.monotonic() - started


def paced_total(http_url: str) -> float:
    text = httpx.get(http_url + "/metrics").text
    (line,) = [row for row in text.splitlines() if row.startswith("pagedserve:refusals_paced_total")]
    return float(line.split()[-1])


def test_refusals_past_the_burst_wait_and_nothing_else_does(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            burst = [await timed_post(http, BAD) for _ in range(BURST)]
            # Four refusals past the burst, and beside them a request that succeeds.
            *flood, good = await asyncio.gather(*(timed_post(http, BAD) for _ in range(4)),
                                                timed_post(http, GOOD))
            # Another client behind the proxy uvicorn trusts (loopback) is not held.
            other = await timed_post(http, BAD, {"X-Forwarded-For": "10.9.8.7"})
            return burst, flood, good, other

    before = paced_total(server.url)
    burst, flood, good, other = asyncio.run(run())
    assert all(status == 400 and seconds < 0.15 for status, seconds in burst), burst
    waits = sorted(seconds for _, seconds in flood)
    assert all(status == 400 for status, _ in flood)
    # Refused together past the burst: out at 1/RATE-second steps.
    for number, seconds in enumerate(waits, start=1):
        assert number / RATE - 0.05 <= seconds <= number / RATE + 0.5, waits
    assert good[0] == 200 and good[1] < waits[-1] - 0.3, (good, waits)
    assert other[0] == 400 and other[1] < 0.15, other
    assert paced_total(server.url) - before == 4
