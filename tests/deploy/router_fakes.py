"""What surrounds vLLM's router in a deployment, for the tests of its place in
docker-compose.yml and the Helm chart: the router itself (the real binary from
the vllm-router wheel), replicas that speak the router's side of pagedserve's
contract without a model, and a Kubernetes API that lists and watches pods.

A FakeReplica answers /health (503 while draining), the render endpoints the
kv_aware policy asks for a prompt's tokens (one token per character of the
request's messages or prompt, as JSON) and the completion endpoints, where it
"caches" the prompt's full 16-token blocks and publishes them as BlockStored
events through pagedserve's own publisher (engine/core/kv_events.py), so the
router indexes them as it would a real replica's. Its answer names the
replica and the prompt tokens it found cached.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from router_process import RouterProcess

BLOCK = 16  # the replicas' --block-size, and the router's --kv-event-block-size


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Router(RouterProcess):
    """A vllm-router process (tests/router_process.py) and its URL."""

    def __init__(self, args: list[str], log: Path, port: int, env: dict | None = None) -> None:
        super().__init__(args, log, env)
        self.url = f"http://127.0.0.1:{port}"

    def chat(self, content: str, system: str | None = None) -> tuple[str, int]:
        """A chat completion through the router: (the replica that answered, the
        prompt tokens it found cached)."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": content})
        response = httpx.post(f"{self.url}/v1/chat/completions", timeout=30,
                              json={"model": "m", "messages": messages, "max_tokens": 1})
        assert response.status_code == 200, response.text
        body = response.json()
        return (body["choices"][0]["message"]["content"],
                body["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt_tokens(body: dict) -> list[int]:
    """The fake tokenizer: one token per character of the messages (or prompt)."""
    return [ord(c) for c in json.dumps(body.get("messages", body.get("prompt")))]


class FakeReplica:
    """A replica on host:port publishing KV events on `events` (replay on
    `replay`); `routes` maps more GET paths to the JSON they answer."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0,
                 events: str | None = None, replay: str | None = None,
                 routes: dict | None = None) -> None:
        from engine.core.kv_events import KVEventPublisher

        self.name, self.routes, self.draining = name, routes or {}, False
        self.served: list[int] = []  # cached tokens of each completion served
        self.paths: list[str] = []  # every path asked for, in order
        self.published = 0  # event batches sent
        self._held: set[bytes] = set()
        self._lock = threading.Lock()
        self.publisher = (KVEventPublisher(events, replay_endpoint=replay)
                          if events else None)
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _complete(self, body: dict) -> int:
        """Caches the prompt's full blocks; returns the tokens that were cached."""
        from engine.core.kv_events import stored_events

        tokens = prompt_tokens(body)
        hashes, digest = [], b""
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            digest = hashlib.sha256(digest + json.dumps(tokens[start:start + BLOCK]).encode())
            digest = digest.digest()
            hashes.append(digest)
        with self._lock:
            hit = next((i for i, h in enumerate(hashes) if h not in self._held), len(hashes))
            new = [i for i, h in enumerate(hashes) if h not in self._held]
            self._held.update(hashes)
            if new and self.publisher is not None:
                self.publisher.publish(stored_events(new, hashes, BLOCK,
                                                     lambda a, b: tokens[a:b]))
                self.published += 1
            self.served.append(hit * BLOCK)
        return hit * BLOCK

    def _handler(self):
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                replica.paths.append(path)
                if path == "/health":
                    return self.answer(503 if replica.draining else 200, {})
                if path in replica.routes:
                    return self.answer(200, replica.routes[path])
                return self.answer(404, {"error": "not found"})

            def do_POST(self) -> None:
                replica.paths.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path.endswith("/render"):
                    return self.answer(200, {"token_ids": prompt_tokens(body)})
                if replica.draining:
                    return self.answer(503, {"error": "draining"})
                cached = replica._complete(body)
                return self.answer(200, {
                    "id": "x", "object": "chat.completion", "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": replica.name}}],
                    "usage": {"prompt_tokens": len(prompt_tokens(body)), "completion_tokens": 1,
                              "total_tokens": 1 + len(prompt_tokens(body)),
                              "prompt_tokens_details": {"cached_tokens": cached}}})

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.publisher is not None:
            self.publisher.close()


class FakeKubernetes:
    """The pod list and watch of a Kubernetes API, over plain HTTP. `requests`
    records (method, path) of every call: what the router's RBAC must allow."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods, self.requests, self.closed = pods, [], False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @staticmethod
    def pod(name: str, namespace: str, ip: str, labels: dict) -> dict:
        """A Running, Ready pod."""
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "uid": name,
                             "resourceVersion": "1", "labels": labels},
                "spec": {"containers": [{"name": "server", "image": "pagedserve"}]},
                "status": {"phase": "Running", "podIP": ip,
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    def kubeconfig(self, path: Path, namespace: str) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "router", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router",
                                                      "namespace": namespace}}]}))
        return path

    def _handler(self):
        kube = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                kube.requests.append(("GET", self.path))
                if "watch=true" in self.path:  # no changes: a bookmark a second
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    event = json.dumps({"type": "BOOKMARK", "object": {
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"resourceVersion": "1"}}}).encode() + b"\n"
                    try:
                        while not kube.closed:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                            self.wfile.flush()
                            time.sleep(1)
                    except OSError:
                        pass
                    return
                data = json.dumps({"apiVersion": "v1", "kind": "PodList",
                                   "metadata": {"resourceVersion": "1"},
                                   "items": kube.pods}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def close(self) -> None:
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
