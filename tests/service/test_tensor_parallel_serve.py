"""`pagedserve serve --tensor-parallel-size N` as a deployment runs it: a child process.

SmolLM2 split over three ranks streams a chat over HTTP; SIGTERM then stops
the server and every worker with it. A worker killed under a running server
turns /health and /live into 503 "dead" within seconds, fails the open stream
in-band, and leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from httpx_sse import connect_sse

from live_server import free_port, wait_until
from processes import alive, all_gone, children

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, model: Path, size: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "pagedserve", "serve", "--model", str(model),
                   "--port", str(self.port), "--tensor-parallel-size", str(size),
                   "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)]
        with open(log, "wb") as sink:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=sink,
                                            stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if not wait_until(self._healthy, timeout=180, interval=0.2):
            self.stop()
            raise TimeoutError(f"the server did not become healthy:\n{self.output()}")
        self.workers = children(self.process.pid)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def chat(max_tokens: int) -> dict:
    return {"stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}]}


def stream_events(client: httpx.Client, body: dict) -> list[str]:
    model = client.get("/v1/models").json()["data"][0]["id"]
    with connect_sse(client, "POST", "/v1/chat/completions", json={**body, "model": model}) as source:
        return [event.data for event in source.iter_sse()]


def test_three_ranks_stream_a_chat_and_sigterm_leaves_no_worker(smollm2_short_path, tmp_path, servers):
    # SmolLM2's 9 heads and 3 KV heads (its first 4 layers) split over 3 ranks.
    server = Server(smollm2_short_path, 3, tmp_path / "server.log")
    servers.append(server)
    assert len(server.workers) == 2 and all(alive(pid) for pid in server.workers)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        events = stream_events(client, chat(24))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip(), events
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    weights = [line for line in metrics.splitlines()
               if line.startswith("pagedserve:model_weights_bytes{")]
    assert [line.split('"')[1] for line in weights] == ["0", "1", "2"]

    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.output()
    assert all_gone(server.workers, timeout=5), "a worker outlived the server"
    assert "Traceback" not in server.output()


def test_a_killed_worker_makes_the_server_report_dead(tiny_llama_path, tmp_path, servers):
    server = Server(tiny_llama_path, 2, tmp_path / "server.log")
    servers.append(server)
    [worker] = server.workers
    body = {**chat(450), "ignore_eos": True, "model": str(tiny_llama_path)}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with connect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
            events = source.iter_sse()
            next(events)  # generation runs
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            rest = [event.data for event in events]
    # The open stream ends at once, told why in-band, then [DONE].
    assert time.monotonic() - killed < 10
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert "exited with code -9" in error["message"], error

    health = httpx.get(f"{server.url}/health", timeout=2)
    assert health.status_code == 503
    assert health.json()["status"] == "dead" and "exited with code -9" in health.text
    assert httpx.get(f"{server.url}/live", timeout=2).status_code == 503
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                         json={**body, "stream": False})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(60)
    assert not alive(worker)
