"""SIGTERM on a real `python -m service` process: a graceful drain, then exit 0.

Kubernetes stops a pod with SIGTERM and kills it after its grace period. On
SIGTERM the server reports itself draining (/health 503) and refuses new
generation requests with a 503 "shutting_down", but keeps its listener open
while requests still run, so probes and retries get an answer rather than a
refused connection. Open requests run on for up to --shutdown-grace-seconds;
those still open when it runs out are told why they end (an in-band error
event, then [DONE], for a stream; a 503 for a plain request) instead of
having their connection cut. Then the process exits with status 0 and no
traceback. These tests run the CLI in a child process, as a deployment does,
because signals and exit codes only exist at that level.

They may run on a slow, busy 2-core CI machine: they check order and
behaviour (a stream still open when a probe is answered, a request still
waiting when the signal goes out) and keep their wall-clock bounds generous.
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

from live_server import child_healthy, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 200
LONG = 900  # with --max-model-len 1024: many seconds of decoding
# After the grace, uvicorn may wait up to service.cli.FLUSH_SECONDS (5 s) for the
# last bytes to go out, and the engine thread stops after its current step. On a
# busy machine all that still takes a few seconds, never the tens allowed here.
EXIT_SECONDS = 30


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
        return child_healthy(process, child.url, child.output)

    if not wait_until(healthy, timeout=120, interval=0.1):
        stop(child)
        raise TimeoutError(f"the server did not become healthy:\n{child.output()}")
    return child


def stop(child: ChildServer) -> None:
    """Teardown: never leave the child behind, whatever the test did."""
    if child.process.poll() is None:
        child.process.kill()
    child.process.wait(30)


def wait_for_exit(child: ChildServer, signalled: float, what: str) -> tuple[int, float]:
    """The child's exit code and the seconds from the signal to its exit."""
    try:
        code = child.process.wait(EXIT_SECONDS * 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server hung after SIGTERM ({what}):\n{child.output()}")
    return code, time.monotonic() - signalled


def assert_clean_log(log: str) -> None:
    """Nothing failed, nothing was cancelled, uvicorn had nothing to cut."""
    assert "Traceback" not in log, log
    assert "CancelledError" not in log, log
    assert "timeout graceful shutdown exceeded" not in log, log


@pytest.fixture
def servers(tmp_path):
    started: list[ChildServer] = []
    yield started
    for child in started:
        stop(child)


def chat_body(max_tokens: int, stream: bool, content: str = "Tell me a long story.") -> dict:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def assert_shutting_down(error: dict) -> None:
    """OpenAI's error object, saying the server is shutting down."""
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "service_unavailable", error
    assert error["param"] is None, error
    assert error["code"] == "shutting_down", error


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

    def errors(self) -> list[dict]:
        """The in-band error events' error objects."""
        return [c["error"] for c in self.chunks() if "error" in c]


def stream_chat(url: str, result: StreamResult, max_tokens: int = MAX_TOKENS) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json=chat_body(max_tokens, stream=True), timeout=120) as response:
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


def open_streams(url: str, count: int, max_tokens: int = MAX_TOKENS
                 ) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in range(count)]
    threads = [threading.Thread(target=stream_chat, args=(url, r, max_tokens), daemon=True)
               for r in results]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_token.wait(60), "a stream produced no token"
        assert result.error is None, f"a stream failed before the signal: {result.error!r}"
    return results, threads


def join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(EXIT_SECONDS)
        assert not thread.is_alive(), "a client is still reading from a server that exited"


@dataclass
class PlainResult:
    """A non-streaming request's answer."""

    status: int | None = None
    body: dict | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


def plain_chat(url: str, result: PlainResult, max_tokens: int) -> None:
    try:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json=chat_body(max_tokens, stream=False), timeout=120)
        result.status = response.status_code
        result.body = response.json()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        result.error = exc
    finally:
        result.finished.set()


