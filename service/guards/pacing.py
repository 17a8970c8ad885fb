"""Refusal pacing: a client whose requests keep being refused is answered more slowly.

Refusing a request is cheap, not free. 3,000 tools (620 KB) are received,
parsed by uvicorn and counted before their 400: ~2.5 ms of server CPU, and
about as much again in a sender on the same host. A client that sends the
next one the moment the last is refused is answered ~400 times a second, and
on a 2-core machine that takes a core from the engine's steps: every running
stream slows 3x although no single request is slow. The rate is the attack.

So each client (its peer address) holds a token bucket of refusals:

    bucket     --refusal-burst tokens, refilled at --refusal-rate a second
    a refusal  (a 4xx answer other than 408 and 429) takes one token
    none left  the answer waits until its token is due, so the client's
               refusals go out at the rate however many it has in flight

    tokens ▲  burst ─┐   ┌─────       each refusal: -1
           │         └┐ ┌┘            refill: +rate a second
           │   0 ─────└─┘── ...       below 0: the answer waits (-tokens / rate) s
           │                          at most MAX_WAIT_SECONDS
           └──────────────────────► time

A waiting answer is a sleeping coroutine: it costs nothing. An honest client
that sends a few bad requests never waits (the burst covers them); a flood
is held to `rate` refusals a second, a bounded share of the CPU. Answers that
succeed neither take nor need a token; 408 (the client was too slow already)
and 429 (back-pressure, with its own Retry-After) are not paced.

The peer is the address uvicorn reports: behind a proxy it trusts (its
FORWARDED_ALLOW_IPS, loopback by default) that is the X-Forwarded-For
client, else the proxy itself, and then its clients share one bucket. Only
their refusals wait, never their answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import Message, Scope, Send

# A refusal never waits longer than this; past it the connection cap
# (--max-connections) is what bounds a client with very many requests in flight.
MAX_WAIT_SECONDS = 10.0
UNPACED = frozenset({408, 429})


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, now: float) -> None:
        self.tokens, self.updated = tokens, now


class RefusalPacer:
    """Per-peer token buckets of refusals. `rate` 0 turns pacing off."""

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        # Least recently refused first, so full buckets are dropped from the front.
        self.buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def wait_for(self, peer: str) -> float:
        """Take a token for one refusal to `peer`: the seconds its answer waits."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        self._forget_full(now)
        bucket = self.buckets.pop(peer, None) or _Bucket(float(self.burst), now)
        self.buckets[peer] = bucket  # now the most recent
        refilled = bucket.tokens + (now - bucket.updated) * self.rate
        # A debt deeper than the longest wait is not kept: it would only grow.
        bucket.tokens = max(min(refilled, self.burst) - 1.0, -MAX_WAIT_SECONDS * self.rate)
        bucket.updated = now
        return max(0.0, -bucket.tokens / self.rate)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: they hold nothing a new one would not.
        From the deepest debt a bucket is full again after burst / rate + MAX_WAIT_SECONDS."""
        refill_seconds = self.burst / self.rate + MAX_WAIT_SECONDS
        while self.buckets:
            peer, bucket = next(iter(self.buckets.items()))
            if now - bucket.updated < refill_seconds:
                return
            del self.buckets[peer]

    def paced_send(self, scope: Scope, send: Send,
                   on_wait: Callable[[], None] = lambda: None) -> Send:
        """`send` that holds back a refusal's answer for its wait (`on_wait` hears of each)."""
        if self.rate <= 0:
            return send
        client = scope.get("client")
        peer = client[0] if client else ""

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status not in UNPACED:
                    wait = self.wait_for(peer)
                    if wait > 0:
                        on_wait()
                        await asyncio.sleep(wait)
            await send(message)

        return wrapped
