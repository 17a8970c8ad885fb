"""Refusal pacing leaves the server's own errors alone, over HTTP (issue 57).

A 5xx is the server's fault, not the client's: it takes no refusal token,
never waits, and is never turned into a 429 (service/guards/pacing.py).
The unit test in test_pacing.py holds the decision; here a real server
answers 503 (it is draining: `state.draining`, what SIGTERM sets) several
times past the refusal burst, and afterwards the same client's burst of
400s is still whole: none of them waited, and /metrics counted no wait.
And /metrics counts each error answer once, as the client got it: a refusal
that pacing answers 429 in its place counts as the 429 alone.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import httpx
import pytest

from live_server import run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

RATE, BURST = 2.0, 2  # a token back every 0.5 s
GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
BAD = {**GOOD, "foo": 1}  # 400: an unknown field


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, refusal_rate=RATE,
                                refusal_burst=BURST)) as live:
        yield live


def paced_total(server) -> float:
    return server.metrics()["pagedserve:refusals_paced_total"]


def test_503s_past_the_burst_take_no_token_and_do_not_wait(server):
    before = paced_total(server)
    server.state.draining = True  # every new request: 503 shutting_down
    try:
        with server.client() as http:
            answers = [http.post("/v1/completions", json=GOOD) for _ in range(3 * BURST)]
            health = http.get("/health")
    finally:
        server.state.draining = False
    assert [a.status_code for a in answers] == [503] * (3 * BURST), [a.text for a in answers]
    assert all(a.json()["error"]["code"] == "shutting_down" for a in answers)
    assert health.status_code == 503
    with server.client() as http:
        refused = [http.post("/v1/completions", json=BAD) for _ in range(BURST)]
    assert [r.status_code for r in refused] == [400] * BURST
    assert paced_total(server) == before  # nothing waited: the 503s took no token


ERROR_SAMPLE = re.compile(r'^pagedserve:http_errors_total\{code="([^"]*)",status="(\d+)"\} (\S+)$',
                          re.MULTILINE)


def error_counts(server) -> Counter:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return Counter({(int(status), code): float(value)
                    for code, status, value in ERROR_SAMPLE.findall(text)})


def test_each_error_answer_is_counted_once_as_it_was_sent(server):
    """A burst of refusals at once from a client of its own (another loopback
    address): the burst, two that wait, and two past the debt, which the app
    answered 400 and pacing answered 429 in their place."""
    async def refused() -> list[httpx.Response]:
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
        async with httpx.AsyncClient(base_url=server.url, timeout=30, transport=transport) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=BAD)
                                          for _ in range(2 * BURST + 2)))

    before = error_counts(server)
    answers = asyncio.run(refused())
    seen = Counter((a.status_code, a.json()["error"]["code"]) for a in answers)
    assert seen == {(400, "unknown_parameter"): 2 * BURST, (429, "too_many_refusals"): 2}, seen
    assert error_counts(server) - before == seen
