"""A real uvicorn server on a free loopback port, in a background thread.

Tests talk HTTP to it (httpx, the openai SDK, raw sockets). Running it in
this process, rather than a child, lets a test reach the app's state: read
the engine's block manager after a disconnect, or inject a fault into the
model runner. Tests that need a separate process (SIGTERM) start one themselves.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from engine.config import EngineConfig
from service.app import create_app
from service.config import ServiceConfig
from service.guards.connections import uvicorn_options


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accepts(port: int) -> bool:
    """Whether something listens on this loopback port (a server we started)."""
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class LiveServer:
    url: str
    app: object
    server: uvicorn.Server

    @property
    def state(self):
        return self.app.state.service

    @property
    def engine(self):
        """The synchronous LLMEngine behind the bridge (read it only when idle)."""
        return self.state.engine.engine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {name: value} (samples without labels only)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values


@contextmanager
def run_server(config: ServiceConfig, startup_timeout: float = 120) -> Iterator[LiveServer]:
    port = free_port()
    config = ServiceConfig(**{**config.__dict__, "host": "127.0.0.1", "port": port})
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning",
        timeout_graceful_shutdown=config.shutdown_grace_seconds,
        **uvicorn_options(config),  # as `pagedserve serve` runs it
    ))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start (see the log above)")
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start in time")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(60)
        if thread.is_alive():  # a server left running would serve (and log) into later tests
            raise RuntimeError(f"the server on port {port} did not stop within 60 s; "
                               f"where it stands:\n{where_it_stands(server, app)}")


def where_it_stands(server: uvicorn.Server, app) -> str:
    """Every thread's stack, the loop's tasks and the server's open connections:
    what a stuck shutdown waits on, for a failure seen once in a CI log."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = [f"open connections: {len(server.server_state.connections)}, "
             f"tasks: {len(server.server_state.tasks)}"]
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)}\n"
                     + "".join(traceback.format_stack(frame, limit=12)))
    state = getattr(app.state, "service", None)
    loop = getattr(getattr(state, "engine", None), "_loop", None)
    if loop is not None:
        for task in list(asyncio.all_tasks(loop)):  # read from another thread: a best effort
            text = io.StringIO()
            task.print_stack(limit=8, file=text)
            parts.append(text.getvalue())
    return "\n".join(parts)


def tiny_config(model_path, engine: dict | None = None, **service) -> ServiceConfig:
    """A server on the tiny random Llama: fast, small context, deterministic greedy.

    `engine` changes EngineConfig fields, the keywords ServiceConfig fields.
    """
    settings = dict(model=str(model_path), max_model_len=256, max_num_seqs=64,
                    kv_cache_memory_bytes=64 << 20, seed=0, dtype="float32")
    return ServiceConfig(engine=EngineConfig(**{**settings, **(engine or {})}),
                         served_model_name="tiny", **service)


def child_healthy(process, url: str, output) -> bool:
    """Whether a server started as a child process answers /health with 200;
    raises with its output (`output()`) if it has exited."""
    if process.poll() is not None:
        raise RuntimeError(f"the server exited with {process.returncode}:\n{output()}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def is_error_event(line: str) -> bool:
    """Whether an SSE line is an in-band error event (`data: {"error": ...}`),
    not a chunk whose generated text happens to say "error" (a tiny random
    model does write that word now and then)."""
    payload = line.removeprefix("data:").strip()
    return payload.startswith("{") and "error" in json.loads(payload)
