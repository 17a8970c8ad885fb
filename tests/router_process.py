"""vLLM's router (the real binary from the vllm-router wheel) as a test's child
process: its log, read with ANSI colours stripped, waited on line by line.
Shared by the service tests that put it in front of real servers and the
deploy tests that run it with docker-compose's and the chart's flags."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from bench.fleet import routing_fronts
from bench.common.replicas import stop_process
from need import need

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def router_binary() -> str:
    found = routing_fronts.router_binary()
    need(found is not None, "vllm-router is not installed (pip install vllm-router)")
    return found


class RouterProcess:
    """`vllm-router ARGS`, its output in `log`."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen([router_binary(), *args], stdout=out,
                                            stderr=subprocess.STDOUT,
                                            env={**os.environ, **(env or {})})

    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace"))

    def wait_for(self, pattern: str, timeout: float = 30, poke=None) -> re.Match:
        """The first log line matching `pattern`; `poke()` runs between looks."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.text())):
            if self.process.poll() is not None:
                pytest.fail(f"vllm-router exited with {self.process.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} in the router's log:\n{self.text()[-4000:]}")
            if poke is not None:
                poke()
            time.sleep(0.1)
        return found

    def stop(self) -> None:
        stop_process(self.process, 15)
