"""Keep-alive pings: a stream whose first token is slow to come still shows
the client (and any proxy) that the connection is alive."""

from __future__ import annotations

import dataclasses
import time

import httpx

from live_server import run_server, tiny_config


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
