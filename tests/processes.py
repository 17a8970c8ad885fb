"""Whether processes still run: the tests that start workers check none is left behind."""

from __future__ import annotations

from pathlib import Path

from live_server import wait_until


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Every one of `pids` has exited, within `timeout` seconds."""
    return wait_until(lambda: not any(alive(pid) for pid in pids), timeout=timeout, interval=0.05)


def children(pid: int) -> list[int]:
    """The direct child processes of `pid`."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found
