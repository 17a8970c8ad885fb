"""Refusal pacing (service/guards/pacing.py; issue 38, row 1's flood; issue 57, finding 4).

3,000 tools sent again the moment each was refused were answered ~400 times a
second; on 2 cores that took a core from the engine and every stream slowed
3x. Past a burst, a client's refusals now go out at --refusal-rate a second.
Issue 57 found the rate did not hold: a debt capped at 10 s of waiting let
200 looping connections get 20.5 refusals a second where 1 was configured
(in_flight / cap), and X-Forwarded-For from loopback, trusted by default,
named a new bucket per request (no pacing at all) or a victim's (its
refusals waited). Now at most a burst may wait; past that a client gets 429
before any work, and X-Forwarded-For is believed only from --trusted-proxy.

The bucket is checked exactly against a fake clock, then over HTTP on a live
server. Each HTTP test connects from its own loopback address (127.0.0.N),
so that each is a client of its own; 127.0.0.2 is the trusted proxy.
"""

from __future__ import annotations

import asyncio
import heapq
import time

import httpx
import pytest

from live_server import run_server, tiny_config
from service.config import ServiceConfig
from service.guards.connections import uvicorn_options
from service.guards.pacing import RefusalPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_burst_goes_out_at_once_a_burst_more_waits_then_nothing_waits():
    clock = Clock()
    pacer = RefusalPacer(rate=4.0, burst=3, clock=clock)
    assert [pacer.wait_for("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    # Refused together past the burst: each waits a quarter second more than the last ...
    assert [pacer.wait_for("a") for _ in range(3)] == [0.25, 0.5, 0.75]
    # ... and with a burst in debt, none more: 429 now, until a token is back.
    assert pacer.wait_for("a") is None and pacer.retry_after("a") == 0.25
    clock.now += 0.5  # two tokens have come back
    assert pacer.retry_after("a") == 0.0
    assert pacer.wait_for("a") == 0.5


def test_a_quiet_client_gets_its_burst_back():
    clock = Clock()
    pacer = RefusalPacer(rate=4.0, burst=2, clock=clock)
    for _ in range(5):
        pacer.wait_for("a")
    clock.now += 0.5 + 2 / 4.0  # the debt of two, then a full bucket
    assert [pacer.wait_for("a") for _ in range(3)] == [0.0, 0.0, 0.25]


def test_the_rate_holds_however_many_are_in_flight():
    """A client that sends the next request the moment one is answered, with
    `in_flight` at once: every refusal that is not a 429 took a token, so over
    T seconds at most 2 * burst + rate * T go out, for 10 in flight or 2,000."""
    rate, burst, seconds = 5.0, 4, 4.0
    for in_flight in (10, 100, 1000):
        clock = Clock()
        pacer = RefusalPacer(rate=rate, burst=burst, clock=clock)
        due = [(clock.now, i) for i in range(in_flight)]  # each connection's next request
        refused, end = 0, clock.now + seconds
        while due[0][0] < end:
            clock.now, i = heapq.heappop(due)
            wait = 0.0  # refused whole (429) at once, before any work
            if pacer.retry_after("a") == 0:
                wait = pacer.wait_for("a")  # None: 429 at once, in the refusal's place
                refused += wait is not None  # a 400, now or after its wait
            heapq.heappush(due, (clock.now + (wait or 0.0) + 0.05, i))  # 50 ms a request
        assert rate * seconds <= refused <= 2 * burst + rate * seconds, (in_flight, refused)


def test_clients_are_an_address_and_a_key():
    pacer = RefusalPacer(rate=1.0, burst=1, clock=Clock())
    assert pacer.wait_for(("10.0.0.1", None)) == 0.0
    assert pacer.wait_for(("10.0.0.1", None)) == 1.0
    assert pacer.wait_for(("10.0.0.1", "keyA")) == 0.0  # a tenant of its own
    assert pacer.wait_for(("10.0.0.2", None)) == 0.0


def test_refilled_buckets_are_forgotten():
    clock = Clock()
    pacer = RefusalPacer(rate=10.0, burst=2, clock=clock)
    for number in range(3000):  # a new peer every 10 ms for 30 s
        pacer.wait_for(f"10.0.{number // 256}.{number % 256}")
        clock.now += 0.01
    # Only peers refused within 2 * burst / rate (the deepest debt refilled) are held.
    held = (2 * 2 / 10.0) / 0.01
    assert held - 1 <= len(pacer.buckets) <= held + 1


def test_rate_zero_turns_pacing_off():
    pacer = RefusalPacer(rate=0.0, burst=1, clock=Clock())
    assert [pacer.wait_for("a") for _ in range(10)] == [0.0] * 10
    assert pacer.retry_after("a") == 0.0 and not pacer.buckets


async def answer(pacer: RefusalPacer, status: int, waited: list, full: list) -> list[dict]:
    """What reaches the client when the app answers `status`, through paced_send."""
    sent = []

    async def send(message):
        sent.append(message)

    paced = pacer.paced_send("10.1.2.3", send, on_wait=lambda: waited.append(status),
                             on_full=full.append)
    await paced({"type": "http.response.start", "status": status, "headers": []})
    await paced({"type": "http.response.body", "body": b"the app's own", "more_body": False})
    return sent


def test_only_refusals_are_paced_not_the_servers_own_errors():
    """A 5xx is the server's fault, 408 and 429 have their own meaning: none takes a
    token or waits; only the second 400 past a burst of one does."""
    pacer = RefusalPacer(rate=1000.0, burst=1, clock=Clock())  # a wait is 1 ms
    waited, full = [], []
    statuses = [500, 503, 504, 408, 429, 500, 400, 503, 400]
    for status in statuses:
        sent = asyncio.run(answer(pacer, status, waited, full))
        assert sent[0]["status"] == status and sent[1]["body"] == b"the app's own"
    assert waited == [400] and not full


def test_a_refusal_with_the_debt_full_is_answered_429_in_its_place():
    pacer = RefusalPacer(rate=1000.0, burst=1, clock=Clock())
    waited, full = [], []
    for _ in range(2):
        asyncio.run(answer(pacer, 400, waited, full))
    start, body = asyncio.run(answer(pacer, 400, waited, full))
    assert start["status"] == 429 and (b"retry-after", b"1") in start["headers"]
    assert b"too_many_refusals" in body["body"] and b"the app's own" not in body["body"]
    assert [error.status for error in full] == [429]


def test_forwarded_for_is_believed_from_no_peer_unless_configured():
    """uvicorn alone believes X-Forwarded-For from loopback (or FORWARDED_ALLOW_IPS);
    the server passes its own list, empty by default, checked at start-up."""
    options = uvicorn_options(ServiceConfig())
    assert options["proxy_headers"] is False and options["forwarded_allow_ips"] == []
    options = uvicorn_options(ServiceConfig(trusted_proxies=("10.0.0.1", "172.28.57.128/25")))
    assert options["proxy_headers"] is True
    assert options["forwarded_allow_ips"] == ["10.0.0.1/32", "172.28.57.128/25"]
    with pytest.raises(ValueError, match="'router' is not an IP address or network"):
        ServiceConfig(trusted_proxies=("router",))  # uvicorn would never match it


# -- over HTTP --------------------------------------------------------------------------
RATE, BURST = 5.0, 3
TRUSTED = "127.0.0.2"
GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
BAD = {**GOOD, "foo": 1}  # 400: an unknown field
KEY_A, KEY_B = {"Authorization": "Bearer keyA"}, {"Authorization": "Bearer keyB"}


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    config = tiny_config(tiny_llama_path, refusal_rate=RATE, refusal_burst=BURST,
                         api_keys=("keyA", "keyB"), trusted_proxies=(TRUSTED,))
    with run_server(config) as live:
        yield live


def client_at(server, address: str, **kwargs) -> httpx.AsyncClient:
    """A client whose connections come from `address` (any 127.x is loopback)."""
    transport = httpx.AsyncHTTPTransport(local_address=address, **kwargs)
    return httpx.AsyncClient(base_url=server.url, timeout=30, transport=transport)


async def timed_post(http: httpx.AsyncClient, body: dict, headers) -> tuple[int, float]:
    started = time.monotonic()
    response = await http.post("/v1/completions", json=body, headers=headers)
    return response.status_code, time.monotonic() - started


def paced_total(server) -> float:
    return server.metrics()["pagedserve:refusals_paced_total"]


def test_refusals_past_the_burst_wait_and_nothing_else_does(server):
    async def run():
        async with client_at(server, "127.0.0.3") as http:
            burst = [await timed_post(http, BAD, KEY_A) for _ in range(BURST)]
            # Refusals past the burst, and beside them a request that succeeds.
            *flood, good = await asyncio.gather(*(timed_post(http, BAD, KEY_A)
                                                  for _ in range(BURST)),
                                                timed_post(http, GOOD, KEY_A))
            other = await timed_post(http, BAD, KEY_B)  # another tenant: not held
            return burst, flood, good, other

    before = paced_total(server)
    burst, flood, good, other = asyncio.run(run())
    assert all(status == 400 and seconds < 0.15 for status, seconds in burst), burst
    waits = sorted(seconds for _, seconds in flood)
    assert all(status == 400 for status, _ in flood), flood
    for number, seconds in enumerate(waits, start=1):  # out at 1/RATE-second steps
        assert number / RATE - 0.05 <= seconds <= number / RATE + 0.5, waits
    assert good[0] == 200 and good[1] < waits[-1] - 0.2, (good, waits)
    assert other[0] == 400 and other[1] < 0.15, other
    assert paced_total(server) - before == BURST


def test_the_rate_holds_with_many_requests_in_flight(server):
    """40 keep-alive connections of one tenant, each sending a bad request the
    moment the last is answered, for 3 s: the 400s of the last 2 s go out at
    ~RATE a second (a capped wait would answer 40 / (BURST / RATE) ≈ 67 a second),
    the rest are 429 at once. Meanwhile another tenant on the same address is
    served."""
    window, connections = (1.0, 3.0), 40

    async def loop(http, started, answered):
        while time.monotonic() - started < window[1]:
            status, _ = await timed_post(http, BAD, KEY_A)
            answered.append((time.monotonic() - started, status))

    async def run():
        limits = httpx.Limits(max_connections=connections)
        async with client_at(server, "127.0.0.4", limits=limits) as http:
            started, answered = time.monotonic(), []
            flood = [asyncio.create_task(loop(http, started, answered))
                     for _ in range(connections)]
            await asyncio.sleep(window[0])
            other = await timed_post(http, GOOD, KEY_B)
            await asyncio.gather(*flood)
            return answered, other

    answered, other = asyncio.run(run())
    in_window = [status for at, status in answered if window[0] <= at <= window[1]]
    refused = in_window.count(400)
    span = window[1] - window[0]
    # Each 400 took a token: at most the rate, plus what a burst and its debt hold.
    assert RATE * span / 2 <= refused <= RATE * span + 2 * BURST, (refused, len(in_window))
    assert in_window.count(429) > refused  # the rest: refused at once, nothing waited
    assert other[0] == 200, other


def test_forwarded_for_from_an_untrusted_peer_is_ignored(server):
    """From 127.0.0.1 (loopback, which uvicorn trusts by default; not a trusted
    proxy here) a new X-Forwarded-For per request is still one client: past the
    burst, refusals wait. Forged addresses take nothing from the real client of
    that address behind the trusted proxy."""
    async def run():
        async with client_at(server, "127.0.0.1") as http:
            forged = await asyncio.gather(*(
                timed_post(http, BAD, {**KEY_A, "X-Forwarded-For": f"10.0.0.{n}"})
                for n in range(2 * BURST)))
        async with client_at(server, TRUSTED) as proxy:
            victim = [await timed_post(proxy, BAD, {**KEY_A, "X-Forwarded-For": "10.0.0.0"})
                      for _ in range(BURST)]
        return forged, victim

    forged, victim = asyncio.run(run())
    assert [status for status, _ in forged] == [400] * (2 * BURST)
    waits = sorted(seconds for _, seconds in forged)
    assert waits[-1] >= BURST / RATE - 0.05, waits  # paced: one client
    assert all(status == 400 and seconds < 0.15 for status, seconds in victim), victim


def test_forwarded_for_from_a_trusted_proxy_names_the_client(server):
    """From the trusted proxy, each X-Forwarded-For client has its own bucket; the
    client is the right-most address the proxy appended, not one the client sent."""
    async def run():
        async with client_at(server, TRUSTED) as proxy:
            # 10.1.1.1 past its burst, once as the client sent it and once with a
            # forged address in front, as a proxy appends the one it saw.
            first = await asyncio.gather(*(
                timed_post(proxy, BAD, {**KEY_A, "X-Forwarded-For": forwarded})
                for forwarded in ["10.1.1.1"] * BURST + ["10.9.9.9, 10.1.1.1"]))
            second = await timed_post(proxy, BAD, {**KEY_A, "X-Forwarded-For": "10.1.1.2"})
        return first, second

    first, second = asyncio.run(run())
    waits = sorted(seconds for _, seconds in first)
    assert waits[-1] >= 1 / RATE - 0.05, waits  # one client: 10.1.1.1
    assert second[0] == 400 and second[1] < 0.15, second  # another client


def test_a_client_past_its_debt_is_refused_whole_but_reaches_the_probes(server):
    """Once a client's refusals overflow its debt, its next request is 429 before
    any work, even one that would succeed; not /health, which a router's health
    checks from the same client must still reach. Requests without a key share
    their address's keyless bucket, which a keyless flood overflows alike."""
    async def overflow(http, headers) -> list[asyncio.Task]:
        flood = [asyncio.create_task(timed_post(http, BAD, headers))
                 for _ in range(2 * BURST + 4)]
        for answered in asyncio.as_completed(flood):
            if (await answered)[0] == 429:  # overflowed: for 1 / RATE s at least
                break
        return flood

    async def run():
        async with client_at(server, "127.0.0.6") as http:
            flood = await overflow(http, KEY_A)
            after, health = await asyncio.gather(timed_post(http, GOOD, KEY_A),
                                                 http.get("/health", headers=KEY_A))
            statuses = sorted([status for status, _ in await asyncio.gather(*flood)])
            keyless = await overflow(http, {})
            keyless_after = await timed_post(http, GOOD, {})
            await asyncio.gather(*keyless)
            return statuses, after, health.status_code, keyless_after

    statuses, after, health, keyless_after = asyncio.run(run())
    assert statuses.count(400) >= 2 * BURST and 429 in statuses, statuses
    assert after[0] == 429 and after[1] < 0.15, after  # a request that would succeed
    assert health == 200
    assert keyless_after[0] == 429, keyless_after