def engine_requests(url: str) -> int:
    """Requests the engine runs or queues, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("pagedserve:num_requests_running ",
                            "pagedserve:num_requests_waiting ")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def new_request_is_refused_with_503(url: str, streams: list[StreamResult]) -> None:
    """During the drain a new request is answered 503 "shutting_down".

    The listener stays open while requests run, so a refused connection is a
    failure as long as a stream is still open; only once every stream has
    ended may the drain be over and the listener closed.
    """
    try:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json=chat_body(2, stream=False, content="hi"), timeout=30)
    except httpx.TransportError as exc:
        still_open = sum(not r.done and r.error is None for r in streams)
        assert not still_open, (
            f"the listener refused a request while {still_open} stream(s) were open: {exc!r}")
        return
    assert response.status_code == 503, response.text
    assert_shutting_down(response.json()["error"])


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
    new_request_is_refused_with_503(child.url, results)

    join_all(threads)
    code, elapsed = wait_for_exit(child, signalled, "a 20 s grace, streams of 200 tokens")
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
        assert result.errors() == [], result.events[-3:]
    assert code == 0, f"exit code {code}\n{log}"
    # The streams ended on their own, well inside the grace: nothing was cut
    # (checked above); exiting did not wait for the grace to run out.
    assert elapsed < 20 + EXIT_SECONDS, f"the drain took {elapsed:.1f}s\n{log}"
    assert_clean_log(log)


def test_sigterm_past_short_grace_ends_each_request_with_shutting_down_error(
        tiny_llama_path, tmp_path, servers):
    # 900 tokens each, 8 streams and a plain request at once: seconds of work
    # even on a fast machine, far past a grace of half a second.
    child = start_server(tiny_llama_path, tmp_path, grace_seconds=0.5, max_model_len=1024)
    servers.append(child)

    plain = PlainResult()
    plain_thread = threading.Thread(target=plain_chat, args=(child.url, plain, LONG), daemon=True)
    plain_thread.start()
    # Admitted before the signal: the engine holds it.
    assert wait_until(lambda: plain.finished.is_set() or engine_requests(child.url) >= 1,
                      timeout=60, interval=0.05), "the plain request never reached the engine"
    results, threads = open_streams(child.url, 8, LONG)
    # All nine are still open when the signal goes out.
    assert not plain.finished.is_set(), (
        f"the plain request ended before the signal: {plain.status} {plain.error!r}")
    assert not any(r.done for r in results), "a stream finished before the signal"

    signalled = time.monotonic()
    child.process.send_signal(signal.SIGTERM)
    join_all(threads)
    plain_thread.join(EXIT_SECONDS)
    assert not plain_thread.is_alive(), "the plain request got no answer"
    code, elapsed = wait_for_exit(child, signalled, "a 0.5 s grace")
    log = child.output()

    assert code == 0, f"exit code {code}\n{log}"
    # Far less than 9 requests of 900 tokens take; EXIT_SECONDS only rules out a hang.
    assert elapsed < EXIT_SECONDS, f"exiting took {elapsed:.1f}s after a 0.5 s grace\n{log}"

    # Each stream was cut, and told so: its last two events are OpenAI's error
    # object (code "shutting_down") and [DONE], on a connection closed cleanly.
    for result in results:
        assert result.status == 200 and result.error is None, (
            f"stream broken rather than ended: {result.error!r}\n{log}")
        assert result.done, f"stream did not end with [DONE]: {result.events[-3:]}\n{log}"
        assert len(result.events) >= 3, result.events  # role chunk, a token, ..., error, [DONE]
        last = json.loads(result.events[-2])
        assert set(last) == {"error"}, result.events[-3:]
        assert_shutting_down(last["error"])
        assert len(result.errors()) == 1, result.events[-4:]
        # Cut short: no finish reason, no usage chunk, not all its tokens.
        assert result.finish_reasons() == [] and result.usage() is None, result.events[-3:]
        assert 0 < len(result.content_chunks()) < LONG

    # The plain request, still waiting for its 900 tokens, got a 503 in OpenAI's shape.
    assert plain.error is None, f"the plain request broke: {plain.error!r}\n{log}"
    assert plain.status == 503, f"{plain.status} {plain.body}"
    assert set(plain.body) == {"error"}, plain.body
    assert_shutting_down(plain.body["error"])

    assert_clean_log(log)


def test_sigterm_health_says_draining_and_new_requests_get_503_while_streams_run(
        tiny_llama_path, tmp_path, servers):
    # Streams of 900 tokens: seconds of work, still running when the probes
    # below are answered. A grace of 10 s: whether they end on their own or are
    # cut when it runs out, each must end with [DONE].
    child = start_server(tiny_llama_path, tmp_path, grace_seconds=10, max_model_len=1024)
    servers.append(child)
    results, threads = open_streams(child.url, 4, LONG)

    child.process.send_signal(signal.SIGTERM)
    # The flag is set by the signal handler, at once; a 200 is allowed only until
    # the child has run it. A refused connection is never allowed: the listener
    # stays open while streams run.
    answers: list[httpx.Response] = []

    def draining() -> bool:
        try:
            answers.append(health(child.url))
        except httpx.TransportError as exc:
            pytest.fail(f"/health refused while streams ran: {exc!r}\n{child.output()}")
        return answers[-1].status_code != 200

    assert wait_until(draining, timeout=10, interval=0.05), (
        f"/health kept answering 200 after SIGTERM:\n{child.output()}")
    open_at_health = [not r.done for r in results]
    response = answers[-1]
    assert response.status_code == 503, response.text
    assert response.json()["status"] == "draining", response.text

    new_request_is_refused_with_503(child.url, results)
    open_at_refusal = [not r.done for r in results]

    # The probes were answered while every stream was still open: the drain had
    # not ended, the listener was open because requests were running.
    assert all(open_at_health) and all(open_at_refusal), (
        "the streams ended before the probes; this test needs longer streams")

    join_all(threads)
    code, _ = wait_for_exit(child, time.monotonic(), "a 10 s grace")
    log = child.output()
    assert code == 0, f"exit code {code}\n{log}"
    for result in results:
        assert result.status == 200 and result.error is None, f"{result.error!r}\n{log}"
        assert result.done, f"stream did not end with [DONE]: {result.events[-3:]}\n{log}"
        if result.errors():  # cut by the end of the grace
            assert result.errors() == [json.loads(result.events[-2])["error"]]
            assert_shutting_down(result.errors()[0])
            assert result.finish_reasons() == []
        else:  # it finished within the grace
            assert result.finish_reasons() == ["length"], result.events[-4:]
    assert_clean_log(log)


def test_sigterm_on_an_idle_server_exits_0_promptly(tiny_llama_path, tmp_path, servers):
    grace = 60.0
    child = start_server(tiny_llama_path, tmp_path, grace_seconds=grace)
    servers.append(child)

    signalled = time.monotonic()
    child.process.send_signal(signal.SIGTERM)
    code, elapsed = wait_for_exit(child, signalled, "idle, 60 s grace")
    log = child.output()
    assert code == 0, f"exit code {code}\n{log}"
    # Nothing to wait for: no drain, no flush. A busy machine takes a second or
    # two; waiting out the grace would take a minute.
    assert elapsed < grace / 3, f"an idle server took {elapsed:.1f}s to exit\n{log}"
    assert_clean_log(log)
