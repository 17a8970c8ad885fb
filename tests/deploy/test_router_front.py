"""A keyed fleet behind vLLM's router (issue 57, finding 3).

With --api-key replicas behind vllm-router, `Bearer keyA` worked for chat,
completions and models, but /v1/responses, /tokenize and the render routes
answered 401: the router forwards the client's headers on some routes and
only the body on the others. Two parts here:

- What the router forwards, route by route, seen by a stand-in replica that
  records every request's headers: every route pagedserve serves is sent
  through the real router (started with --api-key, which it sends instead on
  the body-only routes). docs/deployment.md's table is this test's FORWARDS.
- The documented fleet for real: nginx running compose's front
  (deploy/nginx/front/pagedserve-front.conf.template) before the real router
  (kv_aware, as compose runs it) and a real keyed replica: every documented
  route answers with a key as the replica does alone, and 401 without one;
  chat and completions went through the router, the rest straight to the
  replica; and the front's X-Forwarded-For lets a replica that trusts it pace
  each client apart.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from live_server import free_port, run_server, tiny_config
from nginx_server import start_nginx
from router_fakes import Router
from starlette.routing import Mount

from engine.config import EngineConfig
from service.config import ServiceConfig
from service.routes import app_routes

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
FRONT = ROOT / "deploy" / "nginx" / "front" / "pagedserve-front.conf.template"
# vllm-router 0.1.17: the routes on which it passes the client's headers
# (Authorization, X-Forwarded-For unchanged, X-Session-ID ...); every other route
# gets the body alone, Authorization only as the router's own --api-key.
FORWARDS = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/embeddings",
            "POST /rerank", "POST /v1/rerank", "GET /v1/models", "GET /get_server_info"}
ANSWERS_ITSELF = {"GET /health"}  # "All servers healthy": never reaches a replica
SENT_ON_AS = {"POST /rerank": "/v1/rerank"}  # paths the router rewrites
WEB_FILE = "app.js"


class Recorder:
    """A stand-in replica that records each request's path and headers and
    answers 200 with a body any of the router's parsers takes."""

    ANSWER = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}],
                         "token_ids": [1, 2], "choices": [], "results": []}).encode()

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def requests(self) -> list[tuple[str, str, dict]]:
        """What reached it, less the router's own health checks."""
        return [seen for seen in self.seen if seen[1] != "/health"]

    def _handler(self):
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                recorder.seen.append((self.command, self.path, headers))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(Recorder.ANSWER)))
                self.end_headers()
                self.wfile.write(Recorder.ANSWER)

            do_GET = do_POST = _answer

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def served_routes() -> list[str]:
    """Every route pagedserve serves, as "METHOD /path" (a model id for the path's
    parameter), the run-time LoRA routes included."""
    routes = []
    config = ServiceConfig(engine=EngineConfig(enable_lora=True), allow_runtime_lora_updating=True)
    for route in app_routes(config):
        if isinstance(route, Mount):  # the chat page's files
            routes.append(f"GET {route.path}/{WEB_FILE}")
            continue
        path = route.path.replace("{model_id:path}", "tiny")
        routes += [f"{method} {path}" for method in sorted(route.methods - {"HEAD"})]
    return routes


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Each served route sent once through the real router to a Recorder: route -> the
    (method, path, headers) that reached the replica, None for none."""
    recorder, port = Recorder(), free_port()
    router = Router(["--host", "127.0.0.1", "--port", str(port), "--worker-urls", recorder.url,
                     "--policy", "round_robin", "--api-key", "router-key",
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                    tmp_path_factory.mktemp("router") / "router.log", port)
    try:
        router.wait_for(r"Router ready")
        found = {}
        headers = {"Authorization": "Bearer keyA", "X-Forwarded-For": "10.0.0.1",
                   "X-Session-ID": "s-1"}
        for route in served_routes():
            method, path = route.split(" ", 1)
            before = len(recorder.requests())
            body = {"model": "tiny", "prompt": "hi", "messages": [], "input": "hi",
                    "query": "q", "documents": ["d"]}
            httpx.request(method, router.url + path, headers=headers, timeout=30,
                          json=body if method == "POST" else None)
            arrived = recorder.requests()[before:]
            assert len(arrived) <= 1, (route, arrived)
            found[route] = arrived[0] if arrived else None
        yield found
    finally:
        router.stop()
        recorder.close()


def test_the_router_forwards_authorization_on_these_routes_only(recorded):
    assert set(recorded) >= FORWARDS | ANSWERS_ITSELF
    for route, seen in recorded.items():
        if route in ANSWERS_ITSELF:
            assert seen is None, route
            continue
        method, path = route.split(" ", 1)
        assert seen is not None and seen[:2] == (method, SENT_ON_AS.get(route, path)), (route,
                                                                                        seen)
        headers = seen[2]
        if route in FORWARDS:
            assert headers["authorization"] == "Bearer keyA", route
            # The client's own X-Forwarded-For, unchanged: the router appends nothing.
            assert headers["x-forwarded-for"] == "10.0.0.1", route
            assert headers["x-session-id"] == "s-1", route
        else:  # the body alone, and the router's own key in the client's place
            assert headers.get("authorization") == "Bearer router-key", route
            assert set(headers) <= {"authorization", "content-type", "content-length",
                                    "accept", "host"}, (route, headers)


def test_the_front_sends_the_router_only_routes_it_forwards_keys_on():
    text = FRONT.read_text()
    to_router = {f"POST {line.split()[2]}" for line in text.splitlines()
                 if line.strip().startswith("location = ")}
    assert to_router == {"POST /v1/chat/completions", "POST /v1/completions"} <= FORWARDS


# -- the documented fleet, for real ------------------------------------------------------
KEYS = {"keyA": {"Authorization": "Bearer keyA"}, "admin": {"Authorization": "Bearer admin"}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
POOLED = {"model": "tiny", "input": "hi", "text_1": "a", "text_2": "b", "query": "q",
          "documents": ["d"]}
# Every route of the README's table: (method, path, body, key); the router takes
# the first two paths, the replica the rest.
DOCUMENTED = [
    ("POST", "/v1/chat/completions", CHAT, "keyA"),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}, "keyA"),
    ("POST", "/v1/completions", COMPLETION, "keyA"),
    ("POST", "/v1/completions", {**COMPLETION, "stream": True}, "keyA"),
    ("POST", "/v1/responses", RESPONSE, "keyA"),
    ("POST", "/v1/responses", {**RESPONSE, "stream": True}, "keyA"),
    ("POST", "/v1/chat/completions/render", CHAT, "keyA"),
    ("POST", "/v1/completions/render", COMPLETION, "keyA"),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}, "keyA"),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}, "keyA"),
    ("GET", "/v1/models", None, "keyA"),
    ("GET", "/v1/models/tiny", None, "keyA"),
    *[("POST", path, POOLED, "keyA") for path in (  # 400 on a generative server
        "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
        "/v1/rerank", "/v2/rerank")],
    ("POST", "/reset_prefix_cache", None, "admin"),
    ("POST", "/reset_prefix_cache", None, "keyA"),  # 403: not an admin key
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "none"}, "admin"),
    ("GET", "/health", None, "keyA"), ("GET", "/live", None, "keyA"),
    ("GET", "/metrics", None, "keyA"), ("GET", "/get_server_info", None, "keyA"),
    ("GET", "/kv_event_sources", None, "keyA"), ("GET", "/openapi.json", None, "keyA"),
    ("GET", "/", None, "keyA"), ("GET", f"/web/{WEB_FILE}", None, "keyA"),
]
TO_ROUTER = {"/v1/chat/completions", "/v1/completions"}
RATE, BURST = 20.0, 8


@pytest.fixture(scope="module")
def fleet(tiny_llama_path, tmp_path_factory):
    """A keyed replica that trusts loopback's X-Forwarded-For (the front and the router
    run there), the router before it as compose runs it (kv_aware, the replica's
    events), and nginx running the front before both."""
    folder = tmp_path_factory.mktemp("front")
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    config = tiny_config(tiny_llama_path, engine={"kv_events_endpoint": events,
                                                  "kv_events_replay_endpoint": replay,
                                                  "enable_lora": True},
                         api_keys=("keyA", "keyB"), admin_keys=("admin",),
                         allow_runtime_lora_updating=True, trusted_proxies=("127.0.0.1",),
                         refusal_rate=RATE, refusal_burst=BURST)
    with run_server(config) as replica:
        port = free_port()
        router = Router([
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", replica.url,
            "--policy", "kv_aware", "--router-temperature", "32",
            "--kv-event-source", f"{replica.url}={events}",
            "--kv-event-replay-source", f"{replica.url}={replay}",
            "--kv-event-model", "tiny", "--kv-event-block-size", "16",
            "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            folder / "router.log", port)
        front = None
        try:
            router.wait_for(r"Router ready")
            front = start_nginx(folder / "nginx", [replica.url.removeprefix("http://")],
                                FRONT, PAGEDSERVE_ROUTER=f"127.0.0.1:{port}")
            yield replica, router, front
        finally:
            if front is not None:
                front.stop()
            router.stop()


def send(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def test_every_documented_route_answers_through_the_front_as_the_replica_does(fleet):
    replica, router, front = fleet
    assert "kv_index subscriber" in router.text()  # kv_aware, reading the replica's events
    sent = {}
    for method, path, body, key in DOCUMENTED:
        direct = send(replica.url, method, path, body, KEYS[key])
        test_id = uuid.uuid4().hex
        through = send(front.url, method, path, body, {**KEYS[key], "X-Test-ID": test_id})
        route = f"{method} {path} {key}" + (" stream" if (body or {}).get("stream") else "")
        assert through.status_code == direct.status_code, (route, through.text)
        assert through.status_code != 401, route
        if body and body.get("stream"):  # the whole stream came through
            end = ("event: response.incomplete" if path == "/v1/responses"  # 2 tokens: cut
                   else "data: [DONE]")
            assert end in through.text, (route, through.text[-300:])
        sent[test_id] = path
        # Without a key: the same answer too (401 on every route but the open ones).
        assert (send(front.url, method, path, body, {}).status_code
                == send(replica.url, method, path, body, {}).status_code), route
    router_address = router.url.removeprefix("http://")
    replica_address = replica.url.removeprefix("http://")
    for test_id, (tried, _) in front.served_by().items():
        if test_id in sent:
            expected = router_address if sent[test_id] in TO_ROUTER else replica_address
            assert tried == expected, (sent[test_id], tried)
    assert len([t for t in front.served_by() if t in sent]) == len(sent)


def test_the_replica_paces_each_client_behind_the_front(fleet):
    """The front appends the address it saw to X-Forwarded-For; a replica that trusts
    it (--trusted-proxy) gives each client its own bucket: one client's flood of
    refusals waits and overflows, another's next refusal goes out at once."""
    replica, router, front = fleet
    bad = {"model": "tiny", "prompt": "hi", "foo": 1}

    async def post(http) -> tuple[int, float]:
        started = time.monotonic()
        response = await http.post("/tokenize", json=bad, headers={"Authorization": "Bearer keyB"})
        return response.status_code, time.monotonic() - started

    async def run():
        clients = [httpx.AsyncClient(base_url=front.url, timeout=30, transport=(
            httpx.AsyncHTTPTransport(local_address=address)))
            for address in ("127.0.0.7", "127.0.0.8")]
        try:
            flood = [asyncio.create_task(post(clients[0])) for _ in range(2 * BURST + 4)]
            for answered in asyncio.as_completed(flood):
                if (await answered)[0] == 429:  # the first client overflowed its debt
                    break
            other = await post(clients[1])
            return await asyncio.gather(*flood), other
        finally:
            for client in clients:
                await client.aclose()

    flood, other = asyncio.run(run())
    statuses = sorted(status for status, _ in flood)
    assert 400 in statuses and 429 in statuses, statuses
    assert max(seconds for _, seconds in flood) >= BURST / RATE - 0.05, flood
    assert other[0] == 400 and other[1] < 0.15, other
