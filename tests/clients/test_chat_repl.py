"""`pagedserve chat` in a real terminal session's shape: a child process reading
its stdin, talking to a real server; Ctrl-C (SIGINT) stops an answer and the
chat goes on."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading


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
        output = Output(chat)
        chat.stdin.write("Tell me a very long story about the sea.\n")
        # Ctrl-C once the answer is being written, as a person would press it.
        assert wait_until(lambda: len(output.text().partition("you> ")[2]) > 20, 60), \
            output.text()
        chat.send_signal(signal.SIGINT)
        assert wait_until(lambda: live.state.engine.stats.counters["num_requests_running"] == 0
                          and live.state.engine.num_open == 0, 10), output.text()
        chat.stdin.write("/exit\n")
        assert chat.wait(timeout=60) == 0, output.text()
        output.reader.join(timeout=10)
        assert "[stopped]" in output.text() and output.text().count("you> ") == 2
        assert live.state.engine.stats.counters["generation_tokens"] < 1000


def test_ctrl_c_before_the_first_byte_stops_the_answer_not_the_chat():
    """Ctrl-C while the answer's headers are awaited (a long prefill, a busy
    server) returns to the prompt too, and the connection is closed. The server
    here is a listener that reads the request and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        chat = start_chat(f"http://127.0.0.1:{port}", "--max-tokens", "8")
        output = Output(chat)
        chat.stdin.write("Hello\n")
        listener.settimeout(60)
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(30)
            request = b""
            while b"\r\n\r\n" not in request:  # the headers; the body follows
                request += connection.recv(65536)
            chat.send_signal(signal.SIGINT)
            while connection.recv(65536):  # until the client closes it
                pass
        chat.stdin.write("/exit\n")
        assert chat.wait(timeout=60) == 0, output.text()
    output.reader.join(timeout=10)
    assert "[stopped]" in output.text() and output.text().count("you> ") == 2, output.text()


class Output:
    """What a chat process writes, read as it comes by a thread of its own."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.pieces: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        while piece := stream.read(1):
            self.pieces.append(piece)

    def text(self) -> str:
        return "".join(self.pieces)
