"""`pagedserve chat` in a real terminal session's shape: a child process reading
its stdin, talking to a real server; Ctrl-C (SIGINT) stops an answer and the
chat goes on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from engine.config import EngineConfig
from live_server import run_server, tiny_config, wait_until
from service.config import ServiceConfig


def start_chat(url: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedserve", "chat", "--base-url", url,
                             *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=0)


def test_chat_streams_answers_and_reset_starts_over(tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as live:
        chat = start_chat(live.url, "--system", "You are terse.", "--max-tokens", "8")
        out, _ = chat.communicate("Hello\nAnd again\n/reset\nHi\n/exit\n", timeout=120)
        assert chat.returncode == 0, out
        assert out.count("you> ") == 5 and "(a new conversation)" in out
        answers = [line for line in out.split("you> ")[1:4] if line.strip()]
        assert len(answers) == 3 and all(len(a.strip()) > 0 for a in answers), out
        assert live.state.engine.stats.counters["num_requests_running"] == 0


def test_ctrl_c_stops_the_answer_not_the_chat(smollm2_path):
    engine = EngineConfig(model="smollm2-135m-instruct", max_model_len=2048,
                          kv_cache_memory_bytes=128 << 20)
    with run_server(ServiceConfig(engine=engine)) as live:
        chat = start_chat(live.url, "--max-tokens", "1000")
        chat.stdin.write("Tell me a very long story about the sea.\n")
        assert wait_until(lambda: live.state.engine.stats.counters["generation_tokens"] > 5, 60)
        time.sleep(0.5)
        chat.send_signal(signal.SIGINT)
        assert wait_until(lambda: live.state.engine.stats.counters["num_requests_running"] == 0
                          and live.state.engine.num_open == 0, 10)
        out, _ = chat.communicate("/exit\n", timeout=60)
        assert chat.returncode == 0, out
        assert "[stopped]" in out and out.count("you> ") == 2
        assert live.state.engine.stats.counters["generation_tokens"] < 1000
