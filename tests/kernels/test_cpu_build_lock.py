"""The compiled ops' build lock: a builder killed half-way never blocks the next.

torch's own ``lock`` file outlives a killed build and its baton then waits with
no end (the last CI run was killed at its time limit inside ``make install``'s
build, most likely on one left by the session before it);
``build_lock`` queues builders on an flock the kernel drops at death, and
clears the dead builder's file once it holds that flock."""

from __future__ import annotations

import subprocess
import sys
import threading

from kernels.cpu.ops import build_lock

HOLDER = """
import fcntl, sys, time
handle = open(sys.argv[1], "w")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_builders_torch_lock_is_cleared(tmp_path):
    (tmp_path / "lock").write_text("")
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_builder_is_waited_for(tmp_path):
    entered = threading.Event()
    with build_lock(tmp_path):
        waiter = threading.Thread(target=lambda: _enter(tmp_path, entered))
        waiter.start()
        assert not entered.wait(0.3), "entered while another builder held the lock"
    assert entered.wait(30)
    waiter.join()


def test_a_killed_builders_lock_is_released(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "build.flock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # what torch's baton leaves behind
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: _enter(tmp_path, entered))
        waiter.start()
        assert not entered.wait(0.3)
        holder.kill()
        assert entered.wait(30)
        waiter.join()
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def _enter(directory, entered: threading.Event) -> None:
    with build_lock(directory):
        entered.set()
