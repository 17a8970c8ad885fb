"""Slow clients cannot hold connections (issue 38, row 6).

Thirty connections that sent a header line or a body byte every 3 s were all
still open after 75 s: the body timeout restarted at every byte, the headers
had no deadline at all (uvicorn starts the app only once they are complete),
and nothing capped the connections. Now (service/guards/connections.py,
service/guards/auth.py) the headers have a deadline from a request's first byte,
the body one from the end of the headers, and past --max-connections an idle
connection makes room or the new one gets 503. Real slow clients here: raw
sockets that dribble bytes at a live server.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from live_server import LiveServer, run_server, tiny_config

HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 1.0, 1.5, 6
DRIP = 0.3  # seconds between two pieces: well inside either deadline, as a gap
HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 200\r\n\r\n")


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    config = tiny_config(tiny_llama_path, header_timeout_seconds=HEADER_TIMEOUT,
                         body_timeout_seconds=BODY_TIMEOUT, max_connections=MAX_CONNECTIONS)
    with run_server(config) as live:
        yield live


def connect(live: LiveServer) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


class Dripper(threading.Thread):
    """Sends `pieces` one every DRIP seconds, then waits; records what the server
    answered and when it closed the connection (seconds after the start)."""

    def __init__(self, live: LiveServer, pieces: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.sock = connect(live)
        self.pieces = pieces
        self.reply = b""
        self.closed_after: float | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            for piece in self.pieces:  # whatever the server says meanwhile, as an attacker
                self.sock.sendall(piece)
                if not self._read(DRIP):
                    break
            else:
                while self._read(30):
                    pass
        except OSError:  # reset, or a send after the server closed: closed either way
            pass
        self.closed_after = time.monotonic() - started
        self.sock.close()

    def _read(self, wait: float) -> bool:
        """Whatever arrives within `wait` seconds; False once the server has closed."""
        self.sock.settimeout(wait)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return True
        self.reply += chunk
        return bool(chunk)


def header_lines(count: int) -> list[bytes]:
    return [b"POST /v1/completions HTTP/1.1\r\n"] + [
        f"X-Slow-{i}: {i}\r\n".encode() for i in range(count)]


def body_bytes(count: int) -> list[bytes]:
    return [HEAD.encode() + b'{'] + [b" "] * count


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_slow_headers_and_slow_bodies_are_cut_at_their_deadlines(server):
    # Each would go on for 30 s (100 pieces); none is idle for as long as a deadline.
    drippers = ([Dripper(server, header_lines(100)) for _ in range(2)]
                + [Dripper(server, body_bytes(100)) for _ in range(2)])
    for dripper in drippers:
        dripper.start()
    for dripper in drippers:
        dripper.join(20)
    for dripper in drippers[:2]:
        assert dripper.closed_after is not None, "a slow header sender is still connected"
        assert dripper.closed_after < HEADER_TIMEOUT + 2, dripper.closed_after
        assert status(dripper.reply) == 408, dripper.reply
        assert json.loads(dripper.reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
            "request_timeout")
    for dripper in drippers[2:]:
        assert dripper.closed_after is not None, "a slow body sender is still connected"
        assert dripper.closed_after < BODY_TIMEOUT + 2, dripper.closed_after
        assert status(dripper.reply) == 408, dripper.reply
        body = json.loads(dripper.reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert "not complete within" in body["error"]["message"]


def test_a_connection_that_sends_nothing_is_closed_quietly(server):
    silent = Dripper(server, [])
    silent.start()
    silent.join(20)
    assert silent.closed_after is not None and silent.closed_after < HEADER_TIMEOUT + 2
    assert silent.reply == b""


def read_response(sock) -> bytes:
    """One whole response (head and Content-Length body): the server may send
    them in separate segments, and the next read must start at the next response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_keep_alive_connection_gets_the_deadline_again(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT + 0.5)  # idle between requests: uvicorn's keep-alive (5 s)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and the rest never comes
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert status(reply) == 408 and time.monotonic() - started < HEADER_TIMEOUT + 2


def test_past_the_connection_cap_idle_connections_make_room(server):
    # Idle connections (headers not complete) fill every slot; a real request
    # still gets through, by closing the oldest of them.
    idle = [Dripper(server, header_lines(2)) for _ in range(MAX_CONNECTIONS)]
    for dripper in idle:
        dripper.start()
    time.sleep(0.2)
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200
    for dripper in idle:
        dripper.join(20)
    assert sum(d.reply == b"" and d.closed_after < HEADER_TIMEOUT for d in idle) >= 1


def test_past_the_connection_cap_with_every_request_in_progress_a_new_one_gets_503(server):
    # Every slot holds a request whose body is still arriving: none may be cut,
    # so the newcomer is refused (and the bodies then meet their own deadline).
    busy = [Dripper(server, body_bytes(3)) for _ in range(MAX_CONNECTIONS)]
    for dripper in busy:
        dripper.start()
    time.sleep(0.3)
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert status(reply) == 503, reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    for dripper in busy:
        dripper.join(20)
        assert status(dripper.reply) == 408, dripper.reply
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # room again
