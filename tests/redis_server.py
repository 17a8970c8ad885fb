"""A real Redis server on a free loopback port, for tests (no mocks).

Debian's `redis-server` (installed by .ci/run). The server runs in a
temporary folder with no persistence unless asked, so tests never share
state; kill() and start() again on the same port is how the fault tests
take Redis away and bring it back.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from need import need
from live_server import accepts, free_port


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    folder: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    tls: bool = False  # serve TLS only, with a self-signed certificate made here
    process: subprocess.Popen | None = None
    extra_args: list[str] = field(default_factory=list)  # e.g. ["--maxmemory", "10mb"]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.folder}/cert.pem"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port),
                         "--tls-cert-file", str(self.folder / "cert.pem"),
                         "--tls-key-file", str(self.folder / "key.pem"),
                         "--tls-auth-clients", "no"]
        args += self.extra_args
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not accepts(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None



def start_redis(folder: Path, password: str | None = None, tls: bool = False) -> RedisServer:
    need(redis_binary() is not None, "redis-server is not installed (apt-get install redis-server)")
    if tls:
        _self_signed(folder)
    return RedisServer(folder, password=password, tls=tls).start()


def _self_signed(folder: Path) -> None:
    """cert.pem and key.pem for 127.0.0.1, valid for a day (openssl's command line)."""
    need(shutil.which("openssl") is not None, "openssl is not installed")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
