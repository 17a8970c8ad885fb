"""Schemas too costly to compile are refused at once, and no tenant waits behind
another's compile (issue 57, attack finding 1).

Before: a schema of 2,500 plain properties compiled for ~2 minutes, an enum of
50,000 values for 57 s, nesting 400 deep for 29 s; one compile thread served
every tenant, so another key's one-field schema waited 118 s; and compiles of
clients that had hung up went on being queued. Now such schemas are priced
(engine/sampling/compile_price.py) and refused with a 400 naming the field,
before the compile lane, and the lane takes compiles in turn by tenant, one
running per tenant (service/serving/fair_queue.py).

Over HTTP to a real server with API keys (each key a tenant). A compile is held
in flight by a gate the test opens (xgrammar, like the gate's wait, releases
the GIL), so what is asserted is the order of events, not the machine's speed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from live_server import LiveServer, run_server, tiny_config, wait_until

KEYS = ("key-a", "key-b", "key-c")
CHAT, RESPONSES, COMPLETIONS = "/v1/chat/completions", "/v1/responses", "/v1/completions"
PARAM = {CHAT: "response_format.json_schema.schema", RESPONSES: "text.format.schema",
         COMPLETIONS: "response_format.json_schema.schema"}


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, api_keys=KEYS)) as live:
        yield live


class HeldCompiles:
    """The engine's compile, held for schemas titled "held...": the first compile of
    each waits until `release` is set, then compiles for real. Every compile's
    title is recorded, in order."""

    def __init__(self, live: LiveServer) -> None:
        self.compiler = live.engine.structured_outputs
        self.real = self.compiler.compile
        self.release = threading.Event()
        self.calls: list[str] = []  # titles, each compile (the engine's cached one too)
        self.held: list[str] = []  # titles whose compile reached the gate
        self.compiler.compile = self.compile

    def compile(self, params):
        title = json.loads(params.json).get("title", "") if params.kind == "json" else ""
        self.calls.append(title)
        if title.startswith("held") and title not in self.held:
            self.held.append(title)
            self.release.wait(60)
        return self.real(params)

    def restore(self) -> None:
        self.release.set()
        del self.compiler.compile  # the instance attribute: the method shows again


@pytest.fixture
def held(server):
    compiles = HeldCompiles(server)
    yield compiles
    compiles.restore()


def body(path: str, schema: dict) -> dict:
    """A request on `path` whose output must follow `schema`."""
    if path == RESPONSES:
        return {"input": "Hello", "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}
    form = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}
    if path == COMPLETIONS:
        return {"prompt": "Hello", "max_tokens": 4, **form}
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **form}


def post(live: LiveServer, path: str, schema: dict, key: str = KEYS[0],
         timeout: float | httpx.Timeout = 60) -> httpx.Response:
    return httpx.post(live.url + path, json=body(path, schema), timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def waiting(live: LiveServer, key: str) -> int:
    """The key's compiles queued on the compile lane, not started."""
    return live.state.prep.heavy.jobs.waiting("key " + key)


def running(live: LiveServer, key: str) -> int:
    return live.state.prep.heavy.jobs.running("key " + key)


def hang_up_when(live: LiveServer, path: str, schema: dict, ready, key: str = KEYS[0]) -> None:
    """Send a request on a socket of its own and close it once `ready()` holds."""
    payload = json.dumps(body(path, schema)).encode()
    address = urlsplit(live.url)
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
                     f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert wait_until(ready, 30), "the request never got that far"


def wide(count: int, title: str = "") -> dict:
    """An object of `count` plain, optional string properties."""
    return {"title": title, "type": "object",
            "properties": {f"field_{i}": {"type": "string"} for i in range(count)}}


def deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SMALL = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
# The attack's shapes; each took 29 s to minutes to compile.
COSTLY = {
    "3000-properties": (wide(3000), "3000 object properties in all", "limit of 1024"),
    "60000-enum": ({"type": "object", "properties": {"pick": {"enum": [
        f"value_{i}" for i in range(60_000)]}}, "required": ["pick"]},
        "#/properties/pick/enum has 60000 values", "limit of 4096"),
    "depth-400": (deep(400), "nests 400 levels deep", "limit of 32"),
}


