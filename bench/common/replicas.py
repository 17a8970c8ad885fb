"""`pagedserve serve` replicas as real processes, and the prompts they are sent.

    replica = Replica.start(flags, log_dir, "A")   # on a free loopback port
    replica.wait_ready(); replica.metric("prefix_warm_blocks"); replica.stop()
    redis, url = start_redis(folder)               # a throwaway redis-server
    system_prompts(4, 300, seed=0); questions(10, seed=1)

The fleet benchmarks (bench/fleet/) and `bench hostile` start their servers
with these; the tests' fixtures stop their processes with stop_process.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

POLL_SECONDS = 0.1  # readiness polling (see Replica.wait_ready)
WORDS = ("bicycle chain brake gear saddle pedal wheel spoke tyre valve frame fork lever cable "
         "bearing hub rim sprocket derailleur crank helmet light bell lock pump basket rack "
         "mudguard stand bottle cage grip bar stem seatpost clamp tube patch").split()


@dataclass
class Replica:
    """One `pagedserve serve` process on a free loopback port."""

    process: subprocess.Popen
    url: str
    log: Path

    @classmethod
    def start(cls, flags: list[str], log_dir: Path, name: str,
              port: int | None = None) -> "Replica":
        port = port or free_port()
        log = log_dir / f"{name}.log"
        command = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port), *flags]
        process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
        return cls(process, f"http://127.0.0.1:{port}", log)

    def wait_ready(self, timeout: float = 600) -> list[tuple[float, str]]:
        """Poll /health every 100 ms until 200; the (seconds, status) changes seen.

        Not faster: on 2 cores, answering /health 50 times a second took CPU
        from the engine's threads and stretched a warm-up of 5.6 s to 8.1 s.
        """
        started, seen = time.monotonic(), []
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the replica exited; see {self.log}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                status = response.json().get("status", str(response.status_code))
            except httpx.HTTPError:
                status = "not listening"
            if not seen or seen[-1][1] != status:
                seen.append((round(time.monotonic() - started, 3), status))
            if status == "ok":
                return seen
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"not ready after {timeout} s; see {self.log}")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(f"pagedserve:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        stop_process(self.process, 60)


def stop_process(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM, `grace` seconds to exit, then SIGKILL."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def system_prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"You are assistant number {i} of a bicycle shop. Rules: "
            + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def questions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Question {i}: how much is a {rng.choice(WORDS)} and a {rng.choice(WORDS)}?"
            for i in range(count)]


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                "", "--dir", str(folder)], stdout=subprocess.DEVNULL)
    return process, f"redis://127.0.0.1:{port}/0"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
