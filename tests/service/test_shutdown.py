"""SIGTERM on a real `python -m service` process: a graceful drain, then exit 0.

Kubernetes stops a pod with SIGTERM and kills it after its grace period. The
server must stop taking connections at once, let the streams it is serving
run to their end (within --shutdown-grace-seconds), then exit with status 0;
streams that cannot finish in the grace period are cut rather than hanging
the process. These tests run the CLI in a child process, as a deployment
does, because signals and exit codes only exist at that level.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from live_server import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 200
LONG = 900  # with --max-model-len 1024: many seconds of decoding


@dataclass
class ChildServer:
    process: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(model_path, tmp_path: Path, grace_seconds: float,
                 max_model_len: int = 256) -> ChildServer:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    command = [
        sys.executable, "-m", "service",
        "--model", str(model_path),
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(64 << 20),
        "--shutdown-grace-seconds", str(grace_seconds),
        "--log-level", "info",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                   env=env)
    child = ChildServer(process, f"http://127.0.0.1:{port}", log)

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{child.output()}")
        try:
            return httpx.get(f"{child.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    if not wait_until(healthy, timeout=120, interval=0.1):
        stop(child)
        raise TimeoutError(f"the server did not become healthy:\n{child.output()}")
    return child


def stop(child: ChildServer) -> None:
    """Teardown: never leave the child behind, whatever the test did."""
    if child.process.poll() is None:
        child.process.kill()
    child.process.wait(30)


@pytest.fixture
def servers(tmp_path):
    started: list[ChildServer] = []
    yield started
    for child in started:
        stop(child)


@dataclass
class StreamResult:
    status: int | None = None
    events: list[str] = field(default_factory=list)  # the `data:` payloads, in order
    error: BaseException | None = None
    first_token: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def content_chunks(self) -> list[dict]:
        """Chunks that carry text (not the role chunk, not the usage chunk)."""
        return [c for c in self.chunks()
                if c.get("choices") and c["choices"][0]["delta"].get("content")]

    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks()
                if c.get("choices") and c["choices"][0]["finish_reason"] is not None]

    def usage(self) -> dict | None:
        usages = [c["usage"] for c in self.chunks() if c.get("usage")]
        return usages[-1] if usages else None


def stream_chat(url: str, result: StreamResult, max_tokens: int = MAX_TOKENS) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = AssertionError(f"HTTP {response.status_code}: {response.read()!r}")
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    result.events.append(payload)
                    if payload != "[DONE]" and '"content":"' in payload \
                            and '"content":""' not in payload:
                        result.first_token.set()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        result.error = exc
    finally:
        result.first_token.set()  # never leave the test waiting


def open_streams(url: str, count: int) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in range(count)]
    threads = [threading.Thread(target=stream_chat, args=(url, r), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_token.wait(60), "a stream produced no token"
    return results, threads


def new_request_is_not_served(url: str) -> None:
    """After SIGTERM a new request is refused at the socket, or answered 503."""
    try:
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=10,
        )
    except httpx.TransportError:
        return  # the listening socket is closed: refused, as wanted
    assert response.status_code == 503, response.text


def test_sigterm_drains_in_flight_streams_then_exits_0(tiny_llama_path, tmp_path, servers):
    child = start_server(tiny_llama_path, tmp_path, grace_seconds=20)
    servers.append(child)
    results, threads = open_streams(child.url, 4)
    # Every stream is mid-flight: started, far from its 200th token.
    for result in results:
        assert not result.done and len(result.content_chunks()) < MAX_TOKENS // 2, (
            "the streams finished too fast for this test to mean anything")

    signalled = time.monotonic()
    child.process.send_signal(signal.SIGTERM)
    new_request_is_not_served(child.url)

    for thread in threads:
        thread.join(30)
    code = child.process.wait(30)
    elapsed = time.monotonic() - signalled
    log = child.output()

    for result in results:
        assert result.error is None, f"stream broken: {result.error!r}\n{log}"
        assert result.done, f"stream did not end with [DONE]: {result.events[-3:]}\n{log}"
        assert result.finish_reasons() == ["length"], result.events[-4:]
        assert result.usage() is not None and result.usage()["completion_tokens"] == MAX_TOKENS
        # One chunk per sampled token (each step moves the request by one token).
        assert len([c for c in result.chunks() if c["choices"]
                    and c["choices"][0]["finish_reason"] is None
                    and c["choices"][0]["delta"].get("role") is None]) + 1 == MAX_TOKENS
        assert not any('"error"' in event for event in result.events)
    assert code == 0, f"exit code {code}\n{log}"
    assert elapsed < 20, f"the drain took {elapsed:.1f}s, past the grace period\n{log}"
    # The drain did not need uvicorn to cancel anything, and nothing failed.
    assert "timeout graceful shutdown exceeded" not in log, log
    assert "Traceback" not in log, log


def test_sigterm_with_short_grace_cuts_streams_and_exits_0(tiny_llama_path, tmp_path, servers):
    # 900 tokens each, 8 at once: seconds of work even on a fast machine, far past
    # a grace of half a second.
    child = start_server(tiny_llama_path, tmp_path, grace_seconds=0.5, max_model_len=1024)
    servers.append(child)
    results = [StreamResult() for _ in range(8)]
    threads = [threading.Thread(target=stream_chat, args=(child.url, r, LONG), daemon=True)
               for r in results]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_token.wait(60), "a stream produced no token"

    signalled = time.monotonic()
    child.process.send_signal(signal.SIGTERM)
    new_request_is_not_served(child.url)
    try:
        code = child.process.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server hung after SIGTERM with a 0.5 s grace:\n{child.output()}")
    elapsed = time.monotonic() - signalled
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a client is still reading from a dead server"
    log = child.output()

    assert code == 0, f"exit code {code}\n{log}"
    assert elapsed < 10, f"exiting took {elapsed:.1f}s after a 0.5 s grace\n{log}"
    # The streams were cut: none got to its end.
    for result in results:
        assert result.status == 200, result.error  # admitted before the signal
        # Cut short: no finish, no usage, no [DONE] (the connection was closed).
        assert result.finish_reasons() == [] and result.usage() is None, result.events[-3:]
        assert not result.done
        assert len(result.content_chunks()) < LONG
    assert "timeout graceful shutdown exceeded" in log, log