@pytest.mark.parametrize("path", [CHAT, RESPONSES, COMPLETIONS])
@pytest.mark.parametrize("shape", list(COSTLY))
def test_a_schema_too_costly_to_compile_is_refused_at_once(server, path, shape):
    schema, what, limit = COSTLY[shape]
    started = time.monotonic()
    response = post(server, path, schema)
    took = time.monotonic() - started
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == PARAM[path], error
    assert what in error["message"] and limit in error["message"], error
    assert error["message"].startswith(PARAM[path]), error
    assert took < 5, f"refused after {took:.1f} s"
    assert wait_until(lambda: server.engine.requests == {}, 10)


def test_a_refusal_does_not_wait_for_its_own_compiles(server, held):
    """Priced before the compile lane: a costly schema is refused while its key's
    compile is held in flight (the lane would answer only once it ends)."""
    first = threading.Thread(target=post, args=(server, CHAT, wide(20, "held-1")))
    first.start()
    assert wait_until(lambda: held.held == ["held-1"], 30), held.calls
    response = post(server, RESPONSES, wide(3000), timeout=30)
    assert response.status_code == 400, response.text[:500]
    assert response.json()["error"]["param"] == "text.format.schema"
    assert not held.release.is_set()
    held.release.set()
    first.join(60)


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_another_keys_schema_compiles_while_one_keys_heavy_compile_is_in_flight(
        server, held, path):
    """Key A: the widest object accepted (256 optional properties), held in
    flight, and two more behind it. Key B's one-field schema is answered
    meanwhile; A's others wait for A's turn, not B's."""
    answers: dict[str, int] = {}

    def send(title: str) -> None:
        answers[title] = post(server, CHAT, wide(256, title), KEYS[0]).status_code

    senders = [threading.Thread(target=send, args=(f"held-{i}",)) for i in range(3)]
    senders[0].start()
    assert wait_until(lambda: held.held == ["held-0"], 30), held.calls
    for sender in senders[1:]:
        sender.start()
    # All three in the lane (held, or queued) before B asks.
    assert wait_until(lambda: len(held.held) + waiting(server, KEYS[0]) == 3, 30), held.calls
    try:
        response = post(server, path, SMALL, KEYS[1], timeout=30)
    except httpx.ReadTimeout:
        pytest.fail(f"key B waited behind key A's compiles (running: {held.held})")
    assert response.status_code == 200, response.text[:500]
    assert held.held == ["held-0"] and not held.release.is_set()  # A's first still held
    held.release.set()
    for sender in senders:
        sender.join(120)
    assert answers == {"held-0": 200, "held-1": 200, "held-2": 200}


def test_a_cut_requests_compile_holds_up_no_one(server, held):
    """Key A's compile is held and its client hangs up; two more of A's are cut
    while queued. Key B is answered meanwhile; A's queued compiles never start,
    and A's next request waits only for the held one, then its own compile."""
    hang_up_when(server, CHAT, wide(30, "held-0"), lambda: held.held == ["held-0"])
    for title in ["held-1", "held-2"]:  # queued behind A's running compile, then cut
        hang_up_when(server, RESPONSES, wide(30, title), lambda: waiting(server, KEYS[0]) == 1)
        assert wait_until(lambda: waiting(server, KEYS[0]) == 0, 10), f"{title} stayed queued"
    response = post(server, CHAT, SMALL, KEYS[1])
    assert response.status_code == 200, response.text[:500]
    assert held.held == ["held-0"] and not held.release.is_set()
    held.release.set()
    assert wait_until(lambda: running(server, KEYS[0]) == 0, 30)
    response = post(server, CHAT, wide(5, "next"), timeout=30)
    assert response.status_code == 200, response.text[:500]
    assert "held-1" not in held.calls and "held-2" not in held.calls, held.calls
