"""A real Redis server on a free loopback port, for tests (no mocks).

Debian's `redis-server` (installed by .ci/run). The server runs in a
temporary folder with no persistence unless asked, so tests never share
state; kill() and start() again on the same port is how the fault tests
take Redis away and bring it back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from need import need
from live_server import free_port


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    folder: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _accepts(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_redis(folder: Path, password: str | None = None) -> RedisServer:
    need(redis_binary() is not None, "redis-server is not installed (apt-get install redis-server)")
    return RedisServer(folder, password=password).start()
