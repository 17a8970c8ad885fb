"""Refusal pacing: a client whose requests keep being refused is answered more slowly.

Refusing a request is cheap, not free. 3,000 tools (620 KB) are received,
parsed by uvicorn and counted before their 400: ~2.5 ms of server CPU, and
about as much again in a sender on the same host. A client that sends the
next one the moment the last is refused is answered ~400 times a second, and
on a 2-core machine that takes a core from the engine's steps: every running
stream slows 3x although no single request is slow. The rate is the attack.

So each client holds a token bucket of refusals:

    bucket     --refusal-burst tokens, refilled at --refusal-rate a second
    a refusal  (a 4xx answer other than 408 and 429) takes one token
    none left  the answer waits until its token is due; the bucket may go
               --refusal-burst tokens into debt (a wait of burst / rate s at most)
    debt full  the refusal is answered 429 at once, with Retry-After, and so is
               every request of that client until its debt has room again:
               429 before the app runs, no body decoded, no work done (a
               client whose debt is full but that has not overflowed it is
               served as ever: its successes take nothing)

    tokens ▲  burst ─┐   ┌─────       each refusal: -1
           │         └┐ ┌┘            refill: +rate a second
           │   0 ─────└─┘── ...       below 0: the answer waits (-tokens / rate) s
           │  -burst ── 429 ──        no room for one more: 429 now, nothing waits
           └──────────────────────► time

Refusals go out at `rate` a second however many requests a client has in
flight: a waiting answer is a sleeping coroutine (it costs nothing), and
there are at most `burst` of them; past that nothing waits, so a client with
200 or 2,000 connections in flight gets no more 400s than one with 5 (a
capped wait instead would answer in_flight / cap a second). An honest client
that sends a few bad requests never waits (the burst covers them); answers
that succeed take no token, and 408 (the client was too slow already) and
429 (back-pressure, with its own Retry-After) are not paced.

A client is its peer address and its API key (`client_of`): tenants behind
one proxy have buckets of their own, and a client that presents no valid key
shares its address's keyless bucket, so guessing keys does not escape it.
The address is the one uvicorn reports: the connection's peer, or, only when
that peer is a configured --trusted-proxy, the X-Forwarded-For client
(service/guards/connections.py). No peer is trusted by default: an
X-Forwarded-For that anyone can send must not name a bucket.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import Message, Scope, Send

from service.errors import APIError
from service.protocol.replies import encoder

UNPACED = frozenset({408, 429})


def client_of(scope: Scope, key: str | None) -> tuple[str, str | None]:
    """Whose bucket a request's refusals take from: (peer address, its valid API key)."""
    client = scope.get("client")
    return (client[0] if client else "", key)


def too_many_refusals(retry_after: float) -> APIError:
    seconds = max(1, math.ceil(retry_after))
    return APIError(429, f"too many of this client's requests were refused; retry after "
                         f"{seconds} s", code="too_many_refusals",
                    headers={"Retry-After": str(seconds)})


class _Bucket:
    __slots__ = ("tokens", "updated", "overflowed")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens, self.updated = tokens, now
        self.overflowed = False  # a refusal found no room: refused whole until there is


class RefusalPacer:
    """Per-client token buckets of refusals. `rate` 0 turns pacing off."""

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        # Least recently refused first, so full buckets are dropped from the front.
        self.buckets: OrderedDict[object, _Bucket] = OrderedDict()

    @property
    def max_wait(self) -> float:
        """The longest a refusal waits: the whole debt, paid at `rate`."""
        return self.burst / self.rate

    def retry_after(self, client) -> float:
        """The seconds `client` is refused whole: 0 unless a refusal of its found its
        debt full, then until the debt has room for one more."""
        bucket = self.buckets.get(client)
        if self.rate <= 0 or bucket is None or not bucket.overflowed:
            return 0.0
        bucket = self._refill(client, self.clock())
        seconds = (1.0 - self.burst - bucket.tokens) / self.rate
        bucket.overflowed = seconds > 0
        return max(0.0, seconds)

    def wait_for(self, client) -> float | None:
        """Take a token for one refusal of `client`: the seconds its answer waits,
        or None when its debt is full (then it is answered 429, and takes nothing)."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        self._forget_full(now)
        bucket = self._refill(client, now)
        if bucket.tokens - 1.0 < -self.burst:
            bucket.overflowed = True
            return None
        bucket.tokens -= 1.0
        return max(0.0, -bucket.tokens / self.rate)

    def _refill(self, client, now: float) -> _Bucket:
        """`client`'s bucket (a full one if new) refilled to `now`, made the most recent."""
        bucket = self.buckets.pop(client, None) or _Bucket(float(self.burst), now)
        self.buckets[client] = bucket
        bucket.tokens = min(bucket.tokens + (now - bucket.updated) * self.rate, self.burst)
        bucket.updated = now
        return bucket

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: they hold nothing a new one would not.
        From the deepest debt a bucket is full again after 2 * burst / rate."""
        refill_seconds = 2 * self.max_wait
        while self.buckets:
            client, bucket = next(iter(self.buckets.items()))
            if now - bucket.updated < refill_seconds:
                return
            del self.buckets[client]

    def paced_send(self, client, send: Send, on_wait: Callable[[], None] = lambda: None,
                   on_full: Callable[[APIError], None] = lambda error: None) -> Send:
        """`send` that holds back a refusal's answer for its wait (`on_wait` hears of
        each), or, with the debt full, answers 429 in its place (`on_full` hears of it)."""
        if self.rate <= 0:
            return send
        replaced = False

        async def wrapped(message: Message) -> None:
            nonlocal replaced
            if replaced:  # the refusal's own body: its 429 has gone out instead
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status not in UNPACED:
                    wait = self.wait_for(client)
                    if wait is None:
                        replaced = True
                        error = too_many_refusals(self.retry_after(client))
                        on_full(error)
                        await _send_error(send, error)
                        return
                    if wait > 0:
                        on_wait()
                        await asyncio.sleep(wait)
            await send(message)

        return wrapped


async def _send_error(send: Send, error: APIError) -> None:
    body = encoder.encode(error.body())
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
