"""A stream before its first token: keep-alive pings show the client (and any
proxy) that the connection is alive, the first data chunk leaves with the
first token, and a client that leaves before reading anything is aborted."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import httpx

from live_server import run_server, tiny_config, wait_until


def test_pings_are_sent_while_the_first_token_is_slow(tiny_llama_path):
    config = dataclasses.replace(tiny_config(tiny_llama_path), sse_ping_seconds=0.2)
    with run_server(config) as live:
        runner = live.engine.runner
        real_execute = runner.execute

        def slow_execute(scheduled):
            time.sleep(0.5)  # a long prefill, as a 100k-token prompt would take
            return real_execute(scheduled)

        runner.execute = slow_execute
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True,
                "ignore_eos": True}
        lines = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        pings = [line for line in lines[:first_data] if line.startswith(":")]
        assert pings, f"no keep-alive comment before the first token: {lines[:5]}"
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"


def slow_steps(live, seconds: float) -> None:
    """Every engine step takes at least `seconds` (a long prefill, a slow machine)."""
    runner = live.engine.runner
    real_execute = runner.execute

    def slow_execute(scheduled):
        time.sleep(seconds)
        return real_execute(scheduled)

    runner.execute = slow_execute


def test_a_chat_stream_sends_its_first_data_with_the_first_token(tiny_llama_path):
    # Before: the role chunk left ~10 ms after the request, before the prefill, so a
    # benchmark timing the first chunk (vLLM's bench serve does) saw a TTFT of 10 ms.
    config = dataclasses.replace(tiny_config(tiny_llama_path), sse_ping_seconds=0.2)
    with run_server(config) as live:
        slow_steps(live, 0.6)  # the prefill, and each token after it
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 3, "stream": True, "ignore_eos": True}
        lines = []
        sent = time.monotonic()
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body,
                          timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append((time.monotonic() - sent, line))
    data = [(at, json.loads(line[5:])) for at, line in lines
            if line.startswith("data:") and line != "data: [DONE]"]
    first_at, first = data[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_at > 0.5, f"the first data chunk came {first_at:.3f} s in, before the prefill"
    # The first token's text follows at once, not a step later.
    token_at, token = data[1]
    assert token["choices"][0]["delta"].get("content") is not None
    assert token_at - first_at < 0.3, (first_at, token_at)
    before = [line for at, line in lines if at < first_at and line]
    assert before and all(line.startswith(":") for line in before), before  # keep-alives only


def test_a_client_that_leaves_before_reading_a_byte_is_aborted(tiny_llama_path):
    # A raw socket sends a streamed chat that would run ~150 s and closes without
    # reading anything, while the request's prefill is still running.
    with run_server(tiny_config(tiny_llama_path, {"max_model_len": 1024})) as live:
        warm = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}  # first use builds kernels
        assert httpx.post(f"{live.url}/v1/completions", json=warm, timeout=300).is_success
        slow_steps(live, 0.5)  # the close comes during the prefill's step
        body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 300,
                           "ignore_eos": True,
                           "messages": [{"role": "user", "content": "word " * 300}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head + body)
            assert wait_until(lambda: live.metrics()["pagedserve:num_requests_running"] == 1,
                              30), "the request never started"
        left = time.monotonic()

        def idle() -> bool:
            m = live.metrics()
            return (m["pagedserve:num_requests_running"] == 0
                    and m["pagedserve:num_requests_waiting"] == 0
                    and m["pagedserve:kv_cache_usage_perc"] == 0)

        assert wait_until(idle, 10), live.metrics()
        assert time.monotonic() - left < 5  # aborted, not run to its 300 tokens
