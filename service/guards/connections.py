"""Connections below the application: a deadline for request headers, a cap on connections.

uvicorn has neither. Its ASGI app starts only once a request's headers are
complete, so a client that sends a header line every few seconds holds its
connection (a socket, a file descriptor) for as long as it likes, seen by
nothing above; its `limit_concurrency` answers 503 only once headers are
complete, so it never counts such clients either. So the server runs
uvicorn's own protocol (httptools or h11, whichever it picks) with two
guards added:

    connection opens ─► past --max-connections: the oldest connection with no
                        request in progress (idle keep-alive, or headers not yet
                        complete) is closed to make room; none such, the new one
                        gets 503 and is closed. A request in progress is never cut.
    a request's first byte ─► its headers complete within --header-timeout-seconds
                        (a new connection's clock starts when it opens), else 408
                        and the connection closed
    headers complete ─► the app; the body must be complete within
                        --body-timeout-seconds (service/guards/limits.py), else 408

`uvicorn_options(config)` gives uvicorn.Config these settings, and who may
name the client: uvicorn believes X-Forwarded-For (and -Proto) only from a
--trusted-proxy peer, none by default (uvicorn's own default trusts
loopback, or what FORWARDED_ALLOW_IPS says). From a trusted peer, the client
is the right-most address in X-Forwarded-For that is not itself trusted: the
one the last trusted proxy appended. The CLI and the tests' live servers use
it alike.
"""

from __future__ import annotations

import asyncio

from service.config import ServiceConfig
from service.errors import APIError
from service.protocol.replies import encoder


def uvicorn_options(config: ServiceConfig) -> dict:
    """uvicorn.Config keywords for the server's connection guards and trusted proxies."""
    return {"http": protocol_class(config.header_timeout_seconds, config.max_connections),
            "proxy_headers": bool(config.trusted_proxies),
            "forwarded_allow_ips": list(config.trusted_proxies)}


def protocol_class(header_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol with the guards, set to these limits."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("GuardedHTTPProtocol", (GuardedConnection, AutoHTTPProtocol),
                {"header_timeout": header_timeout, "max_connections": max_connections})


# A refused connection is read (and what comes thrown away) this long before
# it closes: closing with the client's bytes unread would reset the connection,
# and the client would see the reset instead of the answer.
LINGER_SECONDS = 1.0


def _raw_response(status: int, reason: str, error: APIError) -> bytes:
    body = encoder.encode(error.body())
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedConnection:
    """A mixin over uvicorn's protocol class (which provides loop, transport,
    connections and cycle: the request in progress, None before the first)."""

    header_timeout: float = 10.0
    max_connections: int = 2048

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle = None  # the cycle before the request whose head is awaited
        self._head_started = False  # any byte of that head arrived
        self._refused = False  # answered here and closing: what comes is dropped
        self._await_head()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._head_timer is None and self._idle():
            self._await_head()  # a keep-alive connection's next request begins
        self._head_started = True
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._stop_head_timer()  # the head is complete: the app has the request

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """No request in progress: between requests, or before the first."""
        return self.cycle is None or self.cycle.response_complete

    def _await_head(self) -> None:
        self._head_cycle = self.cycle
        self._head_started = False
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is not self._head_cycle or self.transport.is_closing():
            return
        if not self._head_started:  # a connection that never sent a byte: closed quietly
            self.transport.close()
            return
        self._refuse(_raw_response(408, "Request Timeout", APIError(
            408, f"the request headers were not complete within {self.header_timeout:g} s",
            code="request_timeout")))

    def _refuse(self, response: bytes) -> None:
        """Answer `response` and close, after a linger that lets the client read it."""
        self._refused = True
        self._stop_head_timer()
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()

    def _make_room(self) -> None:
        """Past the cap: close the oldest connection without a request in
        progress; with none, refuse this one."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedConnection) and c._idle()
                and not c.transport.is_closing()]
        if idle:
            min(idle, key=lambda c: c._opened).transport.close()
            return
        self._refuse(_raw_response(503, "Service Unavailable", APIError(
            503, f"the server has {self.max_connections} connections open, the most it "
            f"takes; retry later", code="too_many_connections")))
